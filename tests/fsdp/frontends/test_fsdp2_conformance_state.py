"""torch's FSDP2 mixed-precision and state-dict tests, against ``mf_fsdp.fsdp2.fully_shard``.

The companion of ``test_fsdp2_conformance`` (same harness, same rules: torch's
scenario and assertions, gloo ranks, the reference cut in mf's layout). A torch
test's kept subtests run in one launch, as torch's ``run_subtests`` runs them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import SaveForwardInputsModel
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from mf_fsdp.fsdp2 import fully_shard
from mf_fsdp.fsdp2.mixed_precision import default_reduce_dtype
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import (
    RANK_MODULES,
    WORLD,
    broadcast_params,
    check_sharded_parity,
    torch_case,
)
from tests.fsdp._issued import REDUCTIONS, Issued, spy_collectives

preload_in_ranks(*RANK_MODULES)


# ---------------------------------------------------------- test_fully_shard_mixed_precision.py
def _models_and_optims(reshard_after_forward: bool, param_dtype, reduce_dtype):
    """torch's ``_init_models_and_optims``: three MLPs, each a unit, and an fp32 reference."""
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    shard = functools.partial(
        fully_shard, reshard_after_forward=reshard_after_forward, mp_policy=policy
    )
    for mlp in model:
        shard(mlp)
    shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    return ref_model, ref_optim, model, optim


@contextlib.contextmanager
def _spy_reductions(case, dtype: torch.dtype, seen: list[Issued]) -> Iterator[None]:
    """torch's ``reduce_scatter_with_assert``, on the reductions mf really issues.

    torch patches FSDP2's ``reduce_scatter_single``, which mf never calls; on gloo mf
    packs small reduce-scatters into one all-reduce. So every collective the block
    hands to torch.distributed is spied on (``spy_collectives``): each reduction must
    be in ``dtype``, none may go point to point (where the kind is not seen), and the
    reductions are added to ``seen``, which the test checks is not empty at its end
    (a micro-batch without gradient sync reduces nothing).
    """
    with spy_collectives() as issued:
        yield
    case.assertEqual([call for call in issued if call.kind == "point_to_point"], [])
    for call in issued:
        if call.kind in REDUCTIONS:
            case.assertEqual(call.dtype, dtype)
            seen.append(call)


def _copy_back(ref_model, ref_model_low) -> None:
    for param_fp32, param_low in zip(
        ref_model.parameters(), ref_model_low.parameters(), strict=True
    ):
        param_low.detach().copy_(param_fp32)


def _rank_compute_dtype(rank: int, world: int) -> None:
    case = torch_case()
    seen: list[Issued] = []  # the reductions mf issued
    param_dtype = torch.bfloat16
    # reduce_dtype left None: torch 2.11's FSDP2 reduces in param_dtype, 2.15's in the
    # weights' fp32 (test_fsdp2_frontend.py checks mf picks as the installed torch does).
    reduce_dtype = default_reduce_dtype(param_dtype, torch.float32)
    for reshard_after_forward in (False, True):
        ref_model, ref_optim, model, optim = _models_and_optims(
            reshard_after_forward, param_dtype, None
        )
        ref_model_low = copy.deepcopy(ref_model).to(param_dtype)
        predivide, postdivide, _, _ = _get_gradient_divide_factors(
            dist.distributed_c10d._get_default_group(), None, reduce_dtype
        )
        torch.manual_seed(42 + rank + 1)
        inp = torch.randn((4, 16), dtype=param_dtype)
        for iter_idx in range(10):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            with _spy_reductions(case, reduce_dtype, seen):
                fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model_low(inp.to(param_dtype)).sum()
            ref_loss.backward()
            for param_fp32, param_low in zip(
                ref_model.parameters(), ref_model_low.parameters(), strict=True
            ):
                grad = param_low.grad.to(reduce_dtype)
                if predivide is not None and predivide > 1:
                    grad.div_(predivide)
                elif predivide is None:
                    grad.div_(world)
                output = torch.zeros_like(torch.chunk(grad, world)[0])
                dist.reduce_scatter_tensor(output, grad)
                dist.all_gather_into_tensor(grad, output)
                if postdivide is not None and postdivide > 1:
                    grad.div_(postdivide)
                param_fp32.grad = grad.to(param_fp32.dtype)
                param_low.grad = None
            ref_optim.step()
            _copy_back(ref_model, ref_model_low)
            case.assertEqual(fsdp_loss, ref_loss)
            check_sharded_parity(case, ref_model, model)
    case.assertTrue(seen, "mf issued no reduction")


