"""Leaves of a module's inputs and outputs, dataclass instances included.

torch's pytree treats a dataclass it has no registration for as one leaf, so the
tensors inside a ``@dataclass`` passed between units (a structured activation)
would be invisible to the hooks: no backward hook on them, no cast. FSDP2 looks
inside dataclasses; so does ``flatten`` here, below the pytree nodes torch knows.
It only reads: ``rebuild`` makes new dataclass instances (``dataclasses.replace``)
and never changes the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["flatten"]


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _replacing(leaf: Any, rebuild_fields: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """Rebuild ``leaf`` (a dataclass instance) with its fields from new leaves."""
    return lambda new: dataclasses.replace(leaf, **rebuild_fields(new))


def flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The leaves of ``tree`` and a function that rebuilds it from as many new leaves.

    A dataclass instance left as a pytree leaf is opened: its ``init`` fields'
    leaves come in its place, and ``rebuild`` puts them back through
    ``dataclasses.replace``.
    """
    leaves, spec = tree_flatten(tree)
    if not any(_is_dataclass_instance(leaf) for leaf in leaves):
        return leaves, lambda new: tree_unflatten(new, spec)
    flat: list[Any] = []
    parts: list[tuple[int, Callable[[list[Any]], Any] | None]] = []
    for leaf in leaves:
        if not _is_dataclass_instance(leaf):
            flat.append(leaf)
            parts.append((1, None))
            continue
        fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.init}
        inner, rebuild_fields = flatten(fields)
        flat.extend(inner)
        parts.append((len(inner), _replacing(leaf, rebuild_fields)))

    def rebuild(new: list[Any]) -> Any:
        out, start = [], 0
        for count, make in parts:
            piece = new[start : start + count]
            start += count
            out.append(piece[0] if make is None else make(piece))
        return tree_unflatten(out, spec)

    return flat, rebuild
