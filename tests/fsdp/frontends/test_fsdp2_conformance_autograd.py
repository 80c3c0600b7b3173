"""torch's FSDP2 autograd and ignored-parameter tests, against ``mf_fsdp.fsdp2.fully_shard``.

The companion of ``test_fsdp2_conformance`` (same harness, same rules: torch's
scenario and assertions, gloo ranks, the reference cut in mf's layout). A torch
test's kept subtests run in one launch, as torch's ``run_subtests`` runs them.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import DoubleLinear

from mf_fsdp.fsdp2 import fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, check_sharded_parity, torch_case

preload_in_ranks(*RANK_MODULES)


# ---------------------------------------------------------------- test_fully_shard_autograd.py
def _global_batch_step(case, rank, world, model, ref_model, loss_fn, optims, iter_idx) -> None:
    """One step of torch's autograd tests: the reference on the global batch, mf on this rank's.

    The reference's gradients are its global-batch sums divided by the world size (torch's
    ``_reduce_1d_partial_grads``); mf's loss is all-reduced (partial -> replicated).
    """
    local_batch_size, dim = 2, 24
    global_inp = torch.rand((world * local_batch_size, dim))
    local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()
    losses = []
    for each, inp in ((ref_model, global_inp), (model, local_inp)):
        losses.append(loss_fn(each(inp)))
        losses[-1].backward()
    for param in ref_model.parameters():
        if param.grad is not None:
            param.grad.div_(world)
    dist.all_reduce(losses[1])
    case.assertEqual(losses[0], losses[1])
    check_sharded_parity(case, ref_model, model)
    for each in optims:
        each.step()
        each.zero_grad(set_to_none=bool(iter_idx % 2))


def _rank_unused_output(rank: int, world: int) -> None:
    case = torch_case()
    local_batch_size, dim = 2, 24
    for reshard_after_forward in (True, False):  # torch's subtests
        torch.manual_seed(42)
        model = DoubleLinear(dim=dim, use_second_linear=True)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(10):
            # both outputs in the loss for 3 steps, then the first alone
            global_inp = torch.rand((world * local_batch_size, dim))
            local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size]
            out1, out2 = model(local_inp.detach())
            loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
            loss.backward()
            optim.step()
            ref_out1, ref_out2 = ref_model(global_inp)
            ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
            ref_loss.backward()
            for param in ref_model.parameters():
                if param.grad is not None:  # torch's _reduce_1d_partial_grads
                    param.grad.div_(world)
            ref_optim.step()
            dist.all_reduce(loss)  # partial -> replicated
            case.assertEqual(loss, ref_loss)
            optim.zero_grad(set_to_none=bool(iter_idx % 2))
            ref_optim.zero_grad(set_to_none=bool(iter_idx % 2))
            check_sharded_parity(case, ref_model, model)


@pytest.mark.multiprocess
def test_unused_forward_output() -> None:
    """``test_fully_shard_autograd.py::TestFullyShardAutograd::test_unused_forward_output``.

    Kept: ``reshard_after_forward`` True and False (2: see ``test_train_parity_multi_group``).
    """
    run_on_ranks(_rank_unused_output, WORLD)


def _train_global_batch(case, rank, world, model, ref_model) -> None:
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    for iter_idx in range(10):
        _global_batch_step(
            case, rank, world, model, ref_model, torch.sum, (optim, ref_optim), iter_idx
        )


def _rank_unused_module(rank: int, world: int) -> None:
    case = torch_case()
    for reshard_after_forward in (True, False):  # torch's subtests
        torch.manual_seed(42)
        model = DoubleLinear(dim=24, use_second_linear=False)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        _train_global_batch(case, rank, world, model, ref_model)


@pytest.mark.multiprocess
def test_unused_forward_module() -> None:
    """``test_fully_shard_autograd.py::TestFullyShardAutograd::test_unused_forward_module``.

    Kept: ``reshard_after_forward`` True and False (2: see ``test_train_parity_multi_group``).
    """
    run_on_ranks(_rank_unused_module, WORLD)


class _ContainerModule(nn.Module):
    """torch's scenario: two linears on the first item of a container, packed back alike."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()

    def forward(self, inp: Any) -> Any:
        compute = lambda x: self.relu(self.lin2(self.relu(self.lin1(x))))  # noqa: E731
        if isinstance(inp, list):
            return [compute(inp[0])]
        if isinstance(inp, tuple) and hasattr(inp, "_fields"):
            return type(inp)(compute(inp[0]), *inp[1:])
        if isinstance(inp, tuple):
            return (compute(inp[0]),)
        return {"x": compute(inp["x"])}


_NT = collections.namedtuple("_NT", "x y")


