"""``UnevenDTensor``: a DTensor with explicit pieces, so its gathers and checkpoints stay right.

torch's DTensor assumes every ``Shard(d)`` piece has the size ``torch.chunk``
gives it. A DTensor built with ``DTensor.from_local(..., shape=..., stride=...)``
whose pieces have other sizes computes elementwise ops correctly, but its
``full_tensor()``, ``redistribute()`` and torch.distributed.checkpoint (DCP)
planning are silently wrong. :class:`UnevenDTensor` carries a :class:`PieceMap`
(which boxes of the global tensor each rank of the mesh holds) and overrides
exactly those three things; every other op is delegated to DTensor, and
outputs laid out like an input are wrapped again, so optimizer states,
``zeros_like``, ``clone`` and friends stay ``UnevenDTensor`` with the same
pieces.

Responsibility: the subclass, gathering and re-cutting by boxes, and the
three DCP hooks. The PieceMap contract and the pure box math live in
:mod:`mf_dtensor.pieces`; the engine that decides the pieces (mf-fsdp)
lives elsewhere.

Invariants:
    - A rank's local tensor is ``torch.cat([full[box] for box in boxes], 0)``
      for its boxes (row-major mesh index), all boxes of a rank share their
      sizes in every dim but 0, and no boxes means a local tensor with 0 rows.
    - Ranks that differ only along ``Replicate`` mesh dims hold the same
      boxes; the boxes of the ranks along the other mesh dims tile the tensor.
    - A PieceMap is immutable; UnevenDTensors derived from one share the
      object (never a copy, not even under ``copy.deepcopy``).

What it must not do: communicate anywhere but in :meth:`UnevenDTensor.full_tensor`,
:meth:`UnevenDTensor.redistribute` and :func:`uneven_local_piece` with a
DTensor value; materialise every rank's boxes except where a gather needs
the boxes of the ranks it gathers from; patch torch (it only registers the
class in torch's lists of foreach-capable tensor types, as DTensor does).

[Note: implicit redistribution] Only ops that keep the layout are safe:
elementwise and foreach ops between tensors of one PieceMap (and scalars),
``zeros_like``/``clone``/``detach``/``to``, reductions to a ``Partial``
scalar such as norms, in-place random fills (``normal_``, ``uniform_``:
see [Note: random fills]), and ``copy_`` from a value every rank holds whole
(a plain tensor or an all-``Replicate`` DTensor of the global shape), and
``any()``/``all()`` of the whole tensor. Two kinds of ops are silently wrong, because DTensor
assumes ``torch.chunk`` pieces for them:
    - ops whose sharding strategy redistributes an input (slicing a sharded
      dim, mixing with a ``Replicate`` or standard ``Shard`` operand of the
      full shape): DTensor's collectives or local ``chunk`` cut the wrong
      rows, or ranks fail differently and hang;
    - ops whose output keeps a ``Shard`` placement but has another shape
      (``x.sum(1)``, ``x @ w``, ``x.t()``): the data is right but the output is
      a plain DTensor, whose own ``full_tensor`` is then wrong.
Autograd is the same: a gradient computed through an UnevenDTensor is a
plain DTensor in DTensor's layout. Call :meth:`UnevenDTensor.full_tensor`
or :meth:`UnevenDTensor.redistribute` first for anything else.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor._collectives import all_gather_over_mesh_dims
from mf_dtensor.chunk_metadata import local_mesh_index
from mf_dtensor.layout import check_shape, contiguous_stride, describe_chunk, make_chunk
from mf_dtensor.pieces import (
    ExplicitPieces,
    PieceMap,
    boxes_numel,
    check_local_boxes,
    cut_boxes,
    normalize_placements,
    place_boxes,
)
from mf_utils import ensure_subclass_torch_dispatch

__all__ = ["ExplicitPieces", "PieceMap", "UnevenDTensor", "uneven_local_piece"]


def _short_repr(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _same_pieces(a: PieceMap, b: PieceMap) -> bool:
    return a is b or a == b


def _gather_members(mesh: DeviceMesh, mesh_dims: Sequence[int]) -> list[int]:
    """Row-major mesh indices of the ranks differing from this one only on ``mesh_dims``.

    In the order :func:`all_gather_over_mesh_dims` stacks their contributions.
    """
    coordinate = list(mesh.get_coordinate())
    mesh_shape = tuple(mesh.shape)
    members = []
    for values in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
        for mesh_dim, value in zip(mesh_dims, values, strict=True):
            coordinate[mesh_dim] = value
        index = 0
        for size, position in zip(mesh_shape, coordinate, strict=True):
            index = index * size + position
        members.append(index)
    return members


def _gather_full(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    pieces: PieceMap,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The full tensor on ``local``'s device (collective over the non-Replicate mesh dims)."""
    mesh_dims = [m for m, p in enumerate(placements) if not isinstance(p, Replicate)]
    members = _gather_members(mesh, mesh_dims)
    member_boxes = [pieces.boxes(index) for index in members]
    # Every rank computes the same width from the PieceMap: no size exchange.
    width = max((boxes_numel(boxes) for boxes in member_boxes), default=0)
    if width == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=local.device)
    row = torch.empty(width, dtype=dtype, device=local.device)
    row[: local.numel()] = local.reshape(-1)
    row[local.numel() :].zero_()
    gathered = all_gather_over_mesh_dims(row, mesh, mesh_dims)  # [len(members), width]
    full = torch.empty(tuple(shape), dtype=dtype, device=gathered.device)
    for flat, boxes in zip(gathered, member_boxes, strict=True):
        place_boxes(full, flat, boxes)
    return full.to(local.device)


