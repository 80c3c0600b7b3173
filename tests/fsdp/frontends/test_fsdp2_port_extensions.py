"""torch's FSDP2 all-gather extension tests (``test_fully_shard_extensions.py``), on torch and mf.

Each scenario runs in the same rank through torch's ``fully_shard`` and through
``mf_fsdp.fsdp2.fully_shard``: torch's ``TwoTensor`` given a pre/post-all-gather
pair (both signatures of ``fsdp_pre_all_gather``) trains as a replicated
reference with hand-averaged gradients, and a bf16-gathering subclass pads its
own uneven piece from ``outer_size``. One launch of two gloo ranks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.two_tensor import TwoTensor

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES, WORLD, check_sharded_parity, torch_case
from tests.fsdp._fsdp2_port_checks import BOTH

preload_in_ranks(*RANK_MODULES)


def _pre_v1(self, mesh):
    return (self.a, self.b), None


def _pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def _post(self, outputs, metadata, param_dtype, *, out=None):
    """Rebuild a TwoTensor; refill ``out`` in place (its halves alias the outputs)."""
    assert metadata is None
    a, b = outputs
    if out is not None:
        assert isinstance(out, TwoTensor), type(out)
        if a.dtype == param_dtype:
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        else:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def _two_tensor_extension(pre) -> Iterator[None]:
    TwoTensor.fsdp_pre_all_gather = pre
    TwoTensor.fsdp_post_all_gather = _post
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather
        del TwoTensor.fsdp_post_all_gather


def _two_tensor_mlps() -> nn.Module:
    """Three bias-free MLPs whose weights are TwoTensors (a and b equal at first)."""
    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        for proj in (mlp.in_proj, mlp.out_proj):
            proj.weight = nn.Parameter(TwoTensor(proj.weight, proj.weight.clone()))
    return model


def _train_parity(case, fully_shard, rank: int, world: int) -> None:
    """``test_all_gather_extensions_train_parity``: 2 signatures x reshard True/False."""
    for pre in (_pre_v1, _pre_v2):
        with _two_tensor_extension(pre):
            for reshard_after_forward in (True, False):
                torch.manual_seed(42)
                model = _two_tensor_mlps()
                ref_model = copy.deepcopy(model)
                ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2, foreach=True)
                shard = functools.partial(fully_shard, reshard_after_forward=reshard_after_forward)
                for mlp in model:
                    shard(mlp)
                shard(model)
                optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
                check_sharded_parity(case, ref_model, model)
                torch.manual_seed(42 + rank + 1)
                inp = torch.randn((2, 8))
                for step in range(10):
                    losses = []
                    for each in (ref_model, model):
                        losses.append(each(inp).sum())
                        losses[-1].backward()
                        if each is ref_model:
                            for param in each.parameters():
                                dist.all_reduce(param.grad)
                                param.grad.detach().div_(world)
                    case.assertEqual(losses[0], losses[1])
                    check_sharded_parity(case, ref_model, model)
                    for each_optim in (ref_optim, optim):
                        each_optim.step()
                        each_optim.zero_grad(set_to_none=(step % 2 == 0))
                    check_sharded_parity(case, ref_model, model)


class _Bf16Gathered(torch.Tensor):
    """A wrapper whose all-gather sends bf16, padding its piece to ``outer_size``'s share."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size())
        if outer_size[0] % mesh.size() == 0:
            return (self._data.to(torch.bfloat16),), None
        padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        assert gathered.dtype == torch.bfloat16
        if out is not None:
            with _unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        whole = gathered.to(param_dtype)
        return whole, (gathered, whole)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        unwrap = functools.partial(pytree.tree_map_only, cls, lambda x: x._data)
        out = func(*unwrap(args), **unwrap(kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, outer_size, outer_stride):
        return inner["_data"]


def _outer_size_stride(case, fully_shard, rank: int, world: int) -> None:
    """``test_all_gather_extension_outer_size_stride``: 9 rows over 2 ranks, one step."""
    model = MLP(dim=3, dim_multiplier=3)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if "weight" in name:
                setattr(module, name, nn.Parameter(_Bf16Gathered(param.detach())))
    fully_shard(model, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    model(torch.randn((2, 3))).sum().backward()
    optim.step()
    optim.zero_grad()


SCENARIOS = (_train_parity, _outer_size_stride)


def _rank_scenarios(rank: int, world: int) -> None:
    case = torch_case()
    for scenario in SCENARIOS:
        for label, fully_shard in zip(BOTH, (torch_fully_shard, mf_fully_shard), strict=True):
            try:
                scenario(case, fully_shard, rank, world)
            except BaseException as error:
                raise AssertionError(f"{scenario.__name__} on {label}: {error}") from error


@pytest.mark.multiprocess
def test_extension_scenarios_match_torch() -> None:
    """torch's all-gather extension tests (listed in docs/fsdp2.md), on torch's FSDP2 and mf."""
    run_on_ranks(_rank_scenarios, WORLD)
