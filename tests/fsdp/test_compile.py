"""``torch.compile`` on a sharded model at world 2: the whole wrapper, and unit by unit.

The engine's hooks may break the graph; they must not crash, the losses must
follow the single-process eager reference within compile's numerical noise
(Inductor fuses and reorders float ops: 1e-4 relative here), and nothing is
compiled again after the second step (no recompile per step). The whole-model
graph recompiles once, at step 2, since buckets under 1 MiB take gloo's
native collectives (with point-to-point transfers only it compiles once).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import mf_fsdp
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_losses_match,
    batch,
    make_model,
    make_optimizer,
    optimizer_step,
    reference_run,
    unit_classes,
)

STEPS = 4


def _train_compiled(rank: int, world: int, per_unit: bool) -> tuple[list[float], list[int]]:
    module = make_model()
    counter = CompileCounterWithBackend("inductor")
    opt = make_optimizer("sgd", module.parameters())
    model, opt = mf_fsdp.fully_shard(module, opt, fsdp_unit_modules=unit_classes())
    if per_unit:  # torchtitan's way: each block compiled, the wrapper left eager
        for block in model.module.blocks:
            block.compile(backend=counter)
        step_fn = model
    else:
        step_fn = torch.compile(model, backend=counter)
    losses, frames = [], []
    for step in range(STEPS):
        tokens, targets = batch(step, rank)
        losses.append(optimizer_step(step_fn(tokens, targets), opt, world))
        frames.append(counter.frame_count)
    return losses, frames


def _rank_compile(rank: int, world: int) -> None:
    torch._dynamo.reset()
    ref_losses, _ = reference_run("sgd", world, STEPS)
    for per_unit in (False, True):
        losses, frames = _train_compiled(rank, world, per_unit)
        label = "per unit" if per_unit else "whole model"
        assert_losses_match(losses, ref_losses, f"compiled {label}", 1e-4, 1e-5)
        assert frames[0] > 0, f"{label}: nothing was compiled"
        assert frames[-1] == frames[1], f"{label}: recompiled after step 2: {frames}"


@pytest.mark.multiprocess
def test_compiled_sharded_gpt_trains_like_one_process_without_recompiles() -> None:
    run_on_ranks(_rank_compile, 2, timeout=400)
