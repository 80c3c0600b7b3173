"""Wrapping local tensors as UnevenDTensors, and handing the other ops to DTensor.

:func:`wrap` builds an UnevenDTensor from a local tensor, a spec and a PieceMap
without checks (its callers have checked them); :func:`spec_for` gives tensors
laid out alike one spec object, so the local fast path compares them by
identity. An op no other path takes has its inputs made base DTensors
(:func:`unwrap`), is refused if they hold different PieceMaps
(:func:`check_same_pieces`), runs in DTensor, and every output laid out like an
input is wrapped again (:func:`rewrap`).

Invariants: a wrapped output shares the PieceMap object of the input it is
laid out like, and an in-place op's output is that very input. It must not
communicate (DTensor may, running the op), and must not import the
UnevenDTensor class (``uneven_tensor.py`` imports this module): the functions
take it as ``uneven`` and read its instances through the :class:`Uneven`
protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor.layout import contiguous_stride
from mf_dtensor.pieces import PieceMap, same_pieces

__all__ = ["Uneven", "check_same_pieces", "rewrap", "short_repr", "spec_for", "unwrap", "wrap"]


class Uneven(Protocol):
    """What these helpers read of an :class:`~mf_dtensor.uneven_tensor.UnevenDTensor`.

    ``uneven_tensor.py`` imports the dispatch helpers, so they cannot import the
    class: they read its instances through this protocol, and take the class itself
    (``uneven``) where they must recognise or build one.
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    _pieces: PieceMap

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        ...

    def local_boxes(self) -> Sequence[ChunkStorageMetadata]:
        """This rank's boxes, in the order they are stacked in the local tensor."""
        ...


def short_repr(value: object, limit: int = 160) -> str:
    """``repr(value)``, cut to ``limit`` characters (PieceMaps in messages can be long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_last_spec: tuple[Any, ...] | None = None


def spec_for(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    pieces: PieceMap,
) -> DTensorSpec:
    """The spec of an UnevenDTensor; the previous one's when laid out the same.

    A parameter and its gradient are wrapped one after the other with the same
    PieceMap; sharing one spec object lets the local fast path see that they
    are laid out alike by identity, once per element of every optimizer op.
    Only the last spec is remembered.
    """
    global _last_spec
    last = _last_spec
    if (
        last is not None
        and last[0] is pieces
        and last[1] is mesh
        and last[2] == placements
        and last[3] == shape
        and last[4] == dtype
    ):
        return last[5]
    spec = DTensorSpec(
        mesh,
        placements,
        tensor_meta=TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype),
    )
    _last_spec = (pieces, mesh, placements, shape, dtype, spec)
    return spec


def wrap(
    uneven: type[DTensor],
    local_tensor: torch.Tensor,
    spec: DTensorSpec,
    pieces: PieceMap,
    *,
    requires_grad: bool,
) -> Any:
    """An instance of ``uneven`` (the UnevenDTensor class) over ``local_tensor``, unchecked."""
    # __new__ alone: DTensor.__init__ does nothing but costs several decorator layers.
    result: Any = uneven.__new__(uneven, local_tensor, spec, requires_grad=requires_grad)
    result._pieces = pieces
    return result


def _as_base(tensor: DTensor) -> DTensor:
    return DTensor.__new__(
        DTensor, tensor._local_tensor, tensor._spec, requires_grad=tensor.requires_grad
    )


def unwrap(
    uneven: type[Any],
    value: Any,
    foreach: bool,
    shared: list[Uneven],
    positional: list[list[Uneven]],
) -> Any:
    """``value`` with DTensor subclasses made base DTensors, recording UnevenDTensor inputs.

    aten schemas nest tensors at most one list deep (``Tensor[]``, ``Tensor?[]``).
    A list of a foreach op records its i-th UnevenDTensor in ``positional[i]``;
    anything else goes to ``shared``.
    """
    if isinstance(value, DTensor):
        if type(value) is DTensor:
            return value
        if isinstance(value, uneven):
            shared.append(value)
        return _as_base(value)
    if not isinstance(value, list | tuple):
        return value
    items: list[Any] | None = None
    for position, item in enumerate(value):
        if not isinstance(item, DTensor) or type(item) is DTensor:
            continue
        if items is None:
            items = list(value)
        if isinstance(item, uneven):
            if foreach:
                while len(positional) <= position:
                    positional.append([])
                positional[position].append(item)
            else:
                shared.append(item)
        items[position] = _as_base(item)
    if items is None:
        return value
    return items if isinstance(value, list) else tuple(items)


def check_same_pieces(func: Any, inputs: Iterable[Uneven]) -> None:
    """Raise a ValueError naming ``func`` unless every one of ``inputs`` holds the same PieceMap."""
    first: Uneven | None = None
    for tensor in inputs:
        if first is None:
            first = tensor
        elif not same_pieces(first._pieces, tensor._pieces):
            raise ValueError(
                f"{func}: UnevenDTensor inputs have different PieceMaps "
                f"({short_repr(first._pieces)} and {short_repr(tensor._pieces)}); their local "
                "pieces hold different parts of the tensor and cannot be combined; gather "
                "or redistribute one of them first"
            )


def rewrap(uneven: type[Any], out: Any, candidates: Iterable[Uneven]) -> Any:
    """``out`` as an UnevenDTensor if it is laid out like one of ``candidates``."""
    if type(out) is not DTensor:
        return out
    spec = out._spec
    local = out._local_tensor
    for candidate in candidates:
        if local is candidate._local_tensor and spec == candidate._spec:
            return candidate  # an in-place op: hand back the very input
        other = candidate._spec
        if (
            (other.mesh is spec.mesh or other.mesh == spec.mesh)
            and other.placements == spec.placements
            and other.shape == spec.shape
            and candidate._local_tensor.shape == local.shape
        ):
            return wrap(uneven, local, spec, candidate._pieces, requires_grad=out.requires_grad)
    return out
