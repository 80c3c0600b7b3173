"""FSDPParam: one managed parameter, the facts about it and the tensors torch sees of it.

[Note: parameter forms]
Each managed parameter has two forms, and the module holds one at a time:

==============  ==================================================  ===================
form            what it is                                          registered on the
                                                                    module
==============  ==================================================  ===================
``compute``     the original ``nn.Parameter`` object; its data is   during forward and
                a view of the gathered bucket (compute dtype), its  backward
                grad a view of the bucket's local grad buffer
``sharded``     what the optimizer steps and state dicts hold: a    between passes
                DTensor of the parameter's *global* shape (the
                tp-gathered shape for a TP parameter) whose local
                piece is a view of this rank's whole rows of the
                main weights (``mf_dtensor.UnevenDTensor``); under
                ZeRO-0 without TP, a plain full-shaped view (or the
                compute parameter itself when dtypes agree)
==============  ==================================================  ===================

So between passes ``model.named_parameters()``, ``model.state_dict()`` and
torch's DSD see parameter-shaped, correctly gathered DTensors, as with
PyTorch FSDP2, while forward and backward run on the gathered views.

``ParamPieces`` tells ``UnevenDTensor`` where every rank's piece lies: the
dp members own row ranges of the tp-local tensor (the bucket layout), and a
tp rank's tp-local rows map onto one or, with an interleaving stride,
several row ranges of the global tensor.

This module holds records and pure math only: no buffers, no collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from mf_fsdp.buckets.layout import BucketLayout, row_numel
from mf_fsdp.buckets.tp_params import TPInfo

__all__ = ["FSDPParam", "ParamPieces"]


def _box(offsets: Sequence[int], sizes: Sequence[int]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


@dataclass(frozen=True, slots=True)
class ParamPieces:
    """The boxes every rank of a sharded parameter's mesh holds (a ``mf_dtensor.PieceMap``).

    Attributes:
        layout: the bucket layout over the dp members that own rows (the main layout).
        index: the parameter's position in ``layout``.
        mesh_shape: shape of the sharded parameter's device mesh.
        member_dims: mesh dims whose row-major coordinate is the dp member owning
            rows; empty when every rank holds all rows (ZeRO-0).
        tp_mesh_dim: the mesh dim of tensor parallelism, or None.
        tp_dim: the partition dim of the parameter, or None (not split over tp).
        tp_size: number of tp ranks.
        tp_stride: interleaved blocks per tp rank along dim 0.
        local_shape: the tp-local shape (the shape in the bucket).
        trailing: ``(mesh dim, tensor dim)`` of each further tp split (a dim other than 0).
        row_dim: the dim the layout's rows run along (``FSDPParam.row_dim``).
    """

    layout: BucketLayout
    index: int
    mesh_shape: tuple[int, ...]
    member_dims: tuple[int, ...]
    tp_mesh_dim: int | None
    tp_dim: int | None
    tp_size: int
    tp_stride: int
    local_shape: tuple[int, ...]
    trailing: tuple[tuple[int, int], ...] = ()
    row_dim: int = 0

    def __deepcopy__(self, memo: dict[int, object]) -> ParamPieces:
        return self  # immutable

    def rows_of(self, member: int) -> tuple[int, int]:
        """The tp-local rows ``[begin, end)`` dp member ``member`` owns."""
        return self.layout.local_rows(self.index, member)

    def boxes(self, mesh_index: int) -> tuple[ChunkStorageMetadata, ...]:
        """The global boxes of the rank at row-major position ``mesh_index`` of the mesh."""
        coordinate = []
        for size in reversed(self.mesh_shape):
            coordinate.append(mesh_index % size)
            mesh_index //= size
        coordinate.reverse()
        if self.member_dims:
            member = 0
            for dim in self.member_dims:
                member = member * self.mesh_shape[dim] + coordinate[dim]
            begin, end = self.rows_of(member)
        else:
            begin, end = 0, self.local_shape[self.row_dim]
        tp_rank = 0 if self.tp_mesh_dim is None else coordinate[self.tp_mesh_dim]
        boxes = self._global_boxes(begin, end, tp_rank)
        if not self.trailing:
            return boxes
        shifted = []
        for box in boxes:
            offsets = list(box.offsets)
            for mesh_dim, dim in self.trailing:
                offsets[dim] += coordinate[mesh_dim] * self.local_shape[dim]
            shifted.append(_box(offsets, box.sizes))
        return tuple(shifted)

    def _global_boxes(self, begin: int, end: int, tp_rank: int) -> tuple[ChunkStorageMetadata, ...]:
        if self.row_dim:  # rows along a later dim; tp (if any) unstrided, one box
            offsets, sizes = [0] * len(self.local_shape), list(self.local_shape)
            offsets[self.row_dim], sizes[self.row_dim] = begin, end - begin
            if self.tp_dim is not None:
                offsets[self.tp_dim] += tp_rank * self.local_shape[self.tp_dim]
            return (_box(offsets, sizes),)
        rest = list(self.local_shape[1:])
        if self.tp_dim is None or self.tp_dim > 0:
            offsets = [begin] + [0] * len(rest)
            if self.tp_dim is not None:  # split along a trailing dim: shift that dim
                offsets[self.tp_dim] = tp_rank * rest[self.tp_dim - 1]
            return (_box(offsets, [end - begin, *rest]),)
        # Split along dim 0 in ``stride`` interleaved blocks: tp-local block q holds
        # global rows [q * rows / stride + tp_rank * block, ... + block).
        block = self.local_shape[0] // self.tp_stride
        global_block = block * self.tp_size
        boxes = []
        for q in range(self.tp_stride):
            lo, hi = max(begin, q * block), min(end, (q + 1) * block)
            if lo < hi:
                first = q * global_block + tp_rank * block + (lo - q * block)
                boxes.append(_box([first] + [0] * len(rest), [hi - lo, *rest]))
        return tuple(boxes)


class FSDPParam:
    """One managed parameter: its bucket slice, the rows this rank owns, its TP facts, its forms.

    Attributes:
        compute: the original Parameter (data and grad are views of bucket buffers).
        fqns: every name of the parameter in the wrapped module (tied weights have
            several); the first is its canonical name.
        slots: every ``(module, attribute)`` that registers it.
        index: position in its bucket.
        start: first element in the bucket.
        shape: the shape in the bucket (the tp-local shape).
        tp: the tensor-parallel facts, or None.
        main_rows: the rows ``[begin, end)`` this rank's optimizer owns.
        row_dim: the dim its bucket's rows run along: 0, or a later dim (1, or 2 beside an
            expert-TP split of dim 1) for a stacked weight whose experts do not split
            evenly over the ranks, stored with that dim first (see [Note: stacked weights
            are spread] in ``buckets/units.py``).
        sharded: the optimizer's parameter (see [Note: parameter forms]); set by
            ``optimizer_params.build_sharded_params``.
        grad: ``sharded``'s gradient (a view of the reduced grad store), or None when
            the bucket attaches the compute parameter's own grad (ZeRO-0).
    """

    __slots__ = (
        "compute",
        "fqns",
        "grad",
        "index",
        "main_rows",
        "row_dim",
        "shape",
        "sharded",
        "slots",
        "start",
        "tp",
    )

    def __init__(
        self,
        compute: nn.Parameter,
        fqns: tuple[str, ...],
        slots: tuple[tuple[nn.Module, str], ...],
        index: int,
        start: int,
        shape: torch.Size,
        tp: TPInfo | None,
        main_rows: tuple[int, int],
        row_dim: int = 0,
    ) -> None:
        self.compute = compute
        self.fqns = fqns
        self.slots = slots
        self.index = index
        self.start = start
        self.shape = shape
        self.tp = tp
        self.main_rows = main_rows
        self.row_dim = row_dim
        self.sharded: nn.Parameter = compute
        self.grad: torch.Tensor | None = None

    @property
    def fqn(self) -> str:
        """The parameter's canonical name (its first name in the wrapped module)."""
        return self.fqns[0]

    @property
    def numel(self) -> int:
        """Elements in the bucket (tp-local)."""
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per row (one index along ``row_dim``)."""
        if not self.row_dim:
            return row_numel(self.shape)
        return math.prod(self.shape) // max(self.shape[self.row_dim], 1)

    def stored_shape(self, rows: int) -> tuple[int, ...]:
        """The shape ``rows`` of its rows are stored as in the bucket: ``row_dim`` first."""
        shape = self.rows_shape(rows)
        if not self.row_dim:
            return shape
        return (rows, *shape[: self.row_dim], *shape[self.row_dim + 1 :])

    def rows_shape(self, rows: int) -> tuple[int, ...]:
        """The parameter-shaped shape of ``rows`` of its rows (along ``row_dim``)."""
        return (*self.shape[: self.row_dim], rows, *self.shape[self.row_dim + 1 :])

    def view_rows(self, flat: torch.Tensor, rows: int) -> torch.Tensor:
        """``flat`` (``rows`` of its rows as the bucket stores them) viewed parameter-shaped.

        Cut along dim 1 (``row_dim`` 1), the rows are stored ``[rows, E, D]`` and
        seen as ``[E, rows, D]`` (along dim 2: ``[rows, E, F]`` seen as ``[E, F, rows]``):
        a strided view, no copy (see [Note: stacked weights
        are spread] in ``buckets/units.py``).
        """
        view = flat.view(self.stored_shape(rows))
        return view.movedim(0, self.row_dim) if self.row_dim else view

    def stored_flat(self, value: torch.Tensor) -> torch.Tensor:
        """A parameter-shaped ``value`` flattened in the order the bucket stores it."""
        if self.row_dim:
            value = value.movedim(self.row_dim, 0)
        return value.reshape(-1)

    @property
    def global_shape(self) -> torch.Size:
        """The shape the optimizer and state dicts see (tp-gathered)."""
        return torch.Size(self.shape) if self.tp is None else self.tp.global_shape(self.shape)
