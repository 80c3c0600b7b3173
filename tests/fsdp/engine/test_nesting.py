"""``engine/nesting.py``: which units sit inside which, and walks that split them (pure).

The hooks rely on an outer unit coming right before the units inside it in the walk
(its backward then ends after theirs); an order that splits them is found here, and
``UnitHooks._reorder`` stops every rank on it (``test_fsdp2_nested`` trains nested units).
"""

from __future__ import annotations

from torch import nn

from mf_fsdp.engine.nesting import Nesting
from mf_fsdp.engine.unit import Unit


def _units() -> tuple[Unit, Unit, Unit, Unit]:
    block = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    layer = nn.Sequential(block, nn.Linear(2, 2))
    return (
        Unit(layer, "layer", []),
        Unit(block, "layer.0", []),
        Unit(block[1], "layer.0.1", []),
        Unit(nn.Linear(2, 2), "other", []),
    )


def test_units_around_and_inside() -> None:
    layer, block, attn, other = _units()
    nest = Nesting([layer, block, attn, other])
    assert nest.any
    assert nest.around(attn) == [layer, block]  # outermost first
    assert nest.around(other) == []
    assert (nest.inner_count(layer), nest.inner_count(block), nest.inner_count(attn)) == (2, 1, 0)


def test_an_order_that_splits_an_outer_unit_from_its_inner_ones_is_found() -> None:
    layer, block, attn, other = _units()
    nest = Nesting([layer, block, attn, other])
    assert nest.misplaced([layer, block, attn, other]) is None
    assert nest.misplaced([other, layer, block, attn]) is None
    assert nest.misplaced([layer, block, other, attn]) is layer
    assert nest.misplaced([block, attn, layer, other]) is layer  # after its inner units
    assert nest.misplaced([other, layer, block]) is layer  # an inner unit missing


def test_units_side_by_side_are_not_nested() -> None:
    layer, _, _, other = _units()
    nest = Nesting([layer, other])
    assert not nest.any
    assert nest.misplaced([other, layer]) is None
    assert not nest.recomputed(other)
