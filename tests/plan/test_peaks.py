"""mf-plan's peak bytes per rank against the peak MemTracker measures on two real gloo ranks.

The plan (``mf.plan.phases``) adds the engine's model state, built on the meta
device, to activations from a fake run of the plain model at one and two
layers. Here the same preset is wrapped by mf-train's own sharding call on two
gloo ranks and trains one step (forward, backward, optimizer step) under
torch's ``MemTracker``, which is told of the wrapped model and its optimizer
(so their weights, main weights and state count from the start) and counts
every tensor the step makes and frees, on the CPU. Each rank's measured peak
must be within 10% of its planned peak: tiny and small presets, ZeRO 1 and 3.
With activation checkpointing the plan is known to fall short (docs/planning.md),
and a strict xfail says so until it does not. The activation extension from two
layers is checked against a fake run at full depth.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from mf.models import GPT, PRESETS, Block
from mf.plan import plan_model_state
from mf.plan.activations import checkpoint_layers, fake_peaks, plan_activations
from mf.plan.meta_model import model_source
from mf.plan.phases import plan_phases
from mf.train.rank.setup import shard_module, train_mesh
from tests._multiprocess import run_on_ranks

_WORLD = 2
_SHAPES = {"tiny": (4, 64), "small": (4, 128)}  # preset: (micro-batch, seq-len)
_CASES = [(preset, zero) for preset in _SHAPES for zero in (1, 3)]  # (preset, zero)
_TOLERANCE = 0.10


def _planned_peak(preset: str, zero: int, checkpointing: bool, rank: int) -> int:
    """Rank ``rank``'s planned peak over one training step of ``preset`` on ``_WORLD`` ranks."""
    source = model_source(preset)
    micro_batch, seq_len = _SHAPES[preset]
    state = plan_model_state(source, _WORLD, zero=zero, precision="bf16", rank=rank)
    activations = plan_activations(
        source,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision="bf16",
        checkpointing=checkpointing,
    )
    return plan_phases(state, activations).peak


def _measured_peak(preset: str, zero: int, checkpointing: bool, world: int) -> int:
    """This rank's MemTracker peak over one training step of ``preset`` on ``world`` ranks."""
    mesh = train_mesh("cpu", world, tp=1, cp=1, dp_outer=1)
    torch.manual_seed(0)
    module = GPT(PRESETS[preset])
    if checkpointing:
        checkpoint_layers(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    model, (optimizer,) = shard_module(
        module, [optimizer], mesh, [Block], zero=zero, precision="bf16"
    )
    micro_batch, seq_len = _SHAPES[preset]
    tokens = torch.randint(0, PRESETS[preset].vocab_size, (micro_batch, seq_len + 1))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


def _rank_measure(rank: int, world: int, checkpointing: bool, planned: list[list[int]]) -> None:
    wrong = []
    for case, peaks in zip(_CASES, planned, strict=True):
        measured = _measured_peak(*case, checkpointing, world)
        error = peaks[rank] / measured - 1
        if abs(error) > _TOLERANCE:
            wrong.append(
                f"{case}: planned {peaks[rank]:,}, measured {measured:,} ({100 * error:+.1f}%)"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "checkpointing",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="under activation checkpointing the engine's backward holds pooled "
                "buffers the plan does not count yet: 12-15% short on the small preset",
            ),
        ),
    ],
    ids=["saved", "checkpointed"],
)
def test_planned_peak_is_within_10_percent_of_the_measured_peak(checkpointing: bool) -> None:
    planned = [
        [_planned_peak(*case, checkpointing, rank) for rank in range(_WORLD)] for case in _CASES
    ]
    run_on_ranks(_rank_measure, _WORLD, checkpointing, planned, timeout=300)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_layers_extend_exactly_to_the_full_depth(checkpointing: bool) -> None:
    small = model_source("small")  # four layers
    planned = plan_activations(
        small, micro_batch=2, seq_len=64, precision="bf16", checkpointing=checkpointing
    )
    full = fake_peaks(
        small, 4, micro_batch=2, seq_len=64, precision="bf16", checkpointing=checkpointing
    )
    assert (planned.forward_peak, planned.backward_peak) == full
