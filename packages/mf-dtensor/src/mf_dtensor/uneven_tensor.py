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

Responsibility: the subclass: building one, its public methods, the three
DCP hooks, and ``__torch_dispatch__``, which routes each op to the module that
runs it: ``whole_tensor_ops.py`` (random fills, copies from a whole value,
``any``/``all``), ``local_fast_path.py`` (layout-keeping ops on the local
pieces) or ``wrapping.py`` (any other op, handed to DTensor and its outputs
wrapped again). ``full_tensor`` and ``redistribute`` gather through
``box_gather.py``. Those modules cannot import this one, so they are given
the class where they recognise or build an UnevenDTensor. The PieceMap
contract and the pure box math live in :mod:`mf_dtensor.pieces`; the engine
that decides the pieces (mf-fsdp) lives elsewhere.

Invariants:
    - A rank's local tensor is ``torch.cat([full[box] for box in boxes], 0)``
      for its boxes (row-major mesh index), all boxes of a rank share their
      sizes in every dim but 0, and no boxes means a local tensor with 0 rows.
    - Ranks that differ only along ``Replicate`` mesh dims hold the same
      boxes; the boxes of the ranks along the other mesh dims tile the tensor.
    - A PieceMap is immutable; UnevenDTensors derived from one share the
      object (never a copy, not even under ``copy.deepcopy``).

What it must not do: communicate anywhere but in :meth:`UnevenDTensor.full_tensor`,
:meth:`UnevenDTensor.redistribute`, :func:`uneven_local_piece` with a
DTensor value, and ``any()``/``all()`` of the whole tensor; materialise every
rank's boxes except where a gather needs the boxes of the ranks it gathers
from; patch torch (it only registers the class in torch's lists of
foreach-capable tensor types, as DTensor does).

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
from collections.abc import Sequence
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
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from mf_dtensor.box_gather import gather_full
from mf_dtensor.chunk_metadata import local_mesh_index
from mf_dtensor.layout import check_shape, describe_chunk, make_chunk
from mf_dtensor.local_fast_path import NOT_LOCAL, run_locally
from mf_dtensor.pieces import (
    ExplicitPieces,
    PieceMap,
    check_local_boxes,
    cut_boxes,
    normalize_placements,
    same_pieces,
)
from mf_dtensor.whole_tensor_ops import (
    WHOLE_REDUCTIONS,
    copy_whole,
    fill_randomly,
    is_random_fill,
    is_whole_copy,
    reduce_whole,
    stand_in_empty_pieces,
)
from mf_dtensor.wrapping import (
    Uneven,
    check_same_pieces,
    rewrap,
    short_repr,
    spec_for,
    unwrap,
    wrap,
)
from mf_utils import ensure_subclass_torch_dispatch

__all__ = ["ExplicitPieces", "PieceMap", "UnevenDTensor", "uneven_local_piece"]


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
        spec = spec_for(device_mesh, tuple(placements), global_shape, local_tensor.dtype, pieces)
        return wrap(UnevenDTensor, local_tensor.detach(), spec, pieces, requires_grad=requires_grad)

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
            f"pieces={short_repr(self._pieces)})"
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
        copied = wrap(
            UnevenDTensor, local, self._spec, self._pieces, requires_grad=self.requires_grad
        )
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
        if is_random_fill(UnevenDTensor, func, args, kwargs or {}):
            return fill_randomly(func, args, kwargs or {})
        if is_whole_copy(UnevenDTensor, func, args):
            return copy_whole(args[0], args[1])
        if func in WHOLE_REDUCTIONS and isinstance(args[0], UnevenDTensor) and not kwargs:
            return reduce_whole(func, args[0])
        fast = run_locally(UnevenDTensor, func, args, kwargs or {})
        if fast is not NOT_LOCAL:
            return fast
        foreach = func.__name__.startswith("_foreach_")
        shared: list[Uneven] = []  # inputs that meet every output
        positional: list[list[Uneven]] = []  # foreach: inputs at list position i
        base_args = [unwrap(UnevenDTensor, value, foreach, shared, positional) for value in args]
        base_kwargs = {
            key: unwrap(UnevenDTensor, value, foreach, shared, positional)
            for key, value in (kwargs or {}).items()
        }
        check_same_pieces(func, shared)
        for group in positional:
            check_same_pieces(func, itertools.chain(shared, group))
        base_args = stand_in_empty_pieces(func, base_args)

        # What DTensor.__torch_dispatch__ does for subclasses (re-call the op on
        # base DTensors, which takes DTensor's C++ fast path), without its two
        # pytree passes and its decorated constructor: this runs for every
        # optimizer op.
        out = func(*base_args, **base_kwargs)

        if isinstance(out, list | tuple):
            if foreach:
                return type(out)(
                    rewrap(UnevenDTensor, item, itertools.chain(shared, positional[i]))
                    if i < len(positional)
                    else rewrap(UnevenDTensor, item, shared)
                    for i, item in enumerate(out)
                )
            return type(out)(rewrap(UnevenDTensor, item, shared) for item in out)
        return rewrap(UnevenDTensor, out, shared)

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
        return gather_full(
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
        full = gather_full(
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
        and same_pieces(value._pieces, like._pieces)
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
