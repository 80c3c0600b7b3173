"""torch's own FSDP2 tests, rebuilt against ``mf_fsdp.fsdp2.fully_shard`` on gloo.

Each test names the torch test it mirrors (``test/distributed/_composable/fsdp/``
in torch's sources; torch's wheel does not ship them) and the parametrisations
kept. The scenario is torch's (models from ``torch.testing._internal``, seeds,
steps, the reference: ``replicate`` or hand-reduced gradients) and so are the
assertions (torch's ``assertEqual`` tolerances); only the harness differs
(``tests.fsdp._fsdp2_conformance``: gloo ranks, the reference cut in mf's layout).
torch runs most of them at 4 or 8 ranks; here 2 (4 where HSDP needs it).

Scenarios mf cannot run yet are ``xfail(strict=True)`` with the reason, so they
flip when the feature lands. This module holds torch's training tests;
``test_fsdp2_conformance_autograd`` the autograd and ignored-parameter ones,
``test_fsdp2_conformance_state`` the mixed-precision and state-dict ones. docs/fsdp2.md,
"torch's FSDP2 tests on mf", lists all of them.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from mf_fsdp.fsdp2 import fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import (
    RANK_MODULES,
    WORLD,
    broadcast_params,
    check_sharded_parity,
    replicated_reference,
    torch_case,
)
from tests.fsdp._fsdp2_port_common import full, on_both

preload_in_ranks(*RANK_MODULES)
TRAINING = "test_fully_shard_training.py"
AUTOGRAD = "test_fully_shard_autograd.py"
c10d_ops = torch.ops.c10d


def _train_losses(pairs, inp, iters: int, case, set_to_none=lambda i: i % 2 == 0) -> None:
    """torch's loop: each model zero_grads, runs, steps; the losses are equal every step."""
    for iter_idx in range(iters):
        losses = []
        for model, optim in pairs:
            optim.zero_grad(set_to_none=set_to_none(iter_idx))
            losses.append(model(*inp(iter_idx)).sum())
            losses[-1].backward()
            optim.step()
        case.assertEqual(losses[0], losses[1])


# ---------------------------------------------------------------- test_fully_shard_training.py
def _rank_single_group(rank: int, world: int, shapes, use_shard_placement_fn: bool) -> None:
    for lin_shapes in shapes:  # torch's subtests
        _single_group(rank, lin_shapes, use_shard_placement_fn)


def _single_group(rank: int, lin_shapes, use_shard_placement_fn: bool) -> None:
    case = torch_case()
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)

    def largest_dim(param: nn.Parameter):
        from torch.distributed.tensor import Shard

        return Shard(param.shape.index(max(param.shape)))

    fully_shard(model, shard_placement_fn=largest_dim if use_shard_placement_fn else None)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    inp = (torch.randn((4, lin_shapes[0][0])),)
    _train_losses([(ref_model, ref_optim), (model, optim)], lambda _: inp, 10, case)


@pytest.mark.multiprocess
def test_train_parity_single_group_shard_dim0() -> None:
    """``test_fully_shard_training.py::TestFullyShard1DTrainingCore::test_train_parity_single_group_shard_dim0``.

    Kept: every ``lin_shapes`` (16x15/15x8, 7x15/15x3, 16x17/17x8), torch's subtests.
    """
    shapes = [[(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]]
    run_on_ranks(_rank_single_group, WORLD, shapes, False)


@pytest.mark.multiprocess
def test_train_parity_single_group_shard_largest_dim() -> None:
    """``...::TestFullyShard1DTrainingCore::test_train_parity_single_group_shard_largest_dim``.

    mf keeps its row layout whatever dim ``shard_placement_fn`` names (docs/fsdp2.md).
    """
    run_on_ranks(_rank_single_group, WORLD, [[(32, 16), (16, 8)]], True)


def _rank_multi_group(rank: int, world: int, reshard_values, offload_policy) -> None:
    for reshard_after_forward in reshard_values:  # torch's subtests
        _multi_group(rank, world, reshard_after_forward, offload_policy)


def _multi_group(rank: int, world: int, reshard_after_forward, offload_policy) -> None:
    case = torch_case()
    torch.manual_seed(42)
    vocab_size = 1024
    args = ModelArgs(n_layers=3, n_heads=4, vocab_size=vocab_size, max_seq_len=64, dropout_p=0)
    model = Transformer(args)
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (world,))
    shard = functools.partial(
        fully_shard,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        offload_policy=offload_policy,
    )
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            shard(module)
    shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    inps = [torch.randint(0, vocab_size, (3, 64)) for _ in range(10)]
    _train_losses([(ref_model, ref_optim), (model, optim)], lambda i: (inps[i],), 10, case)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("reshard_values", "offload_policy"),
    [
        ((True, False), None),
        pytest.param((2,), None),
        pytest.param((True,), CPUOffloadPolicy(pin_memory=False)),
    ],
    ids=["bool", "int-2", "cpu-offload"],
)
def test_train_parity_multi_group(reshard_values, offload_policy) -> None:
    """``...::TestFullyShard1DTrainingCore::test_train_parity_multi_group``, ``_cpu_offload_eager``.

    Kept: ``reshard_after_forward`` True / False / 2 (at world 2 the shard group's size,
    which FSDP2 and mf both take as True), ``CPUOffloadPolicy(pin_memory=False)``;
    dropped: the ``delay_*`` axes (CUDA sleep kernels against stream races: gloo on the CPU
    has no streams) and ``unshard_async_op`` (a private FSDP2 knob). The CPU offload case
    runs mf's ``offload_optimizer_state`` (host and device are one on the CPU, but its
    separate host buffers and copies run).
    """

    run_on_ranks(_rank_multi_group, WORLD, reshard_values, offload_policy or OffloadPolicy())


