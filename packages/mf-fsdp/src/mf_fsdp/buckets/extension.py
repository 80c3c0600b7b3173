"""FSDP2's all-gather extension: parameters whose tensor class decides what travels.

[Note: the all-gather extension]
A tensor subclass that defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's float8 training weight, its NF4 tensor,
Transformer Engine's FP8 tensors) tells an FSDP engine how to gather it:

- ``pre`` is called on this rank's shard and returns the tensors to gather,
  each in its own dtype (fp8 data; NF4's packed data and scalers), plus
  metadata kept here (float8's scale, taken from the amax over the whole
  mesh, so every rank casts with the same scale);
- ``post`` rebuilds the whole parameter from the gathered tensors; after the
  first gather it is passed ``out=`` (the parameter it returned then) and
  refills it in place.

Such a parameter is sharded as FSDP2 shards it, so that the hooks see what
they expect: this rank's ``torch.chunk`` piece of dim 0, padded to the first
piece's rows, kept in the subclass itself (``new_zeros`` then ``copy_``: the
ops the protocol asks a subclass to keep). It is the only copy of its values:
the optimizer steps it through a DTensor over it (the sharded form), and no
flat weight buffer holds it. Each such parameter is a bucket of its own, laid
out by ``chunk_layout``, so its reduced gradient rows in the bucket's grad
store are exactly the rows of its piece: gradients keep the engine's flat
buffers, reductions and states unchanged.

Gathering (:class:`ExtensionWeights`): the tensors ``pre`` returns travel as
bytes in one all-gather (``uint8``: a dtype gloo cannot send, float8, goes
as its bytes, so mf gathers FP8 on a CPU where FSDP2 cannot), into buffers
kept for the parameter's lifetime whose storage is freed on release; with one
tensor the all-gather writes straight into its buffer. ``post`` gets the
gathered tensors shaped ``(world * rows, ...)``, as FSDP2 gives them, and the
whole parameter is the first rows of its result. That parameter object is
the *compute form* the module holds during forward and backward (see [Note:
parameter forms] in ``param.py``); it is made by the first gather, which
hands it to the engine (``adopt``), and refilled in place by every later one.

Under ZeRO-3 a unit's forward and backward gather it and release it after,
as any bucket; under ZeRO-2 (weights whole between steps) it is gathered
after every optimizer step and kept.

[Note: hooks set after the wrap]
FSDP2 reads ``fsdp_pre_all_gather`` off the sharded local tensor at each
all-gather, so code may set the hooks on that tensor after ``fully_shard`` and
before the first forward (torch's ``test_all_gather_extension_hsdp_mesh``
patches them onto a ``TwoTensor``). Any tensor subclass other than a DTensor is
therefore sharded here as an extension parameter whether or not it has the
hooks yet; one without them at wrap time is first gathered at the first
forward, not at the wrap, and the ranks agree there (one small collective,
once) that every such tensor now has both hooks, or all stop with one
``TypeError`` naming it (``gather_fresh`` in ``engine/assemble.py``):
its values cannot go through flat buffers. Later gathers call whatever hooks
the tensor has then, as FSDP2 does; hooks that change what is gathered (sizes
or dtypes) after the first gather stop in one line (``ExtensionError``). Hooks
set after the wrap on a plain parameter's sharded local tensor (a view of a
flat bucket, gathered without them) are refused at the first forward, in one
``TypeError`` naming it; set later than that, they are not seen.

The first gather of each parameter also checks, in one small collective,
that every rank's ``pre`` returned tensors of the same sizes and dtypes (for
an unevenly split parameter, the padded piece's size, as the protocol
requires): a subclass that breaks that contract is one clear error on every
rank (:class:`ExtensionError`, which the engine's hooks post to every rank),
never a collective of mismatched sizes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.tensor import DTensor, distribute_tensor

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.grad_state import Gather
from mf_fsdp.buckets.param import FSDPParam
from mf_fsdp.buckets.weight_storage import BucketGeometry, WeightStorage
from mf_fsdp.distributed_index import FSDPDistributedIndex

__all__ = [
    "ExtensionError",
    "ExtensionWeights",
    "gathered_by_extension",
    "has_extension",
    "in_layout_of",
    "plain_tensors",
    "tensor_bytes",
    "torch_policy",
]


class ExtensionError(RuntimeError):
    """A parameter's extension hooks failed, or broke the protocol, on this rank.

    The engine's hooks post its message to every rank (see [Note: stopping every
    rank] in ``engine/rank_paths.py``): the peers may be waiting in a collective
    the hooks started (float8's amax all-reduce) or in the gather itself.
    """


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter's local tensor) defines both extension hooks."""
    return callable(getattr(tensor, "fsdp_pre_all_gather", None)) and callable(
        getattr(tensor, "fsdp_post_all_gather", None)
    )


def gathered_by_extension(param: torch.Tensor) -> bool:
    """Whether the engine shards ``param`` as an extension parameter (a bucket of its own).

    A parameter that defines both hooks, or any other tensor subclass that is not a
    DTensor: FSDP2 reads the hooks off the sharded local tensor at each all-gather,
    so they may be set on it after ``fully_shard``; such a parameter is checked for
    them at its first gather (see [Note: hooks set after the wrap]).
    """
    if has_extension(param):
        return True
    return type(param) not in (torch.Tensor, nn.Parameter) and not isinstance(param, DTensor)


def plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``tensor``'s data: itself, or a subclass's inner tensors."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if type(tensor) in (torch.Tensor, nn.Parameter) or flatten is None:
        yield tensor
        return
    names, _ = flatten()
    for name in names:
        yield from plain_tensors(getattr(tensor, name))


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of ``tensor``'s data (a subclass's inner tensors: NF4 is not 2 bytes an element)."""
    if tensor is None:
        return 0
    return sum(t.numel() * t.element_size() for t in plain_tensors(tensor))


def in_layout_of(value: torch.Tensor, like: DTensor) -> DTensor:
    """``value`` (``like``'s global shape: full, or a DTensor of any layout) laid out like ``like``.

    ``like`` is an extension parameter's sharded form (``torch.chunk`` pieces,
    ``Shard(0)`` on the shard dim); no communication for a full tensor, one
    gather for a DTensor of another layout.
    """
    if isinstance(value, DTensor):
        if value.device_mesh == like.device_mesh and value.placements == like.placements:
            return value
        value = value.full_tensor()
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def torch_policy(
    compute: torch.dtype, comm: torch.dtype, param_dtype: torch.dtype
) -> TorchMixedPrecision:
    """A bucket's dtypes as torch's ``MixedPrecisionPolicy`` (what ``pre`` is given, as in FSDP2).

    A dtype equal to the one it would default to is left None, as a user leaves it.
    """
    return TorchMixedPrecision(
        param_dtype=None if compute == param_dtype else compute,
        reduce_dtype=None if comm == compute else comm,
    )


def _call_pre(
    local: torch.Tensor,
    mesh: DeviceMesh,
    size: torch.Size,
    stride: tuple[int, ...],
    module: nn.Module,
    policy: TorchMixedPrecision,
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``local.fsdp_pre_all_gather`` in the form its signature takes (``(mesh)``, or all five)."""
    hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
    if len(inspect.signature(hook).parameters) == 1:
        inputs, metadata = hook(mesh)
    else:
        inputs, metadata = hook(mesh, size, stride, module, policy)
    return tuple(inputs), metadata


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class ExtensionWeights(WeightStorage):
    """One extension parameter's shard, and its gather (see [Note: the all-gather extension]).

    Args:
        geometry: the bucket's layout (``chunk_layout``) and this rank's place.
        fp: the parameter's record (its sharded form, once built, holds the local
            tensor the hooks are called on).
        index: the bucket's groups (the gather runs over its shard group).
        mesh: the 1-D mesh of the shard group (what ``pre`` gets).
        module: the module that holds the parameter (what ``pre`` gets).
        policy: the dtypes, as torch's ``MixedPrecisionPolicy`` (what ``pre`` gets).
        param_dtype: the compute dtype (what ``post`` gets).
        keep: gather after each optimizer step and keep it (ZeRO-2), instead of
            gathering for each pass and releasing after (ZeRO-3).
        adopt: called with the compute form the first gather makes.
        name: the bucket's name, for errors.
    """

    def __init__(
        self,
        geometry: BucketGeometry,
        fp: FSDPParam,
        index: FSDPDistributedIndex,
        mesh: DeviceMesh,
        module: nn.Module,
        policy: TorchMixedPrecision,
        param_dtype: torch.dtype,
        keep: bool,
        adopt: Callable[[nn.Parameter], None],
        name: str,
    ) -> None:
        self.geometry = geometry
        self.name = name
        self.offload = False
        self._fp = fp
        self.index = index
        self._mesh = mesh
        self._group = index.fsdp_group
        self._module = module
        self._policy = policy
        self._param_dtype = param_dtype
        self._keep = keep
        self._adopt = adopt
        self._rows = geometry.layout.shard_size // max(fp.row_numel, 1)
        self._size = torch.Size(fp.shape)
        self._stride = _contiguous_stride(self._size)
        self.padded: torch.Tensor | None = None  # the subclass shard, padded to ``_rows``
        self.local: torch.Tensor | None = None  # its real rows (the sharded form's local)
        self.full = torch.empty(0)  # unused: no flat buffer holds an extension parameter
        self.main = self.full
        self.gather = Gather.RELEASED
        self._gathering: collectives.Handle | None = None
        self._sizes: list[torch.Size] | None = None  # what ``pre`` returns, checked once
        self._outputs: list[torch.Tensor] = []  # the gathered tensors, (world * numel,) each
        self._versions: tuple[int, ...] = ()  # their autograd versions before a gather
        self._received: torch.Tensor | None = None  # several tensors: their packed bytes
        self._metadata: Any = None
        self._compute: nn.Parameter | None = None
        self._trim_rows = False  # see _post: refills get the outputs cut to the parameter's rows
        self._freed: list[tuple[torch.Tensor, int]] = []  # storages released between gathers

    # ------------------------------------------------------------------ values
    def copy_in(self, index: int, start: int, flat: torch.Tensor) -> None:
        """Unused: the shard is cut from the whole parameter by ``set_value``."""
        raise RuntimeError(f"{self.name}: an extension parameter is set with set_value")

    def set_value(self, value: torch.Tensor) -> None:
        """Cut this rank's padded piece of ``value`` (the whole subclass tensor) and keep it."""
        self.reshard()
        world, rank = self.geometry.layout.world_size, self.geometry.rank
        value = value.detach()
        pieces = torch.chunk(value, world, dim=0)
        piece = pieces[rank] if rank < len(pieces) else None
        rows = 0 if piece is None else piece.shape[0]
        padded = value.new_zeros((self._rows, *value.shape[1:]))
        if piece is not None and rows:
            padded.narrow(0, 0, rows).copy_(piece)
        self.padded = padded
        self.local = padded.narrow(0, 0, rows)

    def materialize(self, device: torch.device) -> None:
        """Give a shard cut on the meta device storage on ``device`` (FSDP2's ``to_empty``).

        The sharded form keeps its object (optimizers and the module hold it); its
        local tensor becomes the new shard's rows, which the model's init then writes.
        """
        padded = cast(torch.Tensor, self.padded)
        if not padded.is_meta:
            return
        self.padded = padded = torch.empty_like(padded, device=device)
        self.local = local = padded.narrow(0, 0, cast(torch.Tensor, self.local).shape[0])
        sharded = self._fp.sharded
        if isinstance(sharded, DTensor):
            form = DTensor.from_local(
                local,
                sharded.device_mesh,
                sharded.placements,
                run_check=False,
                shape=sharded.shape,
                stride=sharded.stride(),
            )
            fresh = nn.Parameter(form, requires_grad=sharded.requires_grad)
            for key, value in vars(sharded).items():  # the engine's marks
                if key not in vars(fresh):
                    setattr(fresh, key, value)
            torch.utils.swap_tensors(sharded, fresh)

    def owned_view(self, fp: FSDPParam, buffer: torch.Tensor) -> torch.Tensor:
        """``fp``'s rows of the grad store (the piece's rows, padding excluded)."""
        return self.geometry.owned_rows_view(fp, buffer)

    @property
    def main_is_separate(self) -> bool:
        """False: the subclass shard is the only copy."""
        return False

    def kept(self) -> torch.Tensor | None:
        """The subclass shard (its bytes: ``tensor_bytes``)."""
        return self.padded

    def kept_bytes(self) -> int:
        """Bytes of the shard's inner tensors."""
        return tensor_bytes(self.padded)

    # ------------------------------------------------------------------ gather
    def sharded_local(self) -> torch.Tensor:
        """The tensor the hooks are called on: the sharded form's local tensor, as FSDP2 does.

        ``precompute_float8_dynamic_scale_for_fsdp`` writes its scale on that object.
        """
        sharded = self._fp.sharded
        if isinstance(sharded, DTensor):
            return sharded._local_tensor
        return cast(torch.Tensor, self.local)

    def unshard(self, async_op: bool) -> None:
        """Call ``pre``, then start gathering its tensors' bytes; a no-op unless released."""
        if self.gather is not Gather.RELEASED:
            return
        local = self.sharded_local()
        try:
            with torch.no_grad():
                inputs, self._metadata = _call_pre(
                    local, self._mesh, self._size, self._stride, self._module, self._policy
                )
        except Exception as error:
            raise ExtensionError(
                f"{self.name}: {type(local).__qualname__}.fsdp_pre_all_gather failed on rank "
                f"{dist.get_rank()}: {error}"
            ) from error
        if self._sizes is None:
            self._agree(local, inputs)
        else:
            self._check_same_form(local, inputs)
        self._hold_outputs(inputs)
        flats = [_plain(t).contiguous().view(-1).view(torch.uint8) for t in inputs]
        world = self.geometry.layout.world_size
        if len(flats) == 1:
            send = flats[0]
            received = self._outputs[0].view(torch.uint8)
        else:
            send = torch.cat(flats)
            self._received = received = torch.empty(
                world * send.numel(), dtype=torch.uint8, device=send.device
            )
        self._versions = tuple(o._version for o in self._outputs)
        handle = collectives.all_gather_into(received, send, self._group, async_op=async_op)
        self._gathering = handle or _DONE
        self.gather = Gather.GATHERING

    def _agree(self, local: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
        """Check once that every rank's ``pre`` returned the same sizes and dtypes.

        A rank whose piece is shorter than the padded one (an uneven split) must get
        tensors of the padded piece's size, as FSDP2 requires; only such a rank can
        tell, so the ranks exchange that verdict with their sizes.
        """
        padded = torch.Size((self._rows, *self._size[1:]))
        short = local.shape != padded and any(t.shape != padded for t in inputs)
        mine = ([(tuple(t.shape), str(t.dtype)) for t in inputs], short)
        world = self.geometry.layout.world_size
        every: list[Any] = [mine] * world
        if world > 1 and dist.get_backend(self._group) != "fake":
            dist.all_gather_object(every, mine, group=self._group)
        if any(sizes != every[0][0] or bad for sizes, bad in every):
            shown = "; ".join(f"rank {r}: {sizes}" for r, (sizes, _) in enumerate(every))
            raise ExtensionError(
                f"{self.name}: fsdp_pre_all_gather returned tensors whose sizes or dtypes do "
                f"not fit ({shown}); every rank must return the same, and a parameter of "
                f"{self._size[0]} rows split over {world} ranks needs tensors of the padded "
                f"piece's size {tuple(padded)} where a rank's piece is shorter"
            )
        self._sizes = [torch.Size(shape) for shape, _ in mine[0]]

    def _check_same_form(self, local: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
        """Stop where ``pre`` no longer returns the sizes and dtypes of the first gather.

        The gather buffers and every rank's expectations were made from those (hooks
        set again after the first forward, see [Note: hooks set after the wrap]).
        """
        now = [(t.shape, t.dtype) for t in inputs]
        first = [(s, o.dtype) for s, o in zip(cast(list, self._sizes), self._outputs, strict=True)]
        if now != first:
            raise ExtensionError(
                f"{self.name}: {type(local).__qualname__}.fsdp_pre_all_gather returned {now}, "
                f"where its first gather returned {first}; hooks set after the first forward "
                "must gather the same sizes and dtypes"
            )

    def _hold_outputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """The gathered tensors' buffers, with their bytes (made by the first gather)."""
        world = self.geometry.layout.world_size
        if not self._outputs:
            self._outputs = [
                torch.empty(world * t.numel(), dtype=t.dtype, device=t.device) for t in inputs
            ]
            return
        for output in self._outputs:
            _hold(output, output.numel() * output.element_size())

    def wait_unshard(self) -> None:
        """Finish the all-gather, then rebuild the parameter with ``post``."""
        if self.gather is not Gather.GATHERING:
            return
        cast(collectives.Handle, self._gathering).wait()
        self._gathering = None
        world = self.geometry.layout.world_size
        if self._received is not None:  # several tensors: copy each one's bytes out
            packed = self._received.view(world, -1)
            offset = 0
            for output in self._outputs:
                width = output.numel() * output.element_size() // world
                output.view(torch.uint8).view(world, width).copy_(
                    packed[:, offset : offset + width]
                )
                offset += width
            self._received = None
        # ``post`` may return a gathered tensor itself (or a view) as the parameter, which
        # the forward saved for the backward: the backward's gather writes the same values
        # into it again, unseen by autograd, as FSDP2's does.
        torch._C._autograd._unsafe_set_version_counter(tuple(self._outputs), self._versions)
        sizes = cast(list[torch.Size], self._sizes)
        gathered = tuple(o.view(-1, *s[1:]) for o, s in zip(self._outputs, sizes, strict=True))
        self._post(gathered)
        self.gather = Gather.GATHERED

    def _post(self, gathered: tuple[torch.Tensor, ...]) -> None:
        local = self.sharded_local()
        try:
            with torch.no_grad():
                if self._compute is not None:
                    for tensor, nbytes in self._freed:
                        _hold(tensor, nbytes)
                    if self._trim_rows:
                        gathered = tuple(t[: self._size[0]] for t in gathered)
                    local.fsdp_post_all_gather(  # type: ignore[attr-defined]
                        gathered, self._metadata, self._param_dtype, out=self._compute
                    )
                    return
                whole, inner = local.fsdp_post_all_gather(  # type: ignore[attr-defined]
                    gathered, self._metadata, self._param_dtype
                )
                # An uneven split: the first ``post`` built the padded rows from row-shaped
                # outputs, and ``out`` (the parameter) has the unpadded rows. Later refills
                # get those outputs cut to the parameter's rows, so ``out.copy_(output)``
                # fits (FSDP2 hands the padded outputs with the unpadded ``out``).
                self._trim_rows = whole.shape[0] > self._size[0] and all(
                    t.shape[0] == whole.shape[0] for t in gathered
                )
                whole = torch.as_strided(whole, self._size, self._stride, 0)
        except ExtensionError:
            raise
        except Exception as error:
            raise ExtensionError(
                f"{self.name}: {type(local).__qualname__}.fsdp_post_all_gather failed on rank "
                f"{dist.get_rank()}: {error}"
            ) from error
        finally:
            self._metadata = None
        self._freed = _storages([*self._outputs, *inner])
        self._compute = nn.Parameter(whole, requires_grad=self._fp.compute.requires_grad)
        self._adopt(self._compute)

    def reshard(self) -> None:
        """Free the gathered tensors (under ZeRO-2 they stay until ``install``)."""
        if not self._keep:
            self._release()

    def _release(self) -> None:
        self.wait_unshard()
        if self.gather is Gather.GATHERED:
            for tensor, _ in self._freed:
                tensor.untyped_storage().resize_(0)
        self.gather = Gather.RELEASED

    def hold_full_bytes(self) -> None:
        """Nothing to hold: the gather makes the whole parameter."""

    def install(self, async_op: bool) -> collectives.Handle | None:
        """The optimizer changed the shard: drop the gathered parameter (ZeRO-2: gather again)."""
        self._release()
        if self._keep:
            self.unshard(async_op=False)
            self.wait_unshard()
        return None

    def broadcast_replicas(self) -> None:
        """Broadcast the shard's inner tensors to its replicas across dp_outer (if any)."""
        pg = self.index.outer_fsdp_group
        if pg is None or self.padded is None:
            return
        for tensor in plain_tensors(self.padded):
            collectives.broadcast_from_first(tensor, pg)
        self._release()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a plain copy of a subclass (a collective sends only plain tensors).

    ``pre`` may return the subclass shard itself (a hook set on a ``TwoTensor``);
    its values are what a copy into a plain tensor gives, as in FSDP2's copy-in.
    """
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def _hold(tensor: torch.Tensor, nbytes: int) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(nbytes)


def _storages(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """One tensor per distinct storage among the plain tensors of ``tensors``, with its bytes."""
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for tensor in tensors:
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            seen.setdefault(storage._cdata, (plain, storage.nbytes()))
    return list(seen.values())


class _Done:
    def wait(self) -> bool:
        return True


_DONE = _Done()
