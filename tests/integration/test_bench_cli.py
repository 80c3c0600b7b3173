"""``mf-bench`` at world 1 in bf16: the throughput table and the host-cost table.

One short run of the tiny preset (plain PyTorch under autocast and mf ZeRO-3
with its bf16 policy) checks that every column is filled: tokens/s, the MFU
footnote, the main thread's CPU ms and the ops per step against plain.
With ``--meta-init`` the sharded engine, wrapped on the meta device, trains
exactly as plain PyTorch and the single-process reference do.
"""

from __future__ import annotations

import re

import pytest

from mf.bench.cli import main

pytestmark = pytest.mark.multiprocess


def _rows(out: str, engines: tuple[str, ...]) -> dict[str, list[list[str]]]:
    """Each engine's rows, split into fields: its throughput row, then its host-cost row."""
    rows: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] in engines:
            rows.setdefault(fields[0], []).append(fields)
    return rows


def test_world_one_bf16_prints_throughput_and_host_cost(capsys) -> None:
    argv = [
        "--presets=tiny",
        "--world=1",
        "--precision=bf16",
        "--engines=plain,mf-zero3",
        "--rounds=1",
        "--steps=2",
        "--warmup=1",
        "--seq-len=32",
        "--device=cpu",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "world 1" in out
    assert "bf16" in out
    assert "MFU: no known peak for this device" in out
    rows = _rows(out, ("plain", "mf-zero3"))
    # One row per engine in each table: throughput, then host cost.
    assert len(rows["plain"]) == 2
    assert len(rows["mf-zero3"]) == 2
    throughput, host = rows["mf-zero3"]
    assert float(throughput[-2]) > 0  # tokens/s
    step_ms, cpu_ms, ops = float(host[2]), float(host[4]), int(host[6])
    assert step_ms > 0
    assert cpu_ms > 0
    assert ops > 100
    assert re.fullmatch(r"\d+\.\d\d", host[7])  # ops against plain's
    assert rows["plain"][1][7] == "1.00"


def test_bad_world_and_peak_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--world=0"])
    assert "--world must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--peak-tflops=-3"])
    assert "--peak-tflops must be positive, got -3.0" in capsys.readouterr().err


def test_meta_init_gives_every_engine_the_single_process_init(capsys) -> None:
    engines = ("plain", "mf-zero3-offload")
    argv = [
        "--presets=tiny",
        "--world=1",
        f"--engines={','.join(engines)}",
        "--rounds=1",
        "--steps=2",
        "--warmup=1",
        "--seq-len=32",
        "--device=cpu",
        "--meta-init",
    ]
    assert main(argv) == 0
    rows = _rows(capsys.readouterr().out, engines)
    # The reference builds on the device, the sharded engines on the meta device
    # (to_empty, then GPT.reset_parameters): the same losses, tied head included.
    dloss = {name: engine_rows[0][-3] for name, engine_rows in rows.items()}
    assert dloss == dict.fromkeys(engines, "0.00e+00")
    assert main([*argv[:2], "--engines=mf-zero3", *argv[3:], "--no-reference"]) == 0
    assert _rows(capsys.readouterr().out, ("mf-zero3",))["mf-zero3"][0][-3] == "-"


def test_cp_runs_report_activations_and_the_traffic_against_its_floors(capsys) -> None:
    argv = [
        "--presets=tiny",
        "--world=2",
        "--cp=1,2",
        "--engines=mf-zero3",
        "--rounds=1",
        "--steps=1",
        "--warmup=1",
        "--seq-len=32",
        "--device=cpu",
        "--no-reference",  # parity under CP is tests/fsdp/engine/test_context_parallel.py's
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("mf-zero3 ")]
    # The cp table: engine, optim, cp, step ms, tokens/s, act MiB, x cp1, peak MiB, cp MiB,
    # x ring, x causal, x mf model.
    cp_rows = {row[2]: row for row in rows if len(row) == 12 and row[2] in ("1", "2")}
    one, two = cp_rows["1"], cp_rows["2"]
    # Half the tokens per rank, fewer saved bytes; cp traffic as mf's model says, exactly.
    assert float(two[6]) < 1.0
    assert one[8:] == ["-", "-", "-", "-"]
    assert float(two[8]) > 0
    assert (two[9], two[10], two[11]) == ("1.50", "2.00", "1.00")


def test_bad_cp_sizes_are_refused(capsys) -> None:
    for argv, message in (
        (["--world=2", "--cp=3"], "--cp: 3 does not divide --world 2"),
        (["--world=2", "--cp=2", "--seq-len=30"], "--seq-len 30 does not split into 2 x 2"),
        (["--world=2", "--cp=2", "--engines=mf-zero3+compile"], "not measured with compiled"),
        (["--cp=two"], "expected comma-separated positive ints, got 'two'"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


def test_moe_rows_report_grouped_against_the_loop_and_dispatch_bytes(capsys) -> None:
    argv = ["--moe=4", "--world=2", "--moe-hidden=16", "--moe-ffn=32", "--moe-tokens=64"]
    assert main([*argv, "--steps=1", "--device=cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    # experts, way, path words..., ms, tokens/s, x loop, peak MiB, x loop
    ways = {row[1]: row for row in rows if len(row) >= 8 and row[0] == "4"}
    assert set(ways) == {"loop", "grouped"}
    assert ways["loop"][-3] == "1.00"
    assert float(ways["grouped"][-4]) > 0  # tokens/s filled (no timing asserted)
    # rank, sent KiB, least KiB, x least, per-choice KiB, x per-choice
    ranks = [row for row in rows if len(row) == 6 and row[0] in ("0", "1")]
    assert len(ranks) == 2
    for _, sent, least, over_least, per_choice, over_choice in ranks:
        # One row per (token, receiving rank), plus the split sizes, each row's local
        # experts and router weights: above the least, below one row per choice.
        assert float(per_choice) > float(sent) >= float(least) > 0
        assert float(over_choice) < 1.0
        assert float(over_least) >= 1.0
    assert "8 all_to_all_single" in out


def test_bad_moe_sizes_are_refused(capsys) -> None:
    for argv, message in (
        (["--moe=3", "--world=2"], "must be a multiple of it"),
        (["--moe=1"], "expert counts of at least --moe-top-k (2)"),
        (["--moe=4", "--moe-ffn=0"], "--moe-ffn must be a positive int, got 0"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
