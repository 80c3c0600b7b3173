"""``shard_placement_fn`` on ``mf_fsdp.fsdp2``: ``Shard(dim)`` and per-parameter meshes, as FSDP2.

One script, run by torch's FSDP2 and by mf at world 2: a block whose first weight
asks for ``Shard(1)`` on the call's mesh, and an experts module whose grouped
weight is a DTensor ``Shard(0)`` over an ``ep`` mesh, placed (torch 2.15's
``ShardPlacementResult``) on the expert-data-parallel mesh of a 2-D
``(edp, ep)`` mesh with ``Shard(1)``: torchtitan's expert-parallel layout in
miniature (edp 1 x ep 2; the dense parameters on a 1-D mesh over both ranks).
Gradient division is FSDP2's default: each parameter averaged over its own
mesh's group (the experts over 1 rank, the rest over 2), so SGD steps see it.

Checked each step: the loss, every parameter's ``full_tensor()`` gradient, and
at the end every parameter's ``full_tensor()`` and state-dict value; mf's state
dict saved by DCP loads into a fresh FSDP2 model with those values. mf keeps its
own row layout whatever the dim asked for (docs/fsdp2.md): the pieces each rank
holds differ from FSDP2's, the values do not. torch 2.11 has ``Shard`` answers
only, so the per-parameter mesh case runs on torch 2.15.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks

try:  # torch 2.15
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:  # torch 2.11: Shard answers only
    ShardPlacementResult = None

WORLD, DIM, EXPERTS, STEPS = 2, 8, 2, 3


class Experts(nn.Module):
    """Grouped expert weights, a DTensor over ``ep``; every expert sees every token."""

    def __init__(self, ep_mesh) -> None:
        super().__init__()
        full = torch.randn(EXPERTS, DIM, DIM) / DIM
        self.w = nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.full_tensor() if isinstance(self.w, DTensor) else self.w
        return torch.einsum("bd,edf->bf", x, w)


class Model(nn.Module):
    def __init__(self, ep_mesh) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
        self.experts = Experts(ep_mesh)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.experts(self.block(x)))).sum()


def _wrapped(shard, per_param_mesh: bool) -> Model:
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("edp", "ep"))
    dp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Model(mesh["ep"])
    expert = {id(model.experts.w)}
    wide = {id(model.block[0].weight)}
    if per_param_mesh:
        edp = FSDPMeshInfo(mesh["edp"], shard_mesh_dim=0)
        dp = FSDPMeshInfo(dp_mesh, shard_mesh_dim=0)

        def place(param: nn.Parameter):
            if id(param) in expert:
                return ShardPlacementResult(placement=Shard(1), mesh_info=edp)
            return ShardPlacementResult(Shard(1) if id(param) in wide else None, mesh_info=dp)
    else:
        model.experts.w = nn.Parameter(model.experts.w.full_tensor())  # a plain parameter

        def place(param: nn.Parameter):
            return Shard(1) if id(param) in wide | expert else None

    shard(model.block, mesh=dp_mesh, shard_placement_fn=place)
    shard(model, mesh=dp_mesh, shard_placement_fn=place)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _run(shard, rank: int, per_param_mesh: bool) -> tuple[Model, list, list, dict, dict]:
    model = _wrapped(shard, per_param_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(STEPS):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x)
        loss.backward()
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: _full(p) for n, p in model.named_parameters()}
    state = {k: _full(v) for k, v in model.state_dict().items()}
    return model, losses, grads, params, state


def _rank_parity(rank: int, world: int, per_param_mesh: bool, tmp: str) -> None:
    mf_model, *mf = _run(fsdp2.fully_shard, rank, per_param_mesh)
    _, *ref = _run(torch_fully_shard, rank, per_param_mesh)
    for got, want in zip(mf, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # DCP round trip: mf's sharded state dict, saved, loads into FSDP2's model (fresh).
    dcp.save(mf_model.state_dict(), checkpoint_id=tmp)
    fresh = _wrapped(torch_fully_shard, per_param_mesh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    fresh.load_state_dict(state)
    loaded = {k: _full(v) for k, v in fresh.state_dict().items()}
    torch.testing.assert_close(loaded, mf[-1], rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "per_param_mesh",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                ShardPlacementResult is None, reason="ShardPlacementResult is torch 2.15's"
            ),
        ),
    ],
)
def test_shard_placement_fn_trains_as_torch_fsdp2(tmp_path, per_param_mesh: bool) -> None:
    run_on_ranks(_rank_parity, WORLD, per_param_mesh, str(tmp_path))


def _rank_refused(rank: int, world: int) -> None:
    """Answers FSDP2 refuses stop at the call (its ``AssertionError``); meshes mf cannot
    serve stop with one line at the build (the model's first use)."""
    dp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    x = torch.randn(2, DIM)
    model = nn.Sequential(nn.Linear(DIM, DIM))
    with pytest.raises(AssertionError, match=r"returned Replicate\(\) for parameter '.*weight'"):
        fsdp2.fully_shard(model, mesh=dp_mesh, shard_placement_fn=lambda p: Replicate())
    with pytest.raises(AssertionError, match="Shard dim 2 is invalid for 2D tensor"):
        fsdp2.fully_shard(model, mesh=dp_mesh, shard_placement_fn=lambda p: Shard(p.dim()))
    if ShardPlacementResult is None:
        return
    # A plain (not expert-parallel) parameter on a mesh over one of the two ranks.
    single = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("rest", "alone"))["alone"]
    other = FSDPMeshInfo(single, shard_mesh_dim=0)
    model = nn.Sequential(nn.Linear(DIM, DIM))
    fsdp2.fully_shard(
        model, mesh=dp_mesh, shard_placement_fn=lambda p: ShardPlacementResult(None, other)
    )
    with pytest.raises(NotImplementedError, match="a DTensor parameter over a 1-D mesh"):
        model(x)
    dist.barrier()


@pytest.mark.multiprocess
def test_shard_placement_fn_answers_mf_cannot_serve_are_refused() -> None:
    run_on_ranks(_rank_refused, WORLD)
