"""Scale simulation: the real engine on one process playing one rank of a 64- or 1024-rank job.

torch's fake process group stands in for the cluster (collectives return at
once and move nothing), so what is checked here is what does not depend on
communicated values: the 150M-parameter GPT, built on the meta device and
materialised unit by unit, leaves each rank holding total / world of the
model state plus the row-alignment padding (never more than the reference's
LCM rule), and a training step runs through every hook at that world size.
Per-rank padding of the presets and of Llama-shaped buckets against FSDP2's
and the reference's rules is printed by ``benchmarks/padding.py``.
"""

from __future__ import annotations

import resource

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import mf_fsdp
from mf.models import GPT, PRESETS, Block
from tests._multiprocess import run_simulated_rank
from tests.fsdp.buckets.test_layout import _gpt_shapes, lcm_rule_padded

pytestmark = pytest.mark.multiprocess

_BYTES = 4  # fp32 weights, grads and each Adam moment


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_simulate(rank: int, world: int) -> None:
    config = PRESETS["150m"]
    total = config.num_parameters()
    with torch.device("meta"):
        module = GPT(config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    before = _peak_rss_bytes()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="init_model_with_meta_device: GPT's meta parameters"):
        model, optimizer = mf_fsdp.fully_shard(
            module,
            optimizer,
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            device=torch.device("cpu"),
            fsdp_unit_modules=[Block],
            zero_dp_strategy="optim_grads_params",
            init_model_with_meta_device=True,
        )
    # Materialised one unit at a time: the peak grew by far less than the whole model.
    assert _peak_rss_bytes() - before < total * _BYTES / 2

    stats = model.bucket_stats()
    assert sum(s.numel for s in stats) == total
    shard = sum(s.shard_numel for s in stats)
    # Whole rows per rank: never more than the reference's LCM rule (test_layout's bound).
    block, root = _gpt_shapes("150m")
    lcm_bound = lcm_rule_padded(root, world) + config.n_layers * lcm_rule_padded(block, world)
    assert total / world <= shard <= lcm_bound // world
    padding_bound = shard * world - total

    tokens = torch.zeros(1, 17, dtype=torch.long)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    footprint = model.memory_footprint(optimizer)
    optimizer.zero_grad()  # set_to_none: the grad shard frees its bytes until the next backward
    assert model.memory_footprint()["grads"] == 0
    # One fp32 copy of the weights (no separate main copy), the grad shard and two Adam
    # moments: 16 bytes per element of this rank's shard, nothing proportional to the model.
    assert footprint["main_params"] == 0
    assert footprint["params"] == shard * _BYTES
    assert footprint["grads"] == shard * _BYTES
    local = sum(s.rank_numel for s in stats)
    assert footprint["optimizer_state"] <= 2 * local * _BYTES + 4 * len(optimizer.state)
    state = footprint["params"] + footprint["grads"] + footprint["optimizer_state"]
    # Plus Adam's scalar step counter per parameter.
    assert state <= 16 * (total + padding_bound) / world + 4 * len(optimizer.state), state


@pytest.mark.parametrize(("world", "rank"), [(64, 63), (1024, 517)])
def test_engine_shards_150m_gpt_at_cluster_scale(world: int, rank: int) -> None:
    run_simulated_rank(_rank_simulate, world, rank=rank, timeout=240)
