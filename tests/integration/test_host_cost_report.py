"""The host-cost report (benchmarks/host_cost.py) times each phase of every engine, prints it."""

from __future__ import annotations

import pytest

from benchmarks.host_cost import PHASES, _build, _step, config_of, main, measure, report
from mf.bench import CommCounter
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


def _rank_floor(rank: int, world: int) -> None:
    import torch

    floor, floor_opt = _build("comm-floor", config_of("tiny"), bf16=False)
    plain, plain_opt = _build("plain", config_of("tiny"), bf16=False)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    counter = CommCounter()
    with counter.installed():
        counter.enabled = True
        for _ in range(2):
            _step(floor, floor_opt, batch, False, None)
    # Each step: one all-gather of the model's weights, one reduce-scatter of its grads;
    # a group of one needs neither.
    expected = {"all_gather_single": 2, "reduce_scatter_single": 2} if world > 1 else {}
    assert counter.calls == expected
    for _ in range(2):
        _step(plain, plain_opt, batch, False, None)
    for trained, reference in zip(floor.model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(trained, reference)  # the collectives leave the training alone


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_the_communication_floor_makes_a_zero3_steps_collectives_and_trains_as_plain(
    world: int,
) -> None:
    run_on_ranks(_rank_floor, world)


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
