"""Context parallelism: long sequences split over ranks, attention over the whole of them.

Responsibility: the public entry points :func:`context_parallel` (torch's
``torch.distributed.tensor.experimental.context_parallel`` signature and
semantics, on any backend) and :func:`context_parallel_unshard`, and the
check of each ``scaled_dot_product_attention`` call made inside the context.
The attention itself is :mod:`mf_tp._cp_attention`; the split of the
sequence is :mod:`mf_tp._sequence_layout`.

Usage: every rank of the context-parallel (cp) group enters with the same
full-length batch; inside, each holds ``S / N`` positions of it and the
model runs unchanged::

    with mf_tp.context_parallel(cp_mesh, buffers=[tokens, labels, positions],
                                buffer_seq_dims=[1, 1, 1]):
        loss = model(tokens, labels, positions=positions)  # this rank's positions
        loss.backward()

It must not: change anything outside the ``with`` block (buffers are
restored, the interception ends), or move bytes for calls it does not serve.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from mf_tp._attention_kernels import kernel_for
from mf_tp._cp_attention import AttentionPlan, context_parallel_attention
from mf_tp._sequence_layout import SequenceLayout

__all__ = ["context_parallel", "context_parallel_unshard"]

SUPPORTED = (
    "under context parallelism scaled_dot_product_attention supports query, key and value of "
    "shape [batch, heads, seq/cp, head_dim] (key and value of one shape, its heads dividing "
    "the query's with enable_gqa=True), attn_mask=None, dropout_p=0.0, is_causal=False (seq "
    "divisible by cp) or is_causal=True (seq divisible by 2 x cp, load-balanced), any scale"
)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"mf_tp.context_parallel: {what}; {SUPPORTED}")


def _cp_group(mesh: DeviceMesh, where: str) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank, size)`` of a 1-D context-parallel mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"{where}: mesh must be the 1-D context-parallel mesh (e.g. world_mesh['cp']), "
            f"got {mesh.ndim} dims {mesh.mesh_dim_names}"
        )
    return mesh.get_group(), mesh.get_local_rank(), mesh.size()


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict[str, Any]:
    """Bind a call's arguments by ``F.scaled_dot_product_attention``'s signature."""
    return {
        "query": query,
        "key": key,
        "value": value,
        "attn_mask": attn_mask,
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
        "enable_gqa": enable_gqa,
    }


def _plan(mesh: DeviceMesh, call: dict[str, Any]) -> AttentionPlan:
    """Check one attention call against what context parallelism serves; plan it."""
    q, k, v = call["query"], call["key"], call["value"]
    if call["attn_mask"] is not None:
        raise _unsupported(f"got an attn_mask of shape {tuple(call['attn_mask'].shape)}")
    if call["dropout_p"] != 0.0:
        raise _unsupported(f"got dropout_p={call['dropout_p']!r}")
    if any(t.dim() != 4 for t in (q, k, v)):
        shapes = [tuple(t.shape) for t in (q, k, v)]
        raise _unsupported(f"got query, key, value of shapes {shapes}")
    mismatched = (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3])
    if mismatched or k.shape != v.shape or len({q.dtype, k.dtype, v.dtype}) > 1:
        described = [(tuple(t.shape), t.dtype) for t in (q, k, v)]
        raise _unsupported(f"got query, key, value of shapes and dtypes {described}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and not (call["enable_gqa"] and heads % kv_heads == 0):
        raise _unsupported(
            f"got {heads} query heads and {kv_heads} key heads with enable_gqa={call['enable_gqa']}"
        )
    if q.device.type != mesh.device_type:
        raise _unsupported(
            f"got tensors on {q.device} for a context-parallel mesh of device type "
            f"{mesh.device_type!r}"
        )
    group, rank, world_size = _cp_group(mesh, "mf_tp.context_parallel")
    layout = SequenceLayout.of(q.shape[2] * world_size, world_size, where="mf_tp.context_parallel")
    causal = bool(call["is_causal"])
    if causal and not layout.balanced:
        raise _unsupported(
            f"got is_causal=True with {q.shape[2]} local positions: a sequence of "
            f"{layout.seq_len} over cp={world_size} does not split into {2 * world_size} chunks"
        )
    scale = call["scale"] if call["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    return AttentionPlan(
        group, rank, layout, causal, float(scale), kernel_for(q.device, q.dtype, q.shape[-1])
    )


class _ShardedAttentionMode(TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` to context-parallel attention.

    Why a TorchFunctionMode rather than replacing ``torch.nn.functional``'s
    attribute: the mode sees the call however the caller reached the function
    (``F.scaled_dot_product_attention``, a name imported before the context,
    ``torch._C._nn``), only on the thread that entered the context, and stops
    with the ``with`` block even when it raises; a patched attribute misses
    names bound at import, leaks to other threads and stacks badly with other
    patches. The price is one Python call per torch function run inside the
    context (about a microsecond each), which is small beside a model step.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self._mesh = mesh

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _sdpa_arguments(*args, **kwargs)
        plan = _plan(self._mesh, call)
        return context_parallel_attention(call["query"], call["key"], call["value"], plan)


def _check_buffers(
    buffers: list[torch.Tensor],
    buffer_seq_dims: list[int],
    no_restore_buffers: set[torch.Tensor],
    world_size: int,
) -> list[tuple[int, SequenceLayout]]:
    """Validate the buffers; return each one's normalised seq dim and layout."""
    where = "mf_tp.context_parallel"
    if len(buffers) != len(buffer_seq_dims):
        raise ValueError(
            f"{where}: buffer_seq_dims must give one dim per buffer, got {len(buffer_seq_dims)} "
            f"dims for {len(buffers)} buffers"
        )
    for extra in no_restore_buffers:
        if not any(extra is b for b in buffers):
            raise ValueError(
                f"{where}: no_restore_buffers must be a subset of buffers, got a tensor of shape "
                f"{tuple(extra.shape)} that is not among them"
            )
    plans = []
    for index, (buffer, dim) in enumerate(zip(buffers, buffer_seq_dims, strict=True)):
        if not isinstance(buffer, torch.Tensor) or isinstance(buffer, torch.nn.Parameter):
            raise TypeError(
                f"{where}: buffers[{index}] must be a plain tensor (not a Parameter), "
                f"got {type(buffer).__name__}"
            )
        if any(buffer is other for other in buffers[:index]):
            raise ValueError(f"{where}: buffers[{index}] appears twice in buffers")
        if not -buffer.dim() <= dim < buffer.dim():
            raise ValueError(
                f"{where}: buffer_seq_dims[{index}]={dim} is not a dim of a buffer of shape "
                f"{tuple(buffer.shape)}"
            )
        dim %= buffer.dim()
        plans.append((dim, SequenceLayout.of(buffer.shape[dim], world_size, where=where)))
    return plans


@contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: list[torch.Tensor] | None = None,
    buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Split sequences over ``mesh`` and make attention see all of them, inside the block.

    The signature and semantics of torch's
    ``torch.distributed.tensor.experimental.context_parallel``, on CPU (gloo)
    and CUDA (NCCL) alike. On entry each buffer is sharded in place along its
    sequence dim (the same tensor object holds the shard; its old storage is
    left as it was, so views of it, and buffers that overlap, are not
    disturbed): this rank keeps ``S / N`` positions, the head-tail chunks
    ``r`` and ``2N - 1 - r`` of ``2N`` when ``S`` divides by ``2N`` (so causal
    work is balanced), else the contiguous chunk ``r`` of ``N``. Inside,
    ``torch.nn.functional.scaled_dot_product_attention`` on such shards
    returns this rank's rows of exact attention over the whole sequence,
    forward and backward (see ``SUPPORTED`` for the calls it serves; others
    raise). On exit the buffers get their full contents back, except those
    in ``no_restore_buffers`` (the same storage, shape and strides as
    before, without a copy).

    Run backward inside the block when activations are recomputed: the
    recomputation calls attention again and must be served the same way.

    Args:
        mesh: the 1-D context-parallel mesh (e.g. ``world_mesh["cp"]``).
        buffers: tensors whose ``buffer_seq_dims`` run over the sequence:
            token ids, labels, positions. Not parameters; every cp rank
            passes the same contents.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers to leave sharded on exit (a subset of
            ``buffers``, by identity).

    Raises:
        TypeError: if ``mesh`` is not a DeviceMesh or a buffer is a Parameter.
        ValueError: for a mesh that is not 1-D, mismatched ``buffers`` and
            ``buffer_seq_dims``, a duplicated buffer, a seq dim out of range,
            a sequence length not divisible by the cp size, or extra
            ``no_restore_buffers``.
    """
    _, rank, world_size = _cp_group(mesh, "mf_tp.context_parallel")
    buffers = list(buffers or [])
    no_restore = set() if no_restore_buffers is None else no_restore_buffers
    plans = _check_buffers(buffers, list(buffer_seq_dims or []), no_restore, world_size)
    with torch.no_grad():
        # Every shard is read before any buffer changes: buffers may be overlapping views
        # of one tensor (inputs = windows[:, :-1], targets = windows[:, 1:]).
        shards = [
            buffer.index_select(dim, layout.positions(rank, buffer.device))
            for buffer, (dim, layout) in zip(buffers, plans, strict=True)
        ]
        # Tensor.set_(source: Tensor) exists, but torch's stubs only list set_'s Storage overloads.
        originals = [
            None if any(b is n for n in no_restore) else b.new_empty(0).set_(b)  # type: ignore[call-overload]
            for b in buffers
        ]
        for buffer, shard in zip(buffers, shards, strict=True):
            buffer.set_(shard)  # type: ignore[call-overload]
    try:
        with _ShardedAttentionMode(mesh):
            yield
    finally:
        with torch.no_grad():
            for buffer, original in zip(buffers, originals, strict=True):
                if original is not None:
                    buffer.set_(original)


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int]
) -> list[torch.Tensor]:
    """Gather tensors sharded by :func:`context_parallel` back into full sequences.

    Each rank passes its shard (e.g. the model's output inside the context);
    every rank gets the full tensor in global sequence order. Not differentiable.

    Args:
        mesh: the 1-D context-parallel mesh the shards were made on.
        buffers: this rank's shards.
        seq_dims: the sequence dim of each shard.

    Raises:
        ValueError: for mismatched ``buffers`` and ``seq_dims`` or a dim out of range.
    """
    group, _, world_size = _cp_group(mesh, "mf_tp.context_parallel_unshard")
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"mf_tp.context_parallel_unshard: seq_dims must give one dim per buffer, got "
            f"{len(seq_dims)} dims for {len(buffers)} buffers"
        )
    full = []
    for index, (shard, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
        if not -shard.dim() <= dim < shard.dim():
            raise ValueError(
                f"mf_tp.context_parallel_unshard: seq_dims[{index}]={dim} is not a dim of a "
                f"shard of shape {tuple(shard.shape)}"
            )
        local = shard.movedim(dim, 0).contiguous()
        gathered = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(gathered.view(-1), local.view(-1), group=group)
        layout = SequenceLayout.of(gathered.shape[0], world_size, where="context_parallel_unshard")
        order = layout.gathered_positions(gathered.device).argsort()
        full.append(gathered.index_select(0, order).movedim(0, dim))
    return full
