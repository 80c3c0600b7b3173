"""Pure layout math: whole-row pieces tiling every tensor, shard ranges, padding bounds.

Every rank's piece of every tensor must be a whole number of dim-0 rows (the
optimizer sees parameter-shaped pieces); the padding this costs is bounded
by one row per tensor plus rounding the shard to a multiple of the row sizes,
never the reference's LCM rule on the presets, and bucket splitting only
happens where it saves more padding than a collective costs.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mf.models import GPT, PRESETS
from mf_fsdp import compute_bucket_layout, partition_bucket, plan_bucket_layouts
from mf_fsdp.buckets.layout import SPLIT_COST_ELEMENTS, row_numel

shapes_st = st.lists(
    st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple), min_size=0, max_size=12
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def lcm_rule_padded(shapes, world: int) -> int:
    """The reference's rule: the bucket padded to a multiple of world x LCM of row sizes."""
    multiple = math.lcm(1, *(row_numel(s) for s in shapes))
    return _round_up(sum(math.prod(s) for s in shapes), world * multiple)


def check_layout(layout, shapes, world: int) -> None:
    assert layout.padded_numel == world * layout.shard_size
    assert layout.padded_numel >= layout.numel
    spans = sorted((s, s + n) for s, n in zip(layout.starts, layout.numels, strict=True) if n)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(end <= layout.padded_numel for _, end in spans)
    for i, numel in enumerate(layout.numels):
        row = row_numel(shapes[i])
        covered = 0
        for rank in range(world):
            begin, end = layout.local_piece(i, rank)
            assert 0 <= begin <= end <= numel
            assert begin % row == 0, (shapes[i], rank, begin)  # whole rows only
            assert end % row == 0, (shapes[i], rank, end)
            rows = layout.local_rows(i, rank)
            assert rows == (begin // row, end // row)
            if end > begin:
                assert begin == covered  # ordered, no gap, no overlap
                covered = end
        assert covered == numel
    assert sum(layout.rank_numel(r) for r in range(world)) == layout.numel


@settings(max_examples=300, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 17), alignment=st.sampled_from([1, 4, 16]))
def test_pieces_are_whole_rows_and_tile_each_tensor_once(shapes, world, alignment) -> None:
    layout = compute_bucket_layout(shapes, world, alignment)
    check_layout(layout, shapes, world)
    # The bound the search guarantees: one shard size that is a multiple of every row
    # size and holds the data plus one row and one alignment step per tensor.
    multiple = math.lcm(1, *(row_numel(s) for s in shapes))
    slack = sum(row_numel(s) - 1 + alignment - 1 for s in shapes)
    bound = _round_up(-(-(layout.numel + slack) // world), multiple) if layout.numel else 0
    assert layout.shard_size <= bound


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 9))
def test_partition_covers_every_tensor_once(shapes, world) -> None:
    parts = partition_bucket(shapes, world)
    indices = sorted(i for group, _ in parts for i in group)
    assert indices == list(range(len(shapes)))
    for group, layout in parts:
        assert list(group) == sorted(group)
        check_layout(layout, [shapes[i] for i in group], world)
    # Split only where it pays: the split padding is the merged one minus at least
    # SPLIT_COST_ELEMENTS per extra bucket, or the data is one bucket.
    if len(parts) > 1:
        merged = compute_bucket_layout(shapes, world).padded_numel
        split = sum(layout.padded_numel for _, layout in parts)
        assert split < merged


def test_small_example() -> None:
    # Rows of 5: the boundary at 16 would cut row 3 of the first tensor, so that tensor
    # starts one element later (its rows end on the boundary) and the 7-vector fills
    # the gap left before it.
    layout = compute_bucket_layout([(3, 5), (7,), (2, 2)], 2, alignment=1)
    assert layout.shard_size == 15
    assert layout.starts == (0, 15, 22)
    assert layout.local_rows(0, 0) == (0, 3)
    assert layout.local_rows(0, 1) == (3, 3)
    assert layout.local_rows(1, 1) == (0, 7)
    assert layout.local_rows(2, 1) == (0, 2)
    assert math.isclose(layout.padding_fraction, 1 - 26 / 30)


