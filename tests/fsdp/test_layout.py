"""Pure layout math: alignment, shard ranges, pieces tiling every tensor, padding bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mf.models import GPT, PRESETS
from mf_fsdp import compute_bucket_layout, plan_bucket_layouts

shapes_st = st.lists(
    st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple), min_size=0, max_size=12
)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes_st, world=st.integers(1, 17), alignment=st.sampled_from([1, 4, 16, 64]))
def test_pieces_tile_each_tensor_exactly_once(shapes, world, alignment) -> None:
    layout = compute_bucket_layout(shapes, world, alignment)
    assert layout.padded_numel == world * layout.shard_size
    assert layout.padded_numel >= layout.numel
    ends = [s + n for s, n in zip(layout.starts, layout.numels, strict=True)]
    assert all(s % alignment == 0 for s in layout.starts)
    assert all(e <= s2 for e, s2 in zip(ends, layout.starts[1:], strict=False))
    assert layout.shard_size % alignment == 0
    for i, numel in enumerate(layout.numels):
        pieces = [layout.local_piece(i, r) for r in range(world)]
        covered = 0
        for b, e in pieces:
            assert 0 <= b <= e <= numel
            if e > b:
                assert b == covered  # ordered, no gap, no overlap
                covered = e
        assert covered == numel
    assert sum(layout.rank_numel(r) for r in range(world)) == layout.numel
    # Padding bound: under one alignment per tensor plus a tail under world*alignment.
    assert layout.padded_numel - layout.numel < alignment * (len(shapes) + world + 1)


def test_small_example() -> None:
    layout = compute_bucket_layout([(3, 5), (7,), (2, 2)], 2, alignment=4)
    assert layout.starts == (0, 16, 24)
    assert layout.shard_size == 16
    assert layout.local_piece(0, 0) == (0, 15)
    assert layout.local_piece(0, 1) == (15, 15)
    assert layout.local_piece(1, 1) == (0, 7)
    assert layout.local_piece(2, 1) == (0, 4)
    assert layout.rank_numel(0) == 15
    assert layout.rank_numel(1) == 11
    assert math.isclose(layout.padding_fraction, 1 - 26 / 32)


@pytest.mark.parametrize("preset", ["tiny", "small", "25m"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_gpt_presets_pad_under_one_percent(preset: str, world: int) -> None:
    config = PRESETS[preset]
    # Shapes of a Block and of the root unit, without building the big presets' weights.
    d, v = config.d_model, config.vocab_size
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,)]
    block += [(d, 4 * d), (d,)]
    root = [(v, d), (config.seq_len, d), (d,), (d,)]
    for shapes in (block, root):
        assert compute_bucket_layout(shapes, world).padding_fraction < 0.01


def test_tiny_gpt_block_shapes_match_the_model() -> None:
    model = GPT(PRESETS["tiny"])
    shapes = sorted(tuple(p.shape) for p in model.blocks[0].parameters())
    d = PRESETS["tiny"].d_model
    expected = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,)]
    expected += [(d, 4 * d), (d,)]
    assert shapes == sorted(expected)


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
    assert [name for name, _ in plans] == ["", *(f"blocks.{i}" for i in range(12))]
    total = sum(layout.numel for _, layout in plans)
    assert total == PRESETS["150m"].num_parameters()
    per_rank = [sum(layout.shard_size for _, layout in plans)] * world
    # Every rank holds total/world plus the alignment and tail padding of each bucket.
    assert all(total / world <= n <= total / world * 1.01 + 16 * 13 for n in per_rank)
    for _, layout in plans:
        assert sum(layout.rank_numel(r) for r in {0, world // 2, world - 1}) <= layout.numel
