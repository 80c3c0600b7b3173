"""The padding report (benchmarks/padding.py): its goals hold and the script prints its tables.

Goals: Llama-3-shaped models pad at most 1% in every mf bucket (block and
embedding) at 8..1024 ranks, and mf never needs more per-rank bytes than
Megatron-FSDP's LCM rule, for any model or world size. The one-block shortcut the
report takes is checked against the engine's plan for the whole model.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.padding import (
    DEFAULT_WORLDS,
    MODELS,
    PaddingRow,
    fsdp2_rank_numel,
    lcm_rank_numel,
    main,
    padding_row,
)
from mf_fsdp import plan_bucket_layouts


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int], PaddingRow]:
    return {(m, n): padding_row(m, n) for m in MODELS for n in DEFAULT_WORLDS}


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b"])
def test_llama_buckets_pad_at_most_one_percent(rows, model: str) -> None:
    for world in (8, 64, 512, 1024):
        row = rows[model, world]
        assert row.block.mf_padding <= 0.01, (world, row.block)
        assert row.root.mf_padding <= 0.01, (world, row.root)


def test_mf_never_above_the_lcm_rule(rows) -> None:
    for (model, world), row in rows.items():
        assert row.block.mf <= row.block.lcm, (model, world)
        assert row.root.mf <= row.root.lcm, (model, world)
        assert row.ideal_bytes <= row.rule_bytes("mf") <= row.rule_bytes("lcm"), (model, world)
        assert row.ideal_bytes <= row.rule_bytes("fsdp2"), (model, world)


def test_one_block_times_layers_matches_the_whole_model() -> None:
    spec = MODELS["150m"]
    with torch.device("meta"):
        module = spec.build(spec.n_layers)
    world = 1024
    plans = plan_bucket_layouts(module, world, fsdp_unit_modules=[spec.unit])
    row = padding_row("150m", world)
    assert sum(layout.numel for _, layout in plans) == row.params
    assert sum(p.numel() for p in module.parameters()) == row.params
    assert 16 * sum(layout.shard_size for _, layout in plans) == row.rule_bytes("mf")


def test_reference_rules_on_a_small_example() -> None:
    # FSDP2: 3 rows of 5 -> 2 rows per rank; 7 elements -> 4; a scalar -> 1.
    assert fsdp2_rank_numel([(3, 5), (7,), ()], 2) == 10 + 4 + 1
    # LCM: 22 elements padded to a multiple of 2 x lcm(5, 2, 1) = 20, so 40, 20 per rank.
    assert lcm_rank_numel([(3, 5), (2, 2), (3,)], 2) == 20
    with pytest.raises(ValueError, match="model must be one of"):
        padding_row("gpt-5", 8)
    with pytest.raises(ValueError, match="rule must be 'mf', 'fsdp2' or 'lcm', got 'x'"):
        padding_row("25m", 8).rule_bytes("x")


def test_main_prints_one_table_per_model(capsys) -> None:
    main([])
    out = capsys.readouterr().out
    for model in MODELS:
        assert f"{model}: " in out
    assert out.count("x FSDP2") == len(MODELS)
    assert max(len(line) for line in out.splitlines()) <= 100
    main(["--models", "llama3-8b", "--worlds", "1024"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("llama3-8b: ")
    assert lines[-1].split()[0] == "1024"