class _ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return {"list": [x], "namedtuple": _NT(x, torch.ones_like(x)), "tuple": (x,)}.get(
            self.kind, {"x": x}
        )


class _FromContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: Any) -> torch.Tensor:
        return x["x"] if self.kind == "dict" else x[0]


def _rank_nontensor_activations(rank: int, world: int) -> None:
    case = torch_case()
    for kind in ("list", "namedtuple", "tuple", "dict"):  # torch's subtests
        torch.manual_seed(42)
        model = nn.Sequential(
            _ToContainer(kind), *(_ContainerModule(24) for _ in range(3)), _FromContainer(kind)
        )
        ref_model = copy.deepcopy(model)
        for module in model:
            fully_shard(module)
        fully_shard(model)
        _train_global_batch(case, rank, world, model, ref_model)


@pytest.mark.multiprocess
def test_nontensor_activations() -> None:
    """``test_fully_shard_autograd.py::TestFullyShardAutograd::test_nontensor_activations``.

    Kept: every container type (list, namedtuple, tuple, dict).
    """
    run_on_ranks(_rank_nontensor_activations, WORLD)


# ---------------------------------------------------------- test_fully_shard_ignore_params.py
class _C(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class _B(nn.Module):
    def __init__(self, dim: int, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = _C(dim)
        self.subtrahend = nn.Parameter(subtrahend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class _A(nn.Module):
    def __init__(self, dim: int, addend: torch.Tensor, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.module_b = _B(dim, subtrahend)
        self.addend = nn.Parameter(addend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


def _model_and_input() -> tuple[nn.Module, torch.Tensor]:
    """torch's ``_generate_model_and_input`` (its seeds), on the CPU."""
    dim = 8
    torch.manual_seed(42)
    addend = torch.randn((dim, dim))
    torch.manual_seed(70)
    subtrahend = torch.randn((dim, dim))
    model = _A(dim, addend, subtrahend)
    torch.manual_seed(84)
    return model, torch.randn((dim, dim))


def _rank_ddp_fsdp_ddp(rank: int, world: int) -> None:
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.parallel import DistributedDataParallel

    case = torch_case()
    mesh = init_device_mesh("cpu", (world,))
    ref_model, ref_inp = _model_and_input()
    ref_model = DistributedDataParallel(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    test_model, test_inp = _model_and_input()
    fsdp_ignored = set(test_model.module_b.module_c.parameters())
    # torch's post-order wrap of module_b, skipping the ignored module_c
    fully_shard(test_model.module_b.lin_b, mesh=mesh, ignored_params=fsdp_ignored)
    fully_shard(test_model.module_b, mesh=mesh, ignored_params=fsdp_ignored)
    fsdped = {name for name, m in test_model.named_modules() if isinstance(m, FSDPModule)}
    case.assertEqual(fsdped, {"module_b", "module_b.lin_b"})
    ddp_ignored = {f"module_b.{n}" for n, _ in test_model.module_b.named_parameters()}
    case.assertEqual(
        ddp_ignored,
        {
            "module_b.subtrahend",
            "module_b.lin_b.weight",
            "module_b.lin_b.bias",
            "module_b.module_c.lin_c.weight",
            "module_b.module_c.lin_c.bias",
        },
    )
    named = dict(test_model.named_parameters())
    ddp_ignored = {n for n in ddp_ignored if named[n] not in fsdp_ignored}
    case.assertEqual(
        ddp_ignored, {"module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"}
    )
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        test_model, list(ddp_ignored)
    )
    test_model = DistributedDataParallel(test_model, broadcast_buffers=False)
    test_optim = torch.optim.Adam(test_model.parameters(), lr=1e-2)

    def compare() -> None:
        ref = dict(ref_model.named_parameters())
        test = dict(test_model.named_parameters())
        case.assertEqual(set(ref), set(test))
        for name, ref_param in ref.items():
            full = lambda p: p.full_tensor() if isinstance(p, DTensor) else p  # noqa: E731
            torch.testing.assert_close(full(ref_param), full(test[name]))

    compare()
    for _ in range(3):
        ref_loss, test_loss = ref_model(ref_inp), test_model(test_inp)
        torch.testing.assert_close(ref_loss, test_loss)
        ref_loss.backward()
        test_loss.backward()
        with implicit_replication():
            for optim in (ref_optim, test_optim):
                optim.step()
                optim.zero_grad()
            compare()


@pytest.mark.multiprocess
def test_ddp_A_fsdp_B_ddp_C() -> None:  # noqa: N802 (torch's name)
    """``test_fully_shard_ignore_params.py::TestFullyShardIgnoreParams::test_ddp_A_fsdp_B_ddp_C``."""
    run_on_ranks(_rank_ddp_fsdp_ddp, WORLD)
