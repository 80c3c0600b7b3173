"""State-dict helpers that make unevenly sharded DTensors save and load through DCP.

``preprocess_state_dict_for_uneven_dtensor`` walks a nested state dict
(model, optimizer, anything made of dicts and lists), finds every DTensor
and attaches its true chunk metadata, so a plain ``dcp.save`` /
``dcp.load`` writes and reads the right offsets, also when loading into a
different uneven layout or world size. The metadata exchange is batched:
one small all-gather per mesh dim for all DTensors on a mesh, rather than
one collective per tensor.

The traversal helpers address a value of a nested state dict by its *key
chain*, the list of keys (or list indices) leading to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mf_dtensor.chunk_metadata import attach_gathered_layouts, claimed_chunk

__all__ = [
    "filter_unflattened_state_dict",
    "get_unflattened_state_dict",
    "preprocess_state_dict_for_uneven_dtensor",
]


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor)


def filter_unflattened_state_dict(
    state_dict: Any,
    key_chain: Sequence[Any] = (),
    visit_condition: Callable[[Any], bool] = _is_dtensor,
) -> list[list[Any]]:
    """Key chains of every value in a nested state dict for which ``visit_condition`` holds.

    Mappings are entered by key and lists/tuples by index; any other value
    is a leaf. A container that satisfies ``visit_condition`` is reported
    and not entered.

    Args:
        state_dict: the nested state dict (or any sub-tree of one).
        key_chain: keys leading to ``state_dict``; prefixed to every result.
        visit_condition: which values to collect; default, DTensors.

    Returns:
        One key chain (list of keys and indices) per matching value, in
        traversal order.
    """
    if visit_condition(state_dict):
        return [list(key_chain)]
    if isinstance(state_dict, Mapping):
        items: Any = state_dict.items()
    elif isinstance(state_dict, list | tuple):
        items = enumerate(state_dict)
    else:
        return []
    found: list[list[Any]] = []
    for key, value in items:
        found += filter_unflattened_state_dict(value, [*key_chain, key], visit_condition)
    return found


def get_unflattened_state_dict(state_dict: Any, key_chain: Sequence[Any] = ()) -> Any:
    """The value of a nested state dict at ``key_chain`` (the whole dict for an empty chain).

    Raises:
        KeyError: naming the missing key and the chain walked so far.
    """
    value = state_dict
    for depth, key in enumerate(key_chain):
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError) as error:
            raise KeyError(
                f"key_chain: no entry {key!r} under {list(key_chain[:depth])!r} "
                f"(a {type(value).__name__})"
            ) from error
    return value


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """Attach true chunk metadata to every DTensor of ``state_dict`` for DCP (collective).

    Call it on every rank, on state dicts with the same structure, before
    ``dcp.save`` and on the destination state dict before ``dcp.load``. A
    DTensor that already carries metadata on all ranks keeps its offsets
    (e.g. from ``uneven_dtensor_from_local(global_offset=...)``); the others
    get ``Shard``-order offsets computed from their local shapes. Every
    layout is validated.

    Args:
        state_dict: nested dicts/lists whose leaves may be DTensors.

    Returns:
        ``state_dict`` itself; its DTensors are modified in place.

    Raises:
        ValueError: if a DTensor's pieces overlap, leave gaps or are
            unsupported, or the ranks disagree on the DTensors present.
    """
    key_chains = filter_unflattened_state_dict(state_dict)
    by_mesh: dict[DeviceMesh, list[tuple[list[Any], DTensor]]] = {}
    for key_chain in key_chains:
        dtensor = get_unflattened_state_dict(state_dict, key_chain)
        if dtensor.device_mesh.get_coordinate() is None:
            continue  # DCP skips DTensors whose mesh excludes this rank; so do we.
        by_mesh.setdefault(dtensor.device_mesh, []).append((key_chain, dtensor))
    for entries in by_mesh.values():
        dtensors = [dtensor for _, dtensor in entries]
        claimed = [claimed_chunk(dtensor) for dtensor in dtensors]
        names = [
            "state_dict" + "".join(f"[{key!r}]" for key in key_chain) for key_chain, _ in entries
        ]
        attach_gathered_layouts(dtensors, claimed, names)
    return state_dict
