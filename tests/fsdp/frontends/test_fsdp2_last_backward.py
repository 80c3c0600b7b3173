"""``set_is_last_backward`` (issue 57, part 4): micro-batches as with torch's FSDP2.

torch's FSDP2 and ``mf_fsdp.fsdp2`` run the same script in the same gloo ranks:
three steps of three micro-batches, ``set_is_last_backward(False)`` before every
micro-batch but the last, alone and in a pipeline schedule's pattern (gradient
sync and resharding after backward off until the last micro-batch too). The
losses, every grad after the last backward and the weights after each step must
be FSDP2's, with SGD and with AdamW.
"""

from __future__ import annotations

import pytest
import torch

from tests._multiprocess import run_on_ranks
from tests.fsdp.frontends.test_fsdp2_silent import (
    DIM,
    ENGINES,
    OPTIMIZERS,
    _assert_same,
    _model,
    _optimizer,
    _shard_blocks,
    _snapshot,
)

MICRO = 3


def _run(shard, optim_name: str, rank: int, pipeline: bool) -> list[dict[str, object]]:
    model = _model()
    _shard_blocks(model, shard)
    optim = _optimizer(optim_name, model)
    torch.manual_seed(100 + rank)
    records = []
    for _ in range(3):
        optim.zero_grad()
        losses = []
        for micro in range(MICRO):
            last = micro == MICRO - 1
            model.set_is_last_backward(last)
            if pipeline:
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            loss = model(torch.randn(4, DIM)).sum()
            loss.backward()
            losses.append(loss.detach())
        record: dict[str, object] = {"losses": losses, "grads": _snapshot(model, "grad")}
        optim.step()
        record["weights"] = _snapshot(model, "weight")
        records.append(record)
    return records


def _rank_last_backward(rank: int, world: int) -> None:
    for pipeline in (False, True):
        for optim_name in OPTIMIZERS:
            runs = {name: _run(shard, optim_name, rank, pipeline) for name, shard in ENGINES}
            for step, (mf, ref) in enumerate(zip(runs["mf"], runs["torch"], strict=True)):
                label = f"pipeline={pipeline} {optim_name} step {step}"
                torch.testing.assert_close(mf["losses"], ref["losses"], msg=f"{label} losses")
                _assert_same(f"{label} grad", mf["grads"], ref["grads"])  # type: ignore[arg-type]
                _assert_same(f"{label} weight", mf["weights"], ref["weights"])  # type: ignore[arg-type]


@pytest.mark.multiprocess
def test_set_is_last_backward_micro_batches_as_fsdp2() -> None:
    """Micro-batches with ``set_is_last_backward``: FSDP2's losses, grads and weights."""
    run_on_ranks(_rank_last_backward, 2)