@pytest.mark.multiprocess
def test_compute_dtype() -> None:
    """``test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_compute_dtype``.

    Kept: bf16, ``reshard_after_forward`` False / True (2: see ``test_train_parity_multi_group``);
    dropped: fp16 (gloo cannot reduce it on the CPU) and ``shard_placement_fn``. torch gates
    the test on NCCL for bf16 collectives; gloo reduces bf16 too.
    """
    run_on_ranks(_rank_compute_dtype, WORLD)


def _rank_reduce_dtype_fp32(rank: int, world: int) -> None:
    case = torch_case()
    seen: list[Issued] = []  # the reductions mf issued
    param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    for reshard_after_forward in (False, True):
        ref_model, ref_optim, model, optim = _models_and_optims(
            reshard_after_forward, param_dtype, reduce_dtype
        )
        ref_model_low = copy.deepcopy(ref_model).to(param_dtype)
        torch.manual_seed(42 + rank + 1)
        inp = torch.randn((4, 16), dtype=param_dtype)
        for iter_idx in range(10):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            with _spy_reductions(case, reduce_dtype, seen):
                fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model_low(inp.to(param_dtype)).sum()
            ref_loss.backward()
            for param in ref_model_low.parameters():
                param.grad.data = param.grad.to(torch.float32)
                dist.all_reduce(param.grad)  # fp32 reduction
                param.grad.div_(world)
            for param_fp32, param_low in zip(
                ref_model.parameters(), ref_model_low.parameters(), strict=True
            ):
                param_fp32.grad = param_low.grad
                param_low.grad = None
            ref_optim.step()
            _copy_back(ref_model, ref_model_low)
            case.assertEqual(fsdp_loss, ref_loss)
            check_sharded_parity(case, ref_model, model)
    case.assertTrue(seen, "mf issued no reduction")


def _rank_reduce_dtype_bf16(rank: int, world: int) -> None:
    case = torch_case()
    seen: list[Issued] = []  # the reductions mf issued
    param_dtype, reduce_dtype = torch.float32, torch.bfloat16
    for reshard_after_forward in (False, True):
        ref_model, ref_optim, model, optim = _models_and_optims(
            reshard_after_forward, param_dtype, reduce_dtype
        )
        torch.manual_seed(42 + rank + 1)
        inp = torch.randn((4, 16), dtype=param_dtype)
        for iter_idx in range(10):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            with _spy_reductions(case, reduce_dtype, seen):
                fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model(inp).sum()
            ref_loss.backward()
            for param in ref_model.parameters():
                # torch: funcol reduce-scatter with "avg", then all-gather; gloo has no
                # AVG, so the bf16 halves are divided by the world size (exact at 2) first
                grad = param.grad.to(reduce_dtype).div_(world)
                shard = torch.empty_like(torch.chunk(grad, world)[0])
                dist.reduce_scatter_tensor(shard, grad)
                dist.all_gather_into_tensor(grad, shard)
                param.grad = grad.to(param.dtype)
            ref_optim.step()
            case.assertEqual(fsdp_loss, ref_loss)
            check_sharded_parity(case, ref_model, model)
    case.assertTrue(seen, "mf issued no reduction")


def _rank_reduce_dtype(rank: int, world: int) -> None:
    _rank_reduce_dtype_fp32(rank, world)
    _rank_reduce_dtype_bf16(rank, world)


@pytest.mark.multiprocess
def test_reduce_dtype() -> None:
    """``...::TestFullyShardMixedPrecisionTraining::test_reduce_dtype``, both halves.

    bf16 compute with fp32 reduction, then fp32 compute with bf16 reduction. Kept:
    ``reshard_after_forward`` False / True; dropped: ``shard_placement_fn``.
    """
    run_on_ranks(_rank_reduce_dtype, WORLD)


