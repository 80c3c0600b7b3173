"""The pipeline cost report (benchmarks/pp_schedule.py) measures both engines and prints them."""

from __future__ import annotations

import pytest
import torch

from tests._multiprocess import preload_in_ranks, run_on_ranks

try:
    import tests.integration._torchtitan_llama_parts  # noqa: F401  (the benchmark's, imported late)
    from benchmarks.pp_schedule import ENGINES, main, measure, report
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

pytestmark = [
    pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete"),
    pytest.mark.filterwarnings("ignore:While redistributing from"),
]
preload_in_ranks(__name__)


def _rank_report(rank: int, world: int) -> None:
    costs = measure(layers=2, microbatches=2, seq=8, steps=1, warmup=1)
    assert [c.engine for c in costs] == [name for name, _ in ENGINES]
    assert len({c.pp_rank for c in costs}) == 1
    for cost in costs:
        assert cost.stage_bytes > 0
        assert cost.held_after > cost.stage_bytes / cost.dp  # the shards at least
        assert cost.held_max >= cost.held_after - cost.pool_after
        assert len(cost.samples) == 2 * cost.microbatches  # a forward and a backward each
        assert cost.moved_dp >= cost.moved_min  # a gather and a reduce-scatter of the stage
        assert cost.moved_pp > 0  # the activations or their grads between the stages
        assert cost.ops > 100
    assert costs[0].pool_after == 0  # FSDP2 has no mf pool
    lines = report(costs)
    assert lines[0].split()[:3] == ["stage", "engine", "weights"]
    assert [line.split()[1] for line in lines[1:3]] == ["fsdp2", "mf"]
    assert lines[3].startswith(f"stage {costs[0].pp_rank}: mf / fsdp2: held max")
    assert len(lines) == 4


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_report_measures_both_engines_on_one_schedule() -> None:
    run_on_ranks(_rank_report, 4, timeout=180)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "1"], "--layers: two stages need at least 2 blocks, got 1"),
        (["--microbatches", "1"], "--microbatches: 1F1B on two stages needs 2, got 1"),
        (["--seq", "65"], "--seq: expected 1 to 64 tokens"),
    ],
)
def test_a_shape_the_schedule_cannot_take_is_one_clear_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
