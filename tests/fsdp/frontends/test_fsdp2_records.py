"""``mf_fsdp.fsdp2``'s records: what each ``fully_shard`` call marked lives on its modules.

No module global holds a mark (issue 53): each call leaves its record on the
modules it was given, a later call on a module holding pending records joins
their family (the model's pending records), and the first use of any module of a model builds that
model's one engine, and only that model's. Marking needs no process group, so
the first checks run in this process; the builds run at world 1.
"""

from __future__ import annotations

import gc
import importlib
import pkgutil
import weakref

import pytest
import torch
from torch import nn

from mf_fsdp import fsdp2
from mf_fsdp.fsdp2.records import RECORD_ATTR, CallRecord, record_of
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import batch, make_model


def _shard(model: nn.Module, root_first: bool = False) -> None:
    """torchtitan's order (blocks, ``[ln_f, lm_head]``, the root), or the root first."""
    if root_first:
        fsdp2.fully_shard(model)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard([model.ln_f, model.lm_head])
    if not root_first:
        fsdp2.fully_shard(model)


def _records(model: nn.Module) -> list[CallRecord]:
    found = {id(r): r for m in model.modules() if (r := m.__dict__.get(RECORD_ATTR))}
    return list(found.values())


def test_each_models_calls_form_one_family_of_its_own() -> None:
    first, second = make_model(), make_model(seed=1)
    _shard(first)
    _shard(second)
    for model in (first, second):
        records = _records(model)
        assert len(records) == len(model.blocks) + 2  # the blocks, the head's list, the root
        assert all(r.engine is None for r in records)  # pending until the first use
        family = record_of(model).family
        assert all(r.family is family for r in records)
        assert {id(r) for r in family} == {id(r) for r in records}


def test_a_root_marked_before_its_blocks_is_in_no_blocks_family() -> None:
    """FSDP2's order is the blocks, then the root: the blocks' calls cannot see a root before."""
    model = make_model()
    _shard(model, root_first=True)
    assert all(r.family == [r] for r in _records(model))


def test_no_module_global_of_the_package_holds_a_mark() -> None:
    model = make_model()
    _shard(model)
    marked = {id(m) for m in model.modules() if RECORD_ATTR in m.__dict__}
    marked |= {id(r) for r in _records(model)}
    names = [fsdp2.__name__] + [
        f"{fsdp2.__name__}.{info.name}" for info in pkgutil.iter_modules(fsdp2.__path__)
    ]
    held = []
    for name in names:
        for key, value in vars(importlib.import_module(name)).items():
            if isinstance(value, dict):
                value = [*value, *value.values()]
            if isinstance(value, list | tuple | set | frozenset | weakref.WeakSet):
                if any(id(item) in marked for item in value):
                    held.append(f"{name}.{key}")
            elif id(value) in marked:
                held.append(f"{name}.{key}")
    assert not held, f"module globals hold marked modules or records: {held}"


def test_a_model_dropped_before_its_first_use_is_collected() -> None:
    model = make_model()
    _shard(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def _rank_two_models(rank: int, world: int) -> None:
    first, second, third = make_model(), make_model(seed=1), make_model(seed=2)
    _shard(first)
    _shard(second)
    _shard(third, root_first=True)
    # A block's first use builds its whole model's engine, and no other model's.
    next(first.blocks[1].parameters())
    engine = record_of(first).engine
    assert engine is not None
    assert record_of(first).is_root
    assert all(r.engine is engine for r in _records(first))
    assert all(r.engine is None for r in _records(second) + _records(third))
    assert {id(u.module) for u in engine._units} == {id(m) for m in (*first.blocks, first.ln_f)}
    # The second model's forward builds its own engine over its own blocks.
    tokens, _ = batch(0, rank)
    assert torch.isfinite(second(tokens)).all()
    other = record_of(second).engine
    assert other is not None
    assert other is not engine
    assert all(record_of(block).unit is not None for block in second.blocks)
    assert {id(u.module) for u in other._units}.isdisjoint({id(u.module) for u in engine._units})
    # A root marked before its blocks still takes them as units at its own first use.
    third(tokens)
    assert all(record_of(block).engine is record_of(third).engine for block in third.blocks)
    assert all(record_of(block).unit is not None for block in third.blocks)


@pytest.mark.multiprocess
def test_a_first_use_builds_its_own_models_engine_only() -> None:
    run_on_ranks(_rank_two_models, 1, timeout=120)