def test_long_tensors_force_shards_in_whole_rows() -> None:
    # A tensor crossing two boundaries needs a shard that is a multiple of its row.
    layout = compute_bucket_layout([(10, 3)], 4, alignment=1)
    assert layout.shard_size == 9  # ceil(30 / 4) = 8 rounded up to 3 rows
    assert [layout.local_rows(0, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def _gpt_shapes(preset: str) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    config = PRESETS[preset]
    d, v = config.d_model, config.vocab_size
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,)]
    block += [(d, 4 * d), (d,)]
    return block, [(v, d), (config.seq_len, d), (d,), (d,)]


def _llama_shapes(d: int, ffn: int, kv: int, vocab: int):
    block = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,)]
    return block, [(vocab, d), (d,), (vocab, d)]


@pytest.mark.parametrize("world", [2, 4, 8, 16])
@pytest.mark.parametrize("preset", ["tiny", "small", "25m", "150m"])
def test_gpt_presets_never_above_the_lcm_rule(preset: str, world: int) -> None:
    for shapes in _gpt_shapes(preset):
        parts = partition_bucket(shapes, world)
        padded = sum(layout.padded_numel for _, layout in parts)
        assert padded <= lcm_rule_padded(shapes, world)
        if preset in ("25m", "150m"):
            assert 1 - sum(map(math.prod, shapes)) / padded < 0.01


@pytest.mark.parametrize("world", [8, 64, 512, 1024])
@pytest.mark.parametrize(
    "model", [(4096, 14336, 1024, 128256), (8192, 28672, 1024, 128256)], ids=["8B", "70B"]
)
def test_llama_buckets_pad_at_most_one_percent(model, world: int) -> None:
    for shapes in _llama_shapes(*model):
        parts = partition_bucket(shapes, world)
        padded = sum(layout.padded_numel for _, layout in parts)
        assert 1 - sum(map(math.prod, shapes)) / padded <= 0.01
        assert padded <= lcm_rule_padded(shapes, world)


def test_split_only_when_it_saves_a_collective() -> None:
    block, _ = _llama_shapes(4096, 14336, 1024, 128256)
    # 8 ranks: the 28672-element LCM costs little, one bucket. 1024 ranks: the MLP's
    # 14336-element rows apart from the 4096-element ones, and the norms apart.
    assert len(partition_bucket(block, 8)) == 1
    parts = partition_bucket(block, 1024)
    assert [group for group, _ in parts] == [(0, 1, 2, 3, 4, 5), (6,), (7, 8)]
    merged = compute_bucket_layout(block, 1024).padded_numel
    split = sum(layout.padded_numel for _, layout in parts)
    assert merged - split > 2 * SPLIT_COST_ELEMENTS


def test_tiny_gpt_block_shapes_match_the_model() -> None:
    model = GPT(PRESETS["tiny"])
    shapes = sorted(tuple(p.shape) for p in model.blocks[0].parameters())
    assert shapes == sorted(_gpt_shapes("tiny")[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shapes": [(2,)], "world_size": 0}, "world_size must be a positive int, got 0"),
        ({"shapes": [(2,)], "world_size": 2, "alignment": 0}, "alignment must be a positive"),
        ({"shapes": [(2, -1)], "world_size": 2}, r"negative dimension in \(2, -1\)"),
    ],
)
def test_bad_layout_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        compute_bucket_layout(**kwargs)


def test_rank_out_of_range() -> None:
    layout = compute_bucket_layout([(4,)], 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        layout.shard_range(2)


@pytest.mark.parametrize("world", [1, 2, 64, 1024])
def test_plan_bucket_layouts_on_a_meta_model(world: int) -> None:
    import torch

    with torch.device("meta"):
        model = GPT(PRESETS["150m"])
    plans = plan_bucket_layouts(model, world, fsdp_unit_modules=["mf.models.gpt.Block"])
    names = [name for name, _ in plans]
    assert names[0] == ""
    assert sorted(set(names)) == sorted({"", *(f"blocks.{i}" for i in range(12))})
    total = sum(layout.numel for _, layout in plans)
    assert total == PRESETS["150m"].num_parameters()
    block, root = _gpt_shapes("150m")
    per_rank = sum(layout.shard_size for _, layout in plans)
    lcm_per_rank = (lcm_rule_padded(root, world) + 12 * lcm_rule_padded(block, world)) // world
    assert total / world <= per_rank <= lcm_per_rank