def _rank_non_root(rank: int, world: int) -> None:
    case = torch_case()
    torch.manual_seed(42)
    lin_dim = 32
    model = nn.Sequential(*[MLP(lin_dim, torch.device("cpu")) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + rank)
    inp = torch.randn((8, lin_dim))

    def reduce_ref_grads() -> None:
        for param in ref_model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.detach().div_(world)

    ref_root_loss = ref_model(inp).sum()
    ref_root_loss.backward()
    reduce_ref_grads()
    ref_optim.step()
    ref_optim.zero_grad()
    ref_nonroot_loss = ref_model[0](inp).sum()
    ref_nonroot_loss.backward()
    reduce_ref_grads()
    ref_optim.step()

    root_loss = model(inp).sum()
    root_loss.backward()
    optim.step()
    optim.zero_grad()
    nonroot_loss = model[0](inp).sum()
    nonroot_loss.backward()
    optim.step()

    case.assertEqual(ref_root_loss, root_loss)
    case.assertEqual(ref_nonroot_loss, nonroot_loss)
    case.assertEqual(ref_model(inp).sum(), model(inp).sum())


@pytest.mark.multiprocess
def test_non_root_forward_backward() -> None:
    """``...::TestFullyShard1DTrainingCore::test_non_root_forward_backward`` (its sleep dropped)."""
    run_on_ranks(_rank_non_root, WORLD)


class MultiForwardModule(nn.Module):
    """torch's scenario: ``inner`` runs twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def _rank_multi_forward(rank: int, world: int) -> None:
    case = torch_case()
    torch.manual_seed(42)
    model = MultiForwardModule()
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    fully_shard(model.inner)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank)
    inp = (torch.randn((32, 4)),)
    _train_losses([(ref_model, ref_optim), (model, optim)], lambda _: inp, 10, case)


@pytest.mark.multiprocess
def test_multi_forward_module() -> None:
    """``...::TestFullyShard1DTrainingCore::test_multi_forward_module``.

    torch's subtests vary ``reshard_after_forward`` but its body never passes it to
    ``fully_shard``: the one scenario is run once.
    """
    run_on_ranks(_rank_multi_forward, WORLD)


def _rank_explicit_prefetching(rank: int, world: int) -> None:
    case = torch_case()
    torch.manual_seed(42)
    args = ModelArgs(n_layers=8, dropout_p=0.0)
    model = Transformer(args)
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for layer in itertools.chain(model.layers, [model]):
        fully_shard(layer)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layers = model.layers
    for i, layer in enumerate(layers[:-2]):
        layer.set_modules_to_forward_prefetch([layers[i + 1], layers[i + 2]])
    for i, layer in enumerate(layers):
        if i >= 2:
            layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])
    torch.manual_seed(42 + rank)
    inp = (torch.randint(0, args.vocab_size, (2, 8)),)
    _train_losses([(ref_model, ref_optim), (model, optim)], lambda _: inp, 10, case, lambda _: True)


@pytest.mark.multiprocess
def test_explicit_prefetching() -> None:
    """``...::TestFullyShard1DTrainingCore::test_explicit_prefetching``."""
    run_on_ranks(_rank_explicit_prefetching, WORLD)


def _rank_float64_after_init(rank: int, world: int) -> None:
    case = torch_case()
    torch.__future__.set_swap_module_params_on_conversion(True)  # torch's wrapSwapTensorsTest
    torch.manual_seed(42)
    mlp_dim, dtype = 4, torch.float64
    model = MLP(mlp_dim)
    broadcast_params(model)
    ref_model = copy.deepcopy(model).to(dtype)
    replicated = replicated_reference(ref_model)
    ref_optim = torch.optim.Adam(replicated.parameters(), lr=1e-2)
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module)
    model.to(dtype)

    def assert_dtypes(tensor: Any) -> None:
        case.assertEqual(tensor.dtype, dtype)
        case.assertEqual(tensor.to_local().dtype, dtype)
        case.assertEqual(tensor._spec.tensor_meta.dtype, dtype)

    for param in model.parameters():
        assert_dtypes(param)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    check_sharded_parity(case, replicated, model)
    torch.manual_seed(42 + rank + 1)
    inp = torch.randn((2, mlp_dim), dtype=dtype)
    for iter_idx in range(10):
        losses = []
        for each in (replicated, model):
            losses.append(each(inp).sum())
            losses[-1].backward()
        case.assertEqual(losses[0], losses[1])
        check_sharded_parity(case, replicated, model)
        for param in model.parameters():
            assert_dtypes(param)
            assert_dtypes(param.grad)
        for each in (ref_optim, optim):
            each.step()
            each.zero_grad(set_to_none=(iter_idx % 2 == 0))


@pytest.mark.multiprocess
def test_to_float64_after_init() -> None:
    """``...::TestFullyShardCastAfterInit::test_to_float64_after_init``."""
    run_on_ranks(_rank_float64_after_init, WORLD)


def _assert_dtensor_params(case, params) -> None:
    params = list(params)
    case.assertGreater(len(params), 0)
    for param in params:
        case.assertIsInstance(param, DTensor)


def _rank_registration_after_backward(rank: int, world: int, values) -> None:
    case = torch_case()
    for reshard_after_forward in values:  # single FSDP group
        model = MLP(8)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randn((2, 8))
        _assert_dtensor_params(case, model.parameters())
        model(inp).sum().backward()
        _assert_dtensor_params(case, model.parameters())
    for reshard_after_forward in values:  # multiple FSDP groups
        model = MLP(8)
        fully_shard(model.in_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model.out_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        _assert_dtensor_params(case, model.parameters())
        model(inp).sum().backward()
        _assert_dtensor_params(case, model.parameters())


@pytest.mark.multiprocess
def test_param_registration_after_backward() -> None:
    """``...::TestFullyShardRegisteredParams::test_param_registration_after_backward``.

    torch loops over ``reshard_after_forward`` in (True, False, 2) at world 4; kept: True
    and False (2 is refused by ``fully_shard``, see ``test_train_parity_multi_group``).
    """
    run_on_ranks(_rank_registration_after_backward, WORLD, (True, False))


def _rank_registration_after_forward(rank: int, world: int) -> None:
    case = torch_case()
    for reshard_after_forward in (True, False, None):
        torch.manual_seed(42)
        model = MLP(3)
        broadcast_params(model)
        ref_model = copy.deepcopy(model)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randn((2, 3))
        _assert_dtensor_params(case, model.parameters())
        model(inp)
        if reshard_after_forward:
            _assert_dtensor_params(case, model.parameters())
        else:
            for param in model.parameters():  # torch's _assert_tensor_params
                case.assertNotIsInstance(param, DTensor)
        for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            case.assertEqual(full, ref_param)
        model.reshard()
        _assert_dtensor_params(case, model.parameters())


@pytest.mark.multiprocess
@pytest.mark.xfail(
    strict=True,
    reason="by design: between passes mf's modules register the sharded parameters; FSDP2 "
    "registers the unsharded ones while a unit stays gathered (reshard_after_forward=False)",
)
def test_param_registration_after_forward() -> None:
    """``...::TestFullyShardRegisteredParams::test_param_registration_after_forward``.

    Kept: the single-group half for True, False, None (2 fails earlier, at ``fully_shard``).
    """
    run_on_ranks(_rank_registration_after_forward, WORLD)


def _rank_shared_params(rank: int, world: int) -> None:
    for reshard_after_forward, use_ac in itertools.product([False, True], [False, True]):
        _shared_params(rank, reshard_after_forward, use_ac)


def _shared_params(rank: int, reshard_after_forward: bool, use_ac: bool) -> None:
    from torch.distributed._composable import checkpoint

    case = torch_case()
    torch.manual_seed(42)
    args = ModelArgs(n_layers=3, dropout_p=0.0, weight_tying=True)
    model = Transformer(args)
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            if use_ac:
                checkpoint(module)
            fully_shard(module, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    inps = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(10)]
    _train_losses([(ref_model, ref_optim), (model, optim)], lambda i: (inps[i],), 10, case)


@pytest.mark.multiprocess
def test_train_parity_with_shared_params() -> None:
    """``...::TestFullyShardSharedParams::test_train_parity_with_shared_params``.

    Kept: all four subtests (``reshard_after_forward`` x activation checkpointing); torch
    runs them at world 4.
    """
    run_on_ranks(_rank_shared_params, WORLD)


class TiedModel(nn.Module):
    """torch's scenario: the output projection's weight is the embedding's."""

    def __init__(self, vocab_size: int, hidden_size: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.tok_embeddings(ids))


def _rank_separate_groups_error(rank: int, world: int) -> None:
    case = torch_case()
    vocab_size = 17
    model = TiedModel(vocab_size)
    fully_shard(model.tok_embeddings)
    fully_shard(model.output)
    fully_shard(model)
    ids = torch.randint(0, vocab_size, (2, 8))
    with case.assertRaisesRegex(ValueError, "already managed by another"):
        model(ids)


@pytest.mark.multiprocess
@pytest.mark.xfail(
    strict=True,
    reason="by design: mf gives a weight shared by two units to their common ancestor",
)
def test_shared_params_separate_fsdp_groups_error() -> None:
    """``...::TestFullyShardSharedParams::test_shared_params_separate_fsdp_groups_error``."""
    run_on_ranks(_rank_separate_groups_error, WORLD)


def _rank_grad_accumulation(rank: int, world: int, reshard_after_forward: bool) -> None:
    """torch's scenario with ``mode="all"``, ``reshard_after_backward=True``, the 1-D mesh."""
    case = torch_case()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(42)
    batch_size, lin_dim, num_mlps, num_microbatches = (2, 32, 3, 3)
    model = nn.Sequential(nn.Linear(lin_dim, lin_dim), *(MLP(lin_dim) for _ in range(num_mlps)))
    ref_model = copy.deepcopy(model)
    for mlp in model[1:]:
        fully_shard(mlp, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    for iter_idx in range(5):
        counts: dict[Any, int] = defaultdict(int)
        for microbatch_idx in range(num_microbatches):
            model.set_requires_gradient_sync(microbatch_idx == num_microbatches - 1)
            inp = torch.randn(batch_size, lin_dim)
            losses = []
            for each in (ref_model, model):
                with CommDebugMode() as comm_mode:
                    losses.append(each(inp).sum())
                    losses[-1].backward()
                for op, count in comm_mode.get_comm_counts().items():
                    counts[op] += count
            case.assertEqual(losses[0], losses[1])
        # torch's expected counts for this mode: one reduce-scatter per unit (the MLPs and
        # the root's linear) on the last micro-batch; one all-gather per unit in each
        # micro-batch's forward, and again in its backward when resharded after forward
        case.assertEqual(counts[c10d_ops._reduce_scatter_base_], num_mlps + 1)
        case.assertEqual(counts[c10d_ops.allreduce_], 0)
        gathers = (num_mlps + 1) * (2 if reshard_after_forward else 1) * num_microbatches
        case.assertEqual(counts[c10d_ops._allgather_base_], gathers)
        for param in ref_model.parameters():
            if param.grad is not None:  # torch: all_reduce(AVG), which gloo lacks
                dist.all_reduce(param.grad)
                param.grad.div_(world)
        check_sharded_parity(case, ref_model, model)
        for each in (optim, ref_optim):
            each.step()
            each.zero_grad(set_to_none=bool(iter_idx % 2))


@pytest.mark.multiprocess
@pytest.mark.xfail(
    strict=True,
    reason="by design: mf coalesces the units' collectives inside its communication window "
    "and keeps them gathered across micro-batches (1 all-gather and 1 reduce-scatter per "
    "micro-batch here, where FSDP2 issues one per unit)",
)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_gradient_accumulation(reshard_after_forward: bool) -> None:
    """``...::TestFullyShardGradientAccumulation::test_gradient_accumulation``.

    Kept: ``mode="all"`` with ``reshard_after_backward=True`` on the 1-D mesh, for
    ``reshard_after_forward`` True and False, collective counts through ``CommDebugMode``
    as torch counts them. Not run: ``root_only`` and ``some_mlps`` (per-module gradient
    sync: mf syncs the whole model), ``reshard_after_backward=False``, 2, CPU offload and
    the HSDP mesh: each fails at the same collective counts before its own option matters.
    """
    run_on_ranks(_rank_grad_accumulation, WORLD, reshard_after_forward)


def _rank_grouped_cast(rank: int, world: int) -> None:
    case = torch_case()
    dim = 32

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(dim, dim, bias=False)
            self.b = nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).float())

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(42)
    model = Model()
    broadcast_params(model)
    fully_shard([model.a, model.b], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    out = model(torch.randn(2, dim))
    case.assertEqual(out.dtype, torch.bfloat16)
    out.sum().backward()
    for name, param in model.named_parameters():
        case.assertIsNotNone(param.grad, f"grad None for {name}")


@pytest.mark.multiprocess
def test_grouped_module_cast_forward_inputs() -> None:
    """``...::TestFullyShard1DTrainingCompose::test_grouped_module_cast_forward_inputs``."""
    run_on_ranks(_rank_grouped_cast, WORLD)


# ------------------------------------------------------- more of test_fully_shard_training.py
def _rank_root_no_forward_inputs(rank: int, world: int) -> None:
    case = torch_case()

    class ParameterOnlyModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self) -> torch.Tensor:
            return self.weight @ self.weight

    model = ParameterOnlyModule()
    fully_shard(model)
    out = model()
    case.assertEqual(out.shape, (4, 4))
    out.sum().backward()