def _rank_grad_acc_reduce_dtype(rank: int, world: int) -> None:
    case = torch_case()
    seen: list[Issued] = []  # the reductions mf issued
    reshard_after_forward = True
    torch.manual_seed(42)
    param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    num_microbatches = 4
    inp = torch.randn((2 * num_microbatches, 16), dtype=param_dtype)
    for iter_idx in range(10):
        microbatch_inps = torch.chunk(inp, 4)
        for microbatch_idx in range(num_microbatches):
            is_last = microbatch_idx == num_microbatches - 1
            model.set_requires_gradient_sync(is_last)
            model.set_reshard_after_backward(is_last or reshard_after_forward)
            losses = []
            for each in (ref_model_compute, model):
                losses.append(each(microbatch_inps[microbatch_idx].detach()).sum())
                case.assertEqual(losses[-1].dtype, param_dtype)
                with _spy_reductions(case, reduce_dtype, seen):
                    losses[-1].backward()
            case.assertEqual(losses[0], losses[1])
            for ref_param, ref_param_compute in zip(
                ref_model.parameters(), ref_model_compute.parameters(), strict=True
            ):
                case.assertTrue(ref_param_compute.grad is not None)
                case.assertEqual(ref_param.dtype, torch.float32)
                if ref_param.grad is not None:
                    ref_param.grad += ref_param_compute.grad
                else:
                    ref_param.grad = ref_param_compute.grad.to(ref_param.dtype)
                ref_param_compute.grad = None
            if is_last:
                for ref_param in ref_model.parameters():
                    case.assertTrue(ref_param.grad is not None)
                    dist.all_reduce(ref_param.grad)
                    ref_param.grad /= world
        check_sharded_parity(case, ref_model, model)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        _copy_back(ref_model, ref_model_compute)
    case.assertTrue(seen, "mf issued no reduction")


@pytest.mark.multiprocess
def test_grad_acc_with_reduce_dtype() -> None:
    """``...::TestFullyShardMixedPrecisionTraining::test_grad_acc_with_reduce_dtype``.

    Kept: ``reshard_after_forward=True`` (the ``False`` subtest accumulates alike).
    """
    run_on_ranks(_rank_grad_acc_reduce_dtype, WORLD)


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Outer:
    inner: _Pair
    z: torch.Tensor


class _TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class _ContainerLinear(nn.Module):
    """torch's ``ContainerModule``: one linear applied to each tensor of the container."""

    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        self.kind = kind
        self._layer = nn.Linear(dim, dim)

    def forward(self, inp: Any) -> Any:
        layer = self._layer
        if self.kind == "dataclass":
            return _Pair(x=layer(inp.x), y=layer(inp.y))
        if self.kind == "nested_dataclass":
            return _Outer(inner=_Pair(x=layer(inp.inner.x), y=layer(inp.inner.y)), z=layer(inp.z))
        return _TensorPair(x=layer(inp.x), y=layer(inp.y))


