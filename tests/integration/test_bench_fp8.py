"""``mf-bench --precision bf16,fp8`` at world 2 on gloo: fp8 rows and fp8 against bf16.

torch's FSDP2 and mf ZeRO-3 on the tiny preset, each in bf16 and with the blocks'
linears in torchao float8. The last table sets each engine's fp8 run against its
bf16 run: tokens/s, and the bytes each rank sends in one no-grad forward (the
weights it gathers). An engine that gathers in bf16 (FSDP2 on gloo, which has no
float8 dtypes; mf until ``FSDP_FLOAT8_ALL_GATHER`` is on) sends the same bytes as
in bf16; one that gathers in FP8 sends about half, plus the weights that stay bf16.
The run at world 2 also proves that the counter leaves mf's gloo gathers working
(it once put back an unbound method, and the profiled step after it failed).
"""

from __future__ import annotations

import pytest

from mf.bench.cli import main
from mf.bench.engines import gathers_float8
from tests._float8 import needs_cpu_float8

pytestmark = [pytest.mark.multiprocess, needs_cpu_float8]

ENGINES = ("fsdp2", "mf-zero3")


@pytest.mark.timeout(600)
def test_fp8_rows_against_bf16_at_world_two(capsys) -> None:
    argv = ["--presets=tiny", "--world=2", "--precision=bf16,fp8", "--engines=" + ",".join(ENGINES)]
    argv += ["--rounds=1", "--steps=1", "--warmup=1", "--seq-len=32", "--device=cpu"]
    assert main([*argv, "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert "-- bf16 --" in out
    assert "-- fp8 --" in out
    table = out.split("-- fp8 against bf16 --\n", 1)[1].splitlines()[1:]
    rows = {fields[0]: fields for fields in (line.split() for line in table) if fields}
    assert sorted(rows) == sorted(ENGINES)
    for engine, fields in rows.items():
        tok_bf16, tok_fp8, _, gather_bf16, gather_fp8, ratio, fp8_gather = fields[2:]
        assert float(tok_bf16) > 0
        assert float(tok_fp8) > 0
        assert float(gather_bf16) > 0
        assert fp8_gather == ("yes" if gathers_float8(engine, "cpu") else "no")
        if fp8_gather == "no":
            assert gather_fp8 == gather_bf16
            assert ratio == "1.000"
        else:
            assert float(ratio) < 0.75