@pytest.mark.multiprocess
def test_root_no_forward_inputs() -> None:
    """``test_fully_shard_training.py::TestFullyShardForwardInputs::test_root_no_forward_inputs``."""
    run_on_ranks(_rank_root_no_forward_inputs, WORLD)


def _rank_layer_by_layer(rank: int, world: int) -> None:
    import gc

    dim, n_blocks = 16, 8

    class SimpleBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.linear = nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.norm(x))

    class LayerByLayerModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    model = LayerByLayerModel()
    for _ in range(n_blocks):
        block = SimpleBlock()
        model.blocks.append(block)
        fully_shard(block)
        gc.collect()
    fully_shard(model)
    model(torch.randn(2, 4, dim)).sum().backward()


@pytest.mark.multiprocess
def test_layer_by_layer_shard_no_false_positive() -> None:
    """``...::TestFullyShardSharedParams::test_layer_by_layer_shard_no_false_positive``."""
    run_on_ranks(_rank_layer_by_layer, WORLD)


def _rank_double_forward(rank: int, world: int) -> None:
    case = torch_case()
    for reshard_after_forward, checkpoint_impl in itertools.product(
        [True, False], ["composable", "utils"]
    ):  # torch's subtests, each on torch's FSDP2 and on mf: equal grads, losses, weights
        on_both(case, _double_forward, rank, reshard_after_forward, checkpoint_impl)


