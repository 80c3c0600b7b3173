"""Units given as module instances (``plan_buckets(..., unit_modules=...)``), pure planning.

FSDP2's front end passes what ``fully_shard`` was called on: single modules and
groups of modules. Checked on the tiny GPT (LM head tied to the token embedding):
each block is one unit, ``[ln_f, lm_head]`` one unit whose tied weight stays the
root's, model order is kept, and a unit inside another, the root itself or a
module outside the model are refused by name; single units may nest (the inner
unit holds its own parameters, the outer the rest of its module). The class-based path is unchanged
(``test_layout``, ``test_parity``).
"""

from __future__ import annotations

import pytest

from mf_fsdp.buckets.units import plan_buckets
from tests.fsdp._helpers import make_model, unit_classes


def _plan(model, units):
    return {spec.unit_name: spec for spec in plan_buckets(model, (), False, units)}


def test_blocks_and_a_group_become_units_in_model_order() -> None:
    model = make_model()
    units = [(b,) for b in model.blocks] + [(model.ln_f, model.lm_head)]
    specs = _plan(model, units)
    assert list(specs) == ["", "blocks.0", "blocks.1", "ln_f"]
    assert specs["ln_f"].members == (model.ln_f, model.lm_head)
    assert specs["ln_f"].names == ("ln_f.weight", "ln_f.bias")  # lm_head.weight is wte's
    assert "wte.weight" in specs[""].names
    assert "wpe.weight" in specs[""].names
    assert specs["blocks.0"].members == ()


def test_instances_give_the_class_path_buckets_for_the_same_units() -> None:
    model = make_model()
    by_class = plan_buckets(model, tuple(unit_classes()), False)
    by_instance = plan_buckets(model, (), False, [(b,) for b in model.blocks])
    assert [s.names for s in by_class] == [s.names for s in by_instance]


def test_bad_unit_modules_are_refused() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="is a group of modules nested with another unit"):
        plan_buckets(model, (), False, [(model.blocks[0],), (model.blocks[0].attn, model.ln_f)])
    with pytest.raises(ValueError, match="is the root module, not inside"):
        plan_buckets(model, (), False, [(model,)])
    with pytest.raises(ValueError, match="is the root module, not inside"):
        plan_buckets(model, (), False, [(make_model().blocks[0],)])
    with pytest.raises(TypeError, match="expected groups of nn.Modules"):
        plan_buckets(model, (), False, [("blocks.0",)])


def test_nested_units_hold_their_own_parameters() -> None:
    model = make_model()
    block = model.blocks[0]
    specs = _plan(model, [(block.attn,), (block,), (model.blocks[1],)])
    assert list(specs) == ["", "blocks.0", "blocks.0.attn", "blocks.1"]
    attn = {f"blocks.0.attn.{n}" for n, _ in block.attn.named_parameters()}
    assert set(specs["blocks.0.attn"].names) == attn
    outer = {f"blocks.0.{n}" for n, _ in block.named_parameters()} - attn
    assert outer
    assert set(specs["blocks.0"].names) == outer