class _ToStructure(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        if self.kind == "dataclass":
            return _Pair(x=x, y=x.clone())
        if self.kind == "nested_dataclass":
            return _Outer(inner=_Pair(x=x, y=x.clone()), z=x.clone())
        return _TensorPair(x=x, y=x.clone())


class _FromStructure(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, inp: Any) -> torch.Tensor:
        if self.kind == "nested_dataclass":
            return inp.inner.x + inp.inner.y + inp.z
        return inp.x + inp.y


def _rank_structured(rank: int, world: int) -> None:
    case = torch_case()
    configs = [(None, None), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
    for kind in ("dataclass", "nested_dataclass", "namedtuple"):
        for param_dtype, reduce_dtype in configs:
            torch.manual_seed(42)
            dim, local_batch_size = 16, 2
            model = nn.Sequential(
                _ToStructure(kind),
                _ContainerLinear(kind, dim),
                _ContainerLinear(kind, dim),
                _FromStructure(kind),
            )
            ref_model = copy.deepcopy(model)
            policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            for module in model:
                fully_shard(module, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            if param_dtype is not None:
                ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            torch.manual_seed(1)  # same on all ranks
            for iter_idx in range(10):
                global_inp = torch.rand((world * local_batch_size, dim))
                local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size]
                optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                fsdp_loss = model(local_inp.detach()).sum()
                fsdp_loss.backward()
                optim.step()
                ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                if param_dtype is not None:
                    ref_loss = ref_model_compute(global_inp.to(param_dtype)).sum()
                    ref_loss.backward()
                    if reduce_dtype is not None and reduce_dtype != param_dtype:
                        for p in ref_model_compute.parameters():
                            p.grad.data = p.grad.to(reduce_dtype)
                            dist.all_reduce(p.grad)
                            p.grad.div_(world)
                    else:
                        for p in ref_model_compute.parameters():
                            p.grad.div_(world)
                    for p_fp32, p_compute in zip(
                        ref_model.parameters(), ref_model_compute.parameters(), strict=True
                    ):
                        p_fp32.grad = p_compute.grad.to(p_fp32.dtype)
                        p_compute.grad = None
                    ref_optim.step()
                    _copy_back(ref_model, ref_model_compute)
                else:
                    ref_loss = ref_model(global_inp).sum()
                    ref_loss.backward()
                    for p in ref_model.parameters():
                        p.grad.div_(world)
                    ref_optim.step()
                dist.all_reduce(fsdp_loss)  # partial -> replicated
                case.assertEqual(fsdp_loss, ref_loss)
                if param_dtype is None:
                    check_sharded_parity(case, ref_model, model)


@pytest.mark.multiprocess
def test_structured_input_output() -> None:
    """``...::TestFullyShardMixedPrecisionTraining::test_structured_input_output``, all nine subtests."""  # noqa: E501
    run_on_ranks(_rank_structured, WORLD)


def _rank_float16_on_one_submodule(rank: int, world: int) -> None:
    case = torch_case()
    x = torch.zeros(2, 100)
    forward_inputs: dict[nn.Module, torch.Tensor] = {}
    model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=False)
    fully_shard(model.c2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    fully_shard(model)
    model(x).sum().backward()
    case.assertEqual(forward_inputs[model].dtype, torch.float32)
    case.assertEqual(forward_inputs[model.c1].dtype, torch.float32)
    case.assertEqual(forward_inputs[model.c2].dtype, torch.float16)


@pytest.mark.multiprocess
def test_float16_on_one_submodule() -> None:
    """``...::TestFullyShardMixedPrecisionCasts::test_float16_on_one_submodule``, subtest 1."""
    run_on_ranks(_rank_float16_on_one_submodule, WORLD)


# ---------------------------------------------------------------- test_fully_shard_state_dict.py
def _state_dict_save_load(case, rank: int, model: nn.Module) -> None:
    """torch's ``_test_state_dict_save_load``."""
    for name, param in model.named_parameters():
        case.assertIsInstance(param, DTensor, f"{name} is {type(param)}")
    old_fill_value, new_fill_value = 1, 42 + rank
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(old_fill_value)
    data_ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    ref_sharded_sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    for param, ref_size in zip(model.parameters(), ref_sharded_sizes, strict=True):
        case.assertEqual(param.size(), ref_size)
        case.assertTrue(isinstance(param, nn.Parameter))
    case.assertEqual(set(state_dict.keys()), set(data_ptrs.keys()))
    for name, tensor in state_dict.items():
        case.assertTrue(isinstance(tensor, DTensor))
        if data_ptrs[name] == 0:  # torch: padding, only past rank 0
            case.assertGreater(rank, 0)
            case.assertEqual(torch.count_nonzero(tensor.to_local()).item(), 0)
        else:
            case.assertEqual(tensor.to_local().data_ptr(), data_ptrs[name])
    new_state_dict = {
        name: tensor.detach().clone().fill_(new_fill_value) for name, tensor in state_dict.items()
    }
    for param in model.parameters():
        case.assertEqual(param.to_local(), torch.ones_like(param.to_local()) * old_fill_value)
    model.load_state_dict(new_state_dict)
    for name, param in model.named_parameters():
        local = param.to_local()
        case.assertEqual(local, torch.ones_like(local) * new_fill_value)
        if local.size(0) * param.device_mesh.size() == param.size(0):
            case.assertEqual(local.data_ptr(), data_ptrs[name])


def _rank_dp_state_dict(rank: int, world: int) -> None:
    case = torch_case()
    mesh = init_device_mesh("cpu", (world,))
    for mlp_dim in (2, 3, 4, 5):
        torch.manual_seed(42)
        base_model = nn.Sequential(
            MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim)
        )
        model1 = copy.deepcopy(base_model)
        for module in model1:
            fully_shard(module, mesh=mesh)
        fully_shard(model1, mesh=mesh)
        _state_dict_save_load(case, rank, model1)

        model2 = copy.deepcopy(base_model)
        for module in model2:
            fully_shard(module, mesh=mesh, reshard_after_forward=False)
        fully_shard(model2, mesh=mesh, reshard_after_forward=False)
        _state_dict_save_load(case, rank, model2)
        ref_sharded_sd = model2.state_dict()
        model2(torch.randn((2, mlp_dim)))  # parameters are not resharded after this forward
        sharded_sd = model2.state_dict()
        case.assertEqual(set(ref_sharded_sd.keys()), set(sharded_sd.keys()))
        for key, value in ref_sharded_sd.items():
            case.assertEqual(value, sharded_sd[key])


@pytest.mark.multiprocess
@pytest.mark.xfail(
    strict=True,
    reason="by design: mf's row-aligned pieces may leave rank 0 without rows of a small "
    "parameter; torch asserts an empty piece is padding on a later rank",
)
def test_dp_state_dict_save_load() -> None:
    """``test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load``.

    Kept: ``mlp_dim`` 2, 3, 4, 5 on the 1-D mesh; dropped: ``shard_placement_fn`` and the
    HSDP mesh (world 4). Every other assertion (state-dict values share the parameters'
    storage, ``load_state_dict`` writes back, a state dict after a forward without
    resharding) holds: measured with torch's rank check left out.
    """
    run_on_ranks(_rank_dp_state_dict, WORLD)


def _rank_cached_state_dict(rank: int, world: int) -> None:
    case = torch_case()
    for mlp_dim in (2, 3, 4, 5):
        torch.manual_seed(42)
        model = nn.Linear(mlp_dim, mlp_dim, bias=False)
        fully_shard(model, reshard_after_forward=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sd = model.state_dict()
        case.assertTrue(isinstance(model.weight, DTensor))

        def same_storage(sd=sd, model=model) -> bool:
            return (
                sd["weight"]._local_tensor.untyped_storage().data_ptr()
                == model.weight._local_tensor.untyped_storage().data_ptr()
            )

        case.assertTrue(same_storage())
        torch.manual_seed(42 + rank)
        inp = torch.rand(mlp_dim, mlp_dim)
        for _ in range(5):
            optim.zero_grad()
            model(inp).sum().backward()
            optim.step()
            case.assertTrue(same_storage())


@pytest.mark.multiprocess
def test_cached_state_dict() -> None:
    """``...::TestFullyShardStateDictMultiProcess::test_cached_state_dict``.

    Kept: ``mlp_dim`` 2, 3, 4, 5 with ``mutate_after_state_dict=False``; the ``True`` half
    moves the model to the CPU and back to CUDA.
    """
    run_on_ranks(_rank_cached_state_dict, WORLD)


def _rank_full_state_dict(rank: int, world: int) -> None:
    case = torch_case()
    torch.manual_seed(42)
    ref_model = Transformer(ModelArgs(dropout_p=0.0))
    broadcast_params(ref_model)
    model = copy.deepcopy(ref_model)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module)
    fully_shard(model)
    sharded_sd = model.state_dict()
    if rank == 0:
        ref_full_sd = {k: v.cpu() for k, v in ref_model.state_dict().items()}
    del ref_model
    full_sd = {}
    for name, sharded_param in sharded_sd.items():
        full_param = sharded_param.full_tensor()
        if rank == 0:
            full_sd[name] = full_param.cpu()
    if rank == 0:
        case.assertEqual(len(full_sd), len(ref_full_sd))
        case.assertEqual(list(full_sd.keys()), list(ref_full_sd.keys()))
        for param, ref_param in zip(full_sd.values(), ref_full_sd.values(), strict=True):
            case.assertEqual(param.device, torch.device("cpu"))
            case.assertEqual(param.device, ref_param.device)
            case.assertEqual(param, ref_param)
    else:
        case.assertEqual(len(full_sd), 0)


@pytest.mark.multiprocess
def test_rank0_offload_full_state_dict() -> None:
    """``...::TestFullyShardStateDictMultiThread::test_rank0_offload_full_state_dict``."""
    run_on_ranks(_rank_full_state_dict, WORLD)
