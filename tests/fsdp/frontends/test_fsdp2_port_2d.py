"""FSDP2's TP x FSDP (2-D) on ``mf_fsdp.fsdp2``: a dp mesh over part of the ranks.

torch's ``TestFullyShard2DTraining::test_train_parity_2d_mlp`` scenario (in
``test/distributed/_composable/fsdp/test_fully_shard_training.py`` of torch's
sources), and torch's test Transformer with its own TP plan
(``Transformer.parallelize``): tensor parallelism first (``parallelize_module`` over
``world["tp"]``: DTensor parameters), then ``fully_shard(block, mesh=world["dp"])``
per block and on the root. Each scenario
runs with torch's FSDP2 and with mf's on the same 4 gloo ranks (dp 2 x tp 2):
losses, the last gradients and ``full_tensor()`` of every weight after SGD and AdamW
steps, the full state dict (DSD) and its round trip are equal, and each engine loads
the other's DCP checkpoint. A dp mesh beside parameters that
are not tp DTensors over the other dim stays refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import RANK_MODULES
from tests.fsdp._fsdp2_port_common import NEWER_FSDP2, full

preload_in_ranks(*RANK_MODULES, "tests.fsdp._fsdp2_port_common")

WORLD = 4
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)
FULL = StateDictOptions(full_state_dict=True)


def _mlp_stack(world) -> nn.Module:
    """torch's 2-D MLP scenario: three MLPs (one uneven over tp), Colwise in, Rowwise out."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(8, dim_multiplier=3), MLP(8), MLP(8, dim_multiplier=3))
    plan = {}
    for i in range(len(model)):
        plan[f"{i}.in_proj"] = ColwiseParallel()
        plan[f"{i}.out_proj"] = RowwiseParallel()
    return parallelize_module(model, world["tp"], plan)


def _transformer(world) -> nn.Module:
    """torch's test Transformer (untied, no dropout, no causal mask) with its own TP plan.

    On the CPU DTensor has no rule for the flash-attention op; the math kernel
    (``_scenario`` runs the forward under it) without a mask decomposes into ops it has.
    """
    torch.manual_seed(42)
    args = ModelArgs(
        n_layers=2,
        vocab_size=16,
        max_seq_len=8,
        dropout_p=0,
        weight_tying=False,
        use_attn_mask=False,
    )
    return Transformer.parallelize(Transformer(args), world["tp"], use_seq_parallel=False)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers) if isinstance(model, Transformer) else list(model)


def _inputs(model: nn.Module, step: int, dp_rank: int) -> torch.Tensor:
    """Each dp rank its own batch, the same on both tp ranks of it."""
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    if isinstance(model, Transformer):
        return torch.randint(0, 16, (2, 8), generator=gen)
    return torch.randn(2, 8, generator=gen)


def _sharded(shard, build, world) -> nn.Module:
    """``build(world)`` (TP applied), then ``shard`` on each block and the root over dp."""
    model = build(world)
    for block in _blocks(model):
        shard(block, mesh=world["dp"])
    shard(model, mesh=world["dp"])
    return model


def _scenario(shard, build, world, opt_name: str) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """Train STEPS steps: the losses, last grads and weights (full values), the model."""
    model = _sharded(shard, build, world)
    opt_class = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    optim = opt_class(model.parameters(), lr=1e-2)
    result = {}
    for step in range(STEPS):
        optim.zero_grad()
        with sdpa_kernel(SDPBackend.MATH):
            loss = model(_inputs(model, step, world["dp"].get_local_rank())).sum()
        loss.backward()
        result[f"loss{step}"] = loss.detach()
        optim.step()
    result.update((f"grad.{n}", full(p.grad)) for n, p in model.named_parameters())
    result.update((name, full(param)) for name, param in model.named_parameters())
    state = get_model_state_dict(model, options=FULL)
    result.update((f"state.{key}", value) for key, value in state.items())
    # The round trip: the full state dict into a fresh sharded model gives it back.
    fresh = _sharded(shard, build, world)
    set_model_state_dict(fresh, copy.deepcopy(state), options=FULL)
    again = get_model_state_dict(fresh, options=FULL)
    result.update((f"again.{key}", value) for key, value in again.items())
    return result, model


def _dcp_into(saved: nn.Module, shard, build, world, path: str) -> dict[str, torch.Tensor]:
    """DCP-save ``saved``'s sharded state dict; load it into a fresh ``shard`` model."""
    dcp.save(get_model_state_dict(saved), checkpoint_id=path)
    fresh = _sharded(shard, build, world)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    return get_model_state_dict(fresh, options=FULL)


def _assert_equal(got: dict, ref: dict, label: str) -> None:
    assert got.keys() == ref.keys(), (label, got.keys() ^ ref.keys())
    for key, value in ref.items():
        torch.testing.assert_close(
            got[key], value, **TOL, msg=lambda m, k=f"{label} {key}": f"{k}: {m}"
        )


def _refused(world) -> None:
    """Calls on one model over meshes that are not equal (dp, then tp) are refused.

    (A dp mesh over part of the ranks beside plain parameters is served since 0.12:
    ``test_fsdp2_meshes.py``.)
    """
    model = _mlp_stack(world)
    mf_fully_shard(model[0], mesh=world["dp"])
    mf_fully_shard(model, mesh=world["tp"])
    with pytest.raises(NotImplementedError, match="mesh differs between calls"):
        model(torch.randn(2, 8))


_BUILDS = (_mlp_stack, _transformer) if NEWER_FSDP2 else (_mlp_stack,)
"""torch 2.11's DTensor has no sharding rule for the math attention's head-merging view of a
tensor-parallel Transformer (``aten._unsafe_view`` of a ``Shard(1)`` input): tensor
parallelism alone fails there, under either engine, so 2.11 runs the MLP stack only."""


def _rank(rank: int, world_size: int, tmp: str) -> None:
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for build in _BUILDS:
        for opt_name in ("sgd", "adamw"):
            label = f"{build.__name__} {opt_name}"
            ref, torch_model = _scenario(torch_fully_shard, build, world, opt_name)
            got, mf_model = _scenario(mf_fully_shard, build, world, opt_name)
            _assert_equal(got, ref, label)
        # DCP across engines: each loads the other's sharded checkpoint.
        torch_state = get_model_state_dict(torch_model, options=FULL)
        for saved, shard, name in (
            (mf_model, torch_fully_shard, "mf->torch"),
            (torch_model, mf_fully_shard, "torch->mf"),
        ):
            path = f"{tmp}/{build.__name__}-{name}"
            _assert_equal(_dcp_into(saved, shard, build, world, path), torch_state, name)
    _refused(world)
    dist.barrier()


@pytest.mark.multiprocess
def test_tp_then_fully_shard_on_dp_mesh(tmp_path) -> None:
    """``parallelize_module`` on tp, then ``fully_shard(mesh=world["dp"])``: as FSDP2."""
    run_on_ranks(_rank, WORLD, str(tmp_path), timeout=300)
