"""The host-cost report (benchmarks/host_cost.py) times each phase of every engine, prints it."""

from __future__ import annotations

import pytest

from benchmarks.host_cost import PHASES, config_of, main, measure, report
from tests._multiprocess import run_on_ranks


def _rank_report(rank: int, world: int) -> None:
    costs = measure(["plain", "fsdp2", "mf-fsdp2", "mf-zero3"], steps=3, warmup=1, bf16=True)
    assert [c.name for c in costs] == ["plain", "fsdp2", "mf-fsdp2", "mf-zero3"]
    for cost in costs:
        assert all(len(cost.seconds[p]) == 3 for p in PHASES)
        assert cost.total > 0
        assert cost.ops > 100
    lines = report(costs)
    assert lines[0].split()[:5] == ["engine", "fwd", "ms", "bwd", "ms"]
    assert lines[1].split()[5] == "1.00"  # plain against itself
    assert len(lines) == 5
    deeper = measure(["plain"], steps=1, warmup=0, bf16=True, layers=4)  # the preset: 2 blocks
    assert deeper[0].ops > costs[0].ops
    narrow = measure(["mf-zero3"], steps=1, warmup=0, layers=3, d_model=16)
    assert narrow[0].total > 0


def test_the_model_measured_is_the_preset_reshaped() -> None:
    tiny = config_of("tiny")
    assert (tiny.n_layers, tiny.d_model) == (2, 64)
    narrow = config_of("tiny", layers=16, d_model=16)
    assert (narrow.n_layers, narrow.d_model, narrow.vocab_size) == (16, 16, tiny.vocab_size)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_report_times_each_engine_interleaved(world: int) -> None:
    run_on_ranks(_rank_report, world)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--d-model", "15"],
            "--d-model: expected a positive multiple of the preset's 4 heads, got 15",
        ),
        (["--d-model", "0"], "--d-model: expected a positive multiple"),
        (["--preset", "huge"], "--preset: invalid choice: 'huge'"),
    ],
)
def test_a_shape_the_preset_cannot_take_is_one_clear_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
