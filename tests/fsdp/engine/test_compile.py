"""``torch.compile`` on a sharded model at world 2: the whole wrapper, and unit by unit.

Unit by unit includes torchtitan's recipe: each block compiled with
``fullgraph=True``, before or after wrapping; the engine's hooks run around
the blocks' graphs (see [Note: hooks outside the compiled graph] in
``mf_fsdp.engine.hooks``). Nothing may crash, the losses must follow the
single-process eager reference within compile's numerical noise (Inductor
fuses and reorders float ops: 1e-4 relative here), and nothing is compiled
again after the first step (a unit) or the second (the whole model: buckets
under 1 MiB take gloo's native collectives; with point-to-point transfers only
it compiles once).
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


def _train_compiled(rank: int, world: int, how: str) -> tuple[list[float], list[int]]:
    """Train with ``how``: "model" (the wrapper compiled), "unit", or torchtitan's recipe
    "unit-fullgraph-before" (each block compiled with fullgraph=True before wrapping)."""
    module = make_model()
    counter = CompileCounterWithBackend("inductor")
    if how == "unit-fullgraph-before":
        for block in module.blocks:
            block.compile(backend=counter, fullgraph=True)
    opt = make_optimizer("sgd", module.parameters())
    model, opt = mf_fsdp.fully_shard(module, opt, fsdp_unit_modules=unit_classes())
    step_fn = model
    if how == "model":
        step_fn = torch.compile(model, backend=counter)
    elif how == "unit":
        for block in model.module.blocks:
            block.compile(backend=counter)
    elif how == "unit-fullgraph-after":
        for block in model.module.blocks:
            block.compile(backend=counter, fullgraph=True)
    losses, frames = [], []
    for step in range(STEPS):
        tokens, targets = batch(step, rank)
        losses.append(optimizer_step(step_fn(tokens, targets), opt, world))
        frames.append(counter.frame_count)
    return losses, frames


def _rank_compile(rank: int, world: int) -> None:
    torch._dynamo.reset()
    ref_losses, _ = reference_run("sgd", world, STEPS)
    for how in ("model", "unit", "unit-fullgraph-before", "unit-fullgraph-after"):
        losses, frames = _train_compiled(rank, world, how)
        assert_losses_match(losses, ref_losses, f"compiled {how}", 1e-4, 1e-5)
        assert frames[0] > 0, f"{how}: nothing was compiled"
        # [Note: hooks outside the compiled graph]: a unit's graph is the block alone,
        # compiled once; the whole model's graph breaks around the hooks and recompiles
        # once, at step 2.
        settled = 1 if how == "model" else 0
        assert frames[-1] == frames[settled], (
            f"{how}: recompiled after step {settled + 1}: {frames}"
        )


@pytest.mark.multiprocess
def test_compiled_sharded_gpt_trains_like_one_process_without_recompiles() -> None:
    run_on_ranks(_rank_compile, 2, timeout=400)
