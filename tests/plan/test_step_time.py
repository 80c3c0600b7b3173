"""mf-plan's step-time estimate: its arithmetic, its links and overlap, and its labels.

No kernel is timed (docs/planning.md says so, and so does every line that
prints it): these check that the estimate is the stated model, applied to
the plan's own collectives, and that ``--search`` ranks by it.
"""

from __future__ import annotations

import json

import pytest

from mf.models import PRESETS
from mf.plan.cli import main
from mf.plan.devices import DEVICES
from mf.plan.meta_model import model_source
from mf.plan.model_state import plan_engine
from mf.plan.step_time import MFU, estimate_step_time


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _estimate(gpus: int, dp_outer: int, zero: int = 3, grad_accum: int = 1):
    source = model_source("150m")
    _, wire = plan_engine(source, gpus, zero=zero, precision="bf16", dp_outer=dp_outer)
    return estimate_step_time(
        source,
        wire,
        DEVICES["h100"],
        gpus=gpus,
        gpus_per_node=8,
        dp_outer=dp_outer,
        cp=1,
        micro_batch=4,
        seq_len=512,
        grad_accum=grad_accum,
    )


def test_compute_is_six_flops_per_parameter_and_token_plus_attention() -> None:
    config = PRESETS["150m"]
    tokens = 4 * 512
    flops = (6 * config.num_parameters() + 12 * config.n_layers * config.d_model * 512) * tokens
    step = _estimate(8, 1)
    assert step is not None
    assert step.compute_s == pytest.approx(flops / (989e12 * MFU), rel=1e-12)
    # The engine overlaps: the step is at least the compute, at most compute and wire in turn.
    assert step.compute_s <= step.step_s <= step.compute_s + step.communication_s
    assert step.tokens_per_s == pytest.approx(tokens * 8 / step.step_s)


def test_a_shard_group_across_nodes_runs_at_the_network_bandwidth() -> None:
    across = _estimate(16, 1)  # 16 ranks shard the model: the ring spans two nodes
    within = _estimate(16, 2)  # two replicas of a node each: only their all-reduce crosses
    assert across is not None
    assert within is not None
    assert across.communication_s > 4 * within.communication_s


def test_grad_accum_repeats_the_gathers_not_the_reductions() -> None:
    one, two = _estimate(8, 1, grad_accum=1), _estimate(8, 1, grad_accum=2)
    assert one is not None
    assert two is not None
    assert two.compute_s == pytest.approx(2 * one.compute_s)
    assert one.communication_s < two.communication_s < 2 * one.communication_s


def test_the_estimate_is_labelled_and_absent_without_the_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--model", "tiny", "--gpus", "8"]) == 0
    assert "step time, an ESTIMATE (MFU 0.4" in capsys.readouterr().out
    plan = _plan(capsys, "--model", "tiny", "--gpus", "8")
    assert plan["step_time_estimate"]["estimate"] is True
    custom = _plan(capsys, "--model", "tiny", "--gpus", "8", "--gpu-memory", "80")
    assert custom["step_time_estimate"] is None


def test_search_ranks_by_estimated_tokens_per_second(capsys: pytest.CaptureFixture[str]) -> None:
    found = _plan(capsys, "--model", "tiny", "--gpus", "16", "--search")["configurations"]
    rates = [c["tokens/s (estimate)"] for c in found]
    assert rates == sorted(rates, reverse=True)
    assert all(c["command"].startswith("torchrun --nnodes 2 --nproc-per-node 8") for c in found)