def _double_forward(shard, rank: int, reshard_after_forward: bool, checkpoint_impl: str):
    """torch's scenario (nested units, two forwards, one backward), then one SGD step."""
    from torch.distributed._composable import checkpoint

    case = torch_case()
    torch.manual_seed(42)
    vocab_size = 1024
    args = ModelArgs(
        n_layers=3,
        n_heads=4,
        vocab_size=vocab_size,
        max_seq_len=64,
        dropout_p=0,
        checkpoint_activations=(checkpoint_impl == "utils"),
    )
    model = Transformer(args)
    if checkpoint_impl == "composable":
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                checkpoint(module)
    for layer in model.layers:
        shard(layer.attention, reshard_after_forward=reshard_after_forward)
        shard(layer.feed_forward, reshard_after_forward=reshard_after_forward)
        shard(layer, reshard_after_forward=reshard_after_forward)
    shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank)
    inp1 = torch.randint(0, vocab_size, (2, 32))
    inp2 = torch.randint(0, vocab_size, (2, 32))
    out1, out2 = model(inp1), model(inp2)  # the DPO pattern
    loss = (out1.sum() - out2.sum()).pow(2)
    loss.backward()
    for param in model.parameters():
        if param.requires_grad:
            case.assertIsNotNone(param.grad)
    grads = [full(p.grad) for p in model.parameters()]
    optim.step()
    after = model(inp1).sum()
    return [loss.detach(), after.detach(), *grads, *(full(p) for p in model.parameters())]


@pytest.mark.multiprocess
def test_double_forward_with_nested_fsdp_and_checkpoint() -> None:
    """``...::TestFullyShard1DTrainingCompose::test_double_forward_with_nested_fsdp_and_checkpoint``."""
    run_on_ranks(_rank_double_forward, WORLD)