class UnevenDTensor(DTensor):
    """A DTensor whose pieces are the boxes of a :class:`PieceMap`, with correct collectives.

    Build it with :meth:`from_local`. Ops are computed by DTensor on the local
    pieces; every output laid out like an UnevenDTensor input (same mesh,
    placements, global shape and local shape) is an UnevenDTensor with the
    same PieceMap, so optimizer states and in-place updates keep the layout.
    ``full_tensor``, ``redistribute`` and the DCP hooks use the boxes, never
    ``torch.chunk`` sizes. See [Note: implicit redistribution] in this module
    for the ops that are not safe.
    """

    _pieces: PieceMap
    __slots__ = ("_pieces",)

    @staticmethod
    def from_local(  # type: ignore[override]
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: Sequence[int],
        pieces: PieceMap,
        requires_grad: bool = False,
    ) -> UnevenDTensor:
        """Wrap this rank's piece as an UnevenDTensor (no communication).

        The result is an autograd leaf sharing ``local_tensor``'s storage
        (in-place updates, e.g. by an optimizer, write through); it is not
        differentiable with respect to ``local_tensor``.

        Args:
            local_tensor: this rank's boxes of the global tensor, stacked along dim 0.
            device_mesh: the mesh the tensor lives on.
            placements: one ``Shard(dim)`` or ``Replicate()`` per mesh dim,
                saying along which tensor dims the pieces vary over which mesh dim.
            shape: the global shape (at least one dim); the stride is contiguous.
            pieces: every rank's boxes; only this rank's are read here.
            requires_grad: whether the result requires grad.

        Returns:
            The UnevenDTensor.

        Raises:
            TypeError: if ``local_tensor`` is not a plain tensor, ``pieces``
                has no ``boxes`` method, or ``shape`` is not a sequence of ints.
            ValueError: if a placement is ``Partial``, strided or out of range,
                ``shape`` has no dims or a negative size, or ``local_tensor``'s shape or this
                rank's boxes do not fit ``shape`` and each other.
        """
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(
                f"local_tensor: expected a plain torch.Tensor, got {type(local_tensor).__name__}"
            )
        if not isinstance(pieces, PieceMap):
            raise TypeError(
                f"pieces: expected a PieceMap (an object with a boxes(mesh_index) method), "
                f"got {type(pieces).__name__}"
            )
        global_shape = check_shape(shape, "shape")
        if not global_shape:
            raise ValueError(
                "shape: expected at least one dim (a 0-dim tensor cannot be split; use a plain "
                f"DTensor), got {global_shape!r}"
            )
        placements = normalize_placements(placements, len(global_shape), device_mesh.ndim)
        if isinstance(pieces, ExplicitPieces) and len(pieces.boxes_per_rank) != device_mesh.size():
            raise ValueError(
                f"pieces: expected boxes for each of the {device_mesh.size()} ranks of "
                f"{device_mesh!r}, got {len(pieces.boxes_per_rank)}"
            )
        boxes = pieces.boxes(local_mesh_index(device_mesh))
        check_local_boxes(boxes, global_shape, placements, local_tensor.shape)
        spec = _spec_for(device_mesh, tuple(placements), global_shape, local_tensor.dtype, pieces)
        return _wrap(local_tensor.detach(), spec, pieces, requires_grad=requires_grad)

    @property
    def pieces(self) -> PieceMap:
        """The PieceMap: which boxes every rank of the mesh holds."""
        return self._pieces

    def local_boxes(self) -> Sequence[ChunkStorageMetadata]:
        """This rank's boxes, in the order they are stacked in the local tensor."""
        return self._pieces.boxes(local_mesh_index(self._spec.mesh))

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"UnevenDTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements}, shape={tuple(self.shape)}, "
            f"pieces={_short_repr(self._pieces)})"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> UnevenDTensor:
        """A copy of the local piece, wrapped with the same (immutable) spec and PieceMap.

        torch's default copies a wrapper subclass through its storage whenever its
        ``data_ptr()`` is not 0, which a piece that starts inside its buffer (a
        bucket's view) makes it, and a wrapper has no storage to copy.
        """
        found = memo.get(id(self))
        if found is not None:
            return found
        local = copy.deepcopy(self._local_tensor, memo)  # views share one copied storage
        copied = _wrap(local, self._spec, self._pieces, requires_grad=self.requires_grad)
        copied.__dict__ = copy.deepcopy(self.__dict__, memo)  # e.g. a Parameter's mark
        memo[id(self)] = copied
        return copied

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``func`` as DTensor does, then re-wrap outputs laid out like an UnevenDTensor input.

        For foreach ops the i-th tensor of every list argument belongs to the
        i-th output; other ops match every output against every input.

        Raises:
            ValueError: if UnevenDTensors with different PieceMaps would be
                combined (for a foreach op: at the same list position).
        """
        if _is_random_fill(func, args, kwargs or {}):
            return _fill_randomly(func, args, kwargs or {})
        if _is_whole_copy(func, args):
            return _copy_whole(args[0], args[1])
        if func in _WHOLE_REDUCTIONS and isinstance(args[0], UnevenDTensor) and not kwargs:
            return _reduce_whole(func, args[0])
        fast = _run_locally(func, args, kwargs or {})
        if fast is not _NOT_LOCAL:
            return fast
        foreach = func.__name__.startswith("_foreach_")
        shared: list[UnevenDTensor] = []  # inputs that meet every output
        positional: list[list[UnevenDTensor]] = []  # foreach: inputs at list position i
        base_args = [_unwrap(value, foreach, shared, positional) for value in args]
        base_kwargs = {
            key: _unwrap(value, foreach, shared, positional)
            for key, value in (kwargs or {}).items()
        }
        _check_same_pieces(func, shared)
        for group in positional:
            _check_same_pieces(func, itertools.chain(shared, group))

        # What DTensor.__torch_dispatch__ does for subclasses (re-call the op on
        # base DTensors, which takes DTensor's C++ fast path), without its two
        # pytree passes and its decorated constructor: this runs for every
        # optimizer op.
        out = func(*base_args, **base_kwargs)

        if isinstance(out, list | tuple):
            if foreach:
                return type(out)(
                    _rewrap(item, itertools.chain(shared, positional[i]))
                    if i < len(positional)
                    else _rewrap(item, shared)
                    for i, item in enumerate(out)
                )
            return type(out)(_rewrap(item, shared) for item in out)
        return _rewrap(out, shared)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole tensor on every rank, as a plain tensor on the local tensor's device.

        Collective over the mesh dims whose placement is not ``Replicate``:
        every piece is padded to the largest piece (known from the PieceMap,
        no size exchange), all-gathered, and each rank's boxes are placed.
        Not differentiable: it reads detached data.

        Args:
            grad_placements: ignored (with a warning), since the result is not
                differentiable; accepted for DTensor compatibility.

        Returns:
            A tensor of the global shape.
        """
        if grad_placements is not None:
            warnings.warn(
                "UnevenDTensor.full_tensor is not differentiable; grad_placements is ignored",
                stacklevel=2,
            )
        local = self._local_tensor.detach()
        return _gather_full(
            local, self._spec.mesh, self._spec.placements, self.shape, self._pieces, local.dtype
        )

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """A plain DTensor holding this tensor in torch's standard (``torch.chunk``) layout.

        Gathers the full tensor (see :meth:`full_tensor`) and cuts this rank's
        standard piece locally. Not differentiable; the collective always
        completes before this returns.

        Args:
            device_mesh: must be ``None`` or this tensor's mesh.
            placements: the target placements (``Shard`` or ``Replicate``);
                all ``Replicate()`` gives the full tensor on every rank.
            async_op: accepted for DTensor compatibility; the result is ready.
            forward_dtype: cast the data to this dtype before gathering.
            backward_dtype: ignored (with a warning): nothing is differentiable.

        Returns:
            A plain DTensor on the same mesh with ``placements``.

        Raises:
            ValueError: on another mesh, missing placements, a placement count
                that does not match the mesh, or a ``Partial`` target.
        """
        del async_op  # always synchronous
        mesh = self._spec.mesh
        if device_mesh is not None and device_mesh != mesh:
            raise ValueError(
                f"device_mesh: UnevenDTensor redistributes on its own mesh {mesh!r} only, "
                f"got {device_mesh!r}"
            )
        if placements is None:
            raise ValueError("placements: expected the target placements, got None")
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ValueError(
                f"placements: expected one placement per mesh dim ({mesh.ndim}), got {placements!r}"
            )
        partial = [p for p in placements if p.is_partial()]
        if partial:
            raise ValueError(
                f"placements: Partial targets are not supported for an UnevenDTensor, got "
                f"{placements!r}"
            )
        if backward_dtype is not None:
            warnings.warn(
                "UnevenDTensor.redistribute is not differentiable; backward_dtype is ignored",
                stacklevel=2,
            )
        local = self._local_tensor.detach()
        dtype = forward_dtype or local.dtype
        full = _gather_full(
            local.to(dtype), mesh, self._spec.placements, self.shape, self._pieces, dtype
        )
        # src_data_rank=None: each rank cuts its own standard piece, no communication.
        return distribute_tensor(full, mesh, placements, src_data_rank=None)

    # DCP hooks (see torch.distributed.checkpoint.planner_helpers and utils.find_tensor_shard).

    def _saved_boxes(self) -> list[tuple[ChunkStorageMetadata, int]]:
        """The boxes DCP sees for this rank, each with its first row in the local tensor.

        See [Note: empty chunks] in ``mf_dtensor.chunk_metadata``: empty boxes
        are left out when the tensor is not empty; an empty tensor is one
        empty box covering it, on every rank, so DCP still records it.
        """
        shape = tuple(self.shape)
        if math.prod(shape) == 0:
            return [(make_chunk((0,) * len(shape), shape), 0)]
        result = []
        row = 0
        for box in self.local_boxes():
            if math.prod(box.sizes) > 0:
                result.append((box, row))
            row += box.sizes[0]
        return result

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """This rank's non-empty boxes (DCP load and save planning)."""
        return [box for box, _ in self._saved_boxes()]

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        """One DCP write item per non-empty box of this rank."""
        del object  # is self
        properties = TensorProperties.create_from_tensor(self._local_tensor)
        size = self.size()
        return [
            WriteItem(
                index=MetadataIndex(fqn, box.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=box, properties=properties, size=size),
            )
            for box, _ in self._saved_boxes()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The view of the local tensor holding the box at ``index.offset``.

        Raises:
            ValueError: if this rank holds no box at that offset.
        """
        saved = self._saved_boxes()
        local = self._local_tensor
        if math.prod(self.shape) == 0:
            return local
        hint = index.index
        if hint is not None and 0 <= hint < len(saved) and saved[hint][0].offsets == index.offset:
            candidates = [saved[hint]]
        else:
            candidates = [(box, row) for box, row in saved if box.offsets == index.offset]
        if not candidates:
            raise ValueError(
                f"index: {index.fqn!r} has no box at offset {index.offset!r} on this rank; it "
                "holds " + (", ".join(describe_chunk(box) for box, _ in saved) or "none")
            )
        box, row = candidates[0]
        return local.narrow(0, row, box.sizes[0])


_NOT_LOCAL = object()
"""What ``_run_locally`` returns for an op it leaves to DTensor."""

_LAYOUT_KEEPING = frozenset(
    {
        "clone",
        "copy_",
        "detach",
        "_to_copy",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "zero_",
        "fill_",
    }
)
"""Ops that are not tagged pointwise but keep every element where it is."""

_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


def _keeps_layout(func: torch._ops.OpOverload) -> bool:
    """True for ops whose result at each element depends on that element alone (and scalars)."""
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False  # random ops: DTensor keeps shards' random streams apart
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return name not in _FOREACH_REDUCTIONS
    return torch.Tag.pointwise in tags or name in _LAYOUT_KEEPING


def _is_random_fill(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """An in-place random op (``normal_``, ``uniform_``...) on an UnevenDTensor, no other tensor."""
    return (
        torch.Tag.nondeterministic_seeded in func.tags
        and func.overloadpacket.__name__.endswith("_")
        and bool(args)
        and isinstance(args[0], UnevenDTensor)
        and not any(isinstance(v, torch.Tensor) for v in (*args[1:], *kwargs.values()))
    )


def _fill_randomly(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> UnevenDTensor:
    """[Note: random fills] Draw the whole tensor on every rank, keep this rank's boxes.

    A sharded parameter initialised in place (``nn.init.normal_(p)``, what a model's
    init method does after ``to_empty``) then holds exactly the rows one process
    draws for the whole parameter from the same generator state, whatever the
    pieces, device or world size, and every rank's generator advances as that one
    process's does. DTensor's own random ops assume ``torch.chunk`` pieces and, on
    the CPU, draw each shard from the local generator. Costs one temporary tensor
    of the global shape per call.
    """
    target: UnevenDTensor = args[0]
    local = target._local_tensor
    full = torch.empty(tuple(target.shape), dtype=local.dtype, device=local.device)
    func(full, *args[1:], **kwargs)
    with torch.no_grad():
        local.copy_(cut_boxes(full, target.local_boxes(), local.shape))
    return target


def _is_whole_copy(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> bool:
    """``target.copy_(whole)``: an UnevenDTensor from a value every rank holds whole.

    The value is a plain tensor or an all-``Replicate`` DTensor of the target's
    global shape (torchtitan's fused-QKV init builds one and copies it in).
    """
    if func is not torch.ops.aten.copy_.default or len(args) < 2:
        return False
    target, value = args[0], args[1]
    if not isinstance(target, UnevenDTensor) or tuple(value.shape) != tuple(target.shape):
        return False
    if isinstance(value, DTensor):
        return type(value) is DTensor and all(p.is_replicate() for p in value.placements)
    return True


def _copy_whole(target: UnevenDTensor, value: torch.Tensor) -> UnevenDTensor:
    """Copy this rank's boxes of ``value`` (held whole on every rank) into ``target``."""
    whole = value._local_tensor if isinstance(value, DTensor) else value
    local = target._local_tensor
    with torch.no_grad():
        local.copy_(cut_boxes(whole, target.local_boxes(), local.shape))
    return target


_WHOLE_REDUCTIONS = {torch.ops.aten.any.default, torch.ops.aten.all.default}
"""Reductions of the whole tensor that DTensor does only after gathering it by ``torch.chunk``."""


def _reduce_whole(func: torch._ops.OpOverload, tensor: UnevenDTensor) -> DTensor:
    """``any()`` / ``all()`` of the whole tensor: each rank's answer, combined; collective.

    An empty piece answers the identity (False for any, True for all). The
    result is a replicated 0-dim DTensor, as DTensor gives. ``nn.init.trunc_normal_``
    asks ``mask.any()`` of a sharded parameter in its rejection loop.
    """
    mesh = tensor._spec.mesh
    mesh_dims = [m for m, p in enumerate(tensor._spec.placements) if not isinstance(p, Replicate)]
    local = func(tensor._local_tensor).reshape(1).to(torch.uint8)
    answers = all_gather_over_mesh_dims(local, mesh, mesh_dims).to(torch.bool)
    result = func(answers).to(tensor._local_tensor.device)
    return DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _run_locally(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """[Note: local fast path] Run a layout-keeping op on the local pieces, or return _NOT_LOCAL.

    An elementwise op whose DTensor operands are all UnevenDTensors laid out
    alike computes, on every rank, exactly the local op DTensor would run; so
    it is run on the local tensors directly, without DTensor's sharding
    propagation (the optimizer's hot path: every Adam or SGD op is one). Any
    other op, or a mix with plain DTensors or with non-scalar plain tensors,
    goes through DTensor (``_NOT_LOCAL``). Foreach ops take their own path,
    one pass per list, since they carry every parameter of a step at once.
    """
    if not _keeps_layout(func) or kwargs.get("device") is not None:
        return _NOT_LOCAL  # a device move changes more than the elements: DTensor's job
    try:
        if func.__name__.startswith("_foreach_"):
            return _foreach_locally(func, args, kwargs)
        return _pointwise_locally(func, args, kwargs)
    except _NotLocalError:
        return _NOT_LOCAL


def _local_operand(value: Any) -> Any:
    """A non-UnevenDTensor operand as the local op takes it: scalars only (else not local)."""
    if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.dim()):
        raise _NotLocalError
    return value


def _pointwise_locally(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """One op on tensors (lists of them too) laid out like its first UnevenDTensor operand."""
    reference: UnevenDTensor | None = None

    def local(value: Any) -> Any:
        nonlocal reference
        if type(value) is UnevenDTensor:
            if reference is None:
                reference = value
            elif not _laid_out_alike(reference, value):
                raise _NotLocalError
            return value._local_tensor
        if isinstance(value, list | tuple):
            return type(value)(local(item) for item in value)
        return _local_operand(value)

    local_args = [local(value) for value in args]
    local_kwargs = {key: local(value) for key, value in kwargs.items()}
    if reference is None:
        return _NOT_LOCAL
    out = func(*local_args, **local_kwargs)
    if isinstance(out, list | tuple):
        return type(out)(_wrap_like(item, reference) for item in out)
    return _wrap_like(out, reference)


def _foreach_locally(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A foreach op: the i-th tensor of every list laid out like the first list's i-th."""
    likes: list[Any] | None = None  # the first list: the layout of each position

    def local(value: Any) -> Any:
        nonlocal likes
        if not isinstance(value, list | tuple):
            if type(value) is UnevenDTensor:
                raise _NotLocalError  # a tensor shared by every position: leave it to DTensor
            return _local_operand(value)
        if likes is None:
            likes = list(value)
            return [
                item._local_tensor if type(item) is UnevenDTensor else _local_operand(item)
                for item in value
            ]
        if len(value) != len(likes):
            raise _NotLocalError
        out = []
        for like, item in zip(likes, value, strict=True):
            if type(item) is UnevenDTensor:
                if type(like) is not UnevenDTensor or not _laid_out_alike(like, item):
                    raise _NotLocalError
                out.append(item._local_tensor)
            else:
                if type(like) is UnevenDTensor and isinstance(item, torch.Tensor):
                    raise _NotLocalError
                out.append(_local_operand(item))
        return out

    local_args = [local(value) for value in args]
    local_kwargs = {key: local(value) for key, value in kwargs.items()}
    if likes is None or not any(type(like) is UnevenDTensor for like in likes):
        return _NOT_LOCAL
    out = func(*local_args, **local_kwargs)
    if out is None:
        return None
    return type(out)(
        _wrap_like(item, like if type(like) is UnevenDTensor else None)
        for item, like in zip(out, likes, strict=True)
    )


class _NotLocalError(Exception):
    """An operand the local fast path does not take: let DTensor run the op."""


def _laid_out_alike(a: UnevenDTensor, b: UnevenDTensor) -> bool:
    sa, sb = a._spec, b._spec
    if sa is sb and a._pieces is b._pieces:  # e.g. optimizer state made from its parameter
        return True
    return (
        (sa.mesh is sb.mesh or sa.mesh == sb.mesh)
        and sa.placements == sb.placements
        and sa.shape == sb.shape
        and a._local_tensor.shape == b._local_tensor.shape
        and _same_pieces(a._pieces, b._pieces)
    )


_last_spec: tuple[Any, ...] | None = None


def _spec_for(
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


def _wrap_like(out: Any, like: UnevenDTensor | None) -> Any:
    """``out`` (a local result) as an UnevenDTensor laid out like ``like``."""
    if like is None or not isinstance(out, torch.Tensor):
        return out
    if out is like._local_tensor:
        return like  # an in-place op: hand back the very input
    spec = like._spec
    if out.dtype != spec.tensor_meta.dtype:
        meta = spec.tensor_meta
        spec = DTensorSpec(
            spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, out.dtype)
        )
    return _wrap(out, spec, like._pieces, requires_grad=out.requires_grad)


def _wrap(
    local_tensor: torch.Tensor, spec: DTensorSpec, pieces: PieceMap, *, requires_grad: bool
) -> UnevenDTensor:
    # __new__ alone: DTensor.__init__ does nothing but costs several decorator layers.
    result = UnevenDTensor.__new__(UnevenDTensor, local_tensor, spec, requires_grad=requires_grad)
    result._pieces = pieces
    return result


def _as_base(tensor: DTensor) -> DTensor:
    return DTensor.__new__(
        DTensor, tensor._local_tensor, tensor._spec, requires_grad=tensor.requires_grad
    )


def _unwrap(
    value: Any,
    foreach: bool,
    shared: list[UnevenDTensor],
    positional: list[list[UnevenDTensor]],
) -> Any:
    """``value`` with DTensor subclasses made base DTensors, recording UnevenDTensor inputs.

    aten schemas nest tensors at most one list deep (``Tensor[]``, ``Tensor?[]``).
    A list of a foreach op records its i-th UnevenDTensor in ``positional[i]``;
    anything else goes to ``shared``.
    """
    if isinstance(value, DTensor):
        if type(value) is DTensor:
            return value
        if isinstance(value, UnevenDTensor):
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
        if isinstance(item, UnevenDTensor):
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


def _check_same_pieces(func: Any, inputs: Iterable[UnevenDTensor]) -> None:
    first: UnevenDTensor | None = None
    for tensor in inputs:
        if first is None:
            first = tensor
        elif not _same_pieces(first._pieces, tensor._pieces):
            raise ValueError(
                f"{func}: UnevenDTensor inputs have different PieceMaps "
                f"({_short_repr(first._pieces)} and {_short_repr(tensor._pieces)}); their local "
                "pieces hold different parts of the tensor and cannot be combined; gather "
                "or redistribute one of them first"
            )


def _rewrap(out: Any, candidates: Iterable[UnevenDTensor]) -> Any:
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
            return _wrap(local, spec, candidate._pieces, requires_grad=out.requires_grad)
    return out


def uneven_local_piece(value: torch.Tensor, like: UnevenDTensor) -> torch.Tensor:
    """This rank's local piece, in ``like``'s layout, of the tensor ``value``.

    Loaders use this to accept a checkpoint in any layout. Not differentiable.

    Args:
        value: the tensor, of ``like``'s global shape, as a plain tensor (cut
            locally, no communication), an UnevenDTensor with ``like``'s
            mesh and PieceMap (its local tensor, as is), or any other DTensor
            (collective over its mesh: every rank must call this).
        like: the UnevenDTensor whose layout to cut.

    Returns:
        A tensor of ``like``'s local shape with ``value``'s dtype and device.
        It may share memory with ``value``.

    Raises:
        TypeError: if ``like`` is not an UnevenDTensor or ``value`` is not a tensor.
        ValueError: if ``value``'s global shape is not ``like``'s.
    """
    if not isinstance(like, UnevenDTensor):
        raise TypeError(f"like: expected an UnevenDTensor, got {type(like).__name__}")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"value: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"value: expected the global shape {tuple(like.shape)} of `like`, got "
            f"{tuple(value.shape)}"
        )
    if (
        isinstance(value, UnevenDTensor)
        and value.device_mesh == like.device_mesh
        and _same_pieces(value._pieces, like._pieces)
    ):
        return value._local_tensor
    with torch.no_grad():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        return cut_boxes(full, like.local_boxes(), like._local_tensor.shape)


def _register_foreach_support() -> None:
    """Let torch's optimizers and grad utilities pick their foreach kernels for UnevenDTensors.

    torch keeps a list of the tensor types its foreach paths accept, and
    ``torch.distributed.tensor`` adds DTensor to it on import; a subclass has to
    add itself (``type(p) in ...``), or Adam and ``clip_grad_norm_`` fall back to
    one kernel per tensor on CUDA. Foreach ops on UnevenDTensors take the local
    fast path ([Note: local fast path]).
    """
    from torch.optim import optimizer as optim_module
    from torch.utils import _foreach_utils

    for registry in (
        optim_module._foreach_supported_types,
        _foreach_utils._foreach_supported_types,
    ):
        if UnevenDTensor not in registry:
            registry.append(UnevenDTensor)


_register_foreach_support()
ensure_subclass_torch_dispatch(UnevenDTensor)
