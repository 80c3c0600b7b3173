"""Context-parallel attention: all-gather K/V, attend locally, reduce-scatter dK/dV.

Responsibility: the autograd function behind :func:`mf_tp.context_parallel`'s
``scaled_dot_product_attention``, and its two collectives over the
context-parallel group. The attention math itself is
:mod:`mf_tp._blockwise_attention`.

[Note: why all-gather K/V rather than a rotating ring] Each rank needs, for
its queries, the keys and values of every position it attends to. mf gathers
them with one ``all_gather_into_tensor`` of the rank's stacked ``[k; v]``,
and returns their gradients with one ``reduce_scatter_tensor``, instead of
passing K/V shards around a ring in ``N - 1`` send/receive steps:

- the bytes are the same: each rank receives the ``N - 1`` other K/V shards
  either way, and a ring's dK/dV must travel as far as a reduce-scatter's;
- one collective per pass (each way) runs on gloo and NCCL alike, with none
  of a ring's send/receive ordering to get wrong, and its latency is paid
  once instead of ``N - 1`` times;
- the local work is 1 (full) or 4 (causal) kernel calls on long blocks
  instead of ``2N``;
- with grouped-query attention K/V are ``Hkv / H`` of the queries' size,
  so the gathered sequence is cheap to hold.

What it gives up: a ring overlaps each step's transfer with the previous
block's compute; here the gather completes before the kernels start. And
the gathered K/V of the whole sequence exist for the duration of one
attention call (not saved: backward gathers them again, so activation
memory stays ``1/N``).

Bytes each rank receives per attention call (``kv`` = one rank's K plus V
shard, ``N`` ranks): forward ``(N-1)·kv``; backward ``(N-1)·kv`` for the
re-gather and ``(N-1)·kv`` for the dK/dV reduce-scatter: ``3(N-1)·kv`` in
all. The least any scheme can move is ``2(N-1)·kv`` without a mask (the
other shards' K/V in, their gradients out, with K/V kept from forward to
backward at ``N`` times the memory); under the balanced causal layout a rank
attends to only ``3/4`` of the other ranks' chunks on average, so the floor
is ``1.5(N-1)·kv``.

It must not: decide the layout or check the call (see :mod:`mf_tp.context_parallelism`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mf_tp._attention_kernels import AttentionKernel
from mf_tp._blockwise_attention import attend, attend_backward, attention_blocks
from mf_tp._sequence_layout import SequenceLayout

__all__ = ["AttentionPlan", "context_parallel_attention", "gather_kv", "reduce_scatter_kv"]


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Everything one context-parallel attention call needs besides its tensors."""

    group: dist.ProcessGroup
    rank: int
    layout: SequenceLayout
    causal: bool
    scale: float
    kernel: AttentionKernel


def gather_kv(
    k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, Hkv, S/N, D]`` shards -> ``[B, Hkv, S, D]`` in global order (one all-gather)."""
    layout = plan.layout
    local = torch.stack((k, v))  # [2, B, Hkv, S/N, D]
    gathered = local.new_empty((layout.world_size, *local.shape))  # [N, 2, B, Hkv, S/N, D]
    dist.all_gather_into_tensor(gathered.view(-1), local.view(-1), group=plan.group)
    pieces: dict[int, torch.Tensor] = {}
    for rank in range(layout.world_size):
        shard_chunks = gathered[rank].split(layout.chunk_len, dim=3)
        pieces.update(zip(layout.chunks(rank), shard_chunks, strict=True))
    kv = torch.cat([pieces[c] for c in range(layout.num_chunks)], dim=3)  # [2, B, Hkv, S, D]
    return kv[0], kv[1]


def reduce_scatter_kv(
    dk: torch.Tensor, dv: torch.Tensor, plan: AttentionPlan, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum every rank's ``[B, Hkv, S, D]`` shares; keep this rank's ``[B, Hkv, S/N, D]`` rows."""
    layout = plan.layout
    chunks = torch.stack((dk, dv)).to(dtype).split(layout.chunk_len, dim=3)
    per_rank = torch.stack(
        [
            torch.cat([chunks[c] for c in layout.chunks(rank)], dim=3)
            for rank in range(layout.world_size)
        ]
    )  # [N, 2, B, Hkv, S/N, D]
    mine = per_rank.new_empty(per_rank.shape[1:])
    dist.reduce_scatter_tensor(mine.view(-1), per_rank.view(-1), group=plan.group)
    return mine[0], mine[1]


class _ContextParallelAttention(torch.autograd.Function):
    """Exact attention of sequence-sharded q, k, v over the whole sequence.

    | pass     | q, out        | k, v          | collective over the cp group         |
    |----------|---------------|---------------|--------------------------------------|
    | forward  | [B, H, S/N, D] | [B, Hkv, S/N, D] | all-gather [k; v] -> [B, Hkv, S, D] |
    | backward | dq [B, H, S/N, D] | dk, dv [B, Hkv, S/N, D] | all-gather [k; v] again;     |
    |          |               |               | reduce-scatter [dk; dv] of [B, Hkv, S, D] |

    See [Note: why all-gather K/V rather than a rotating ring].
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        k_all, v_all = gather_kv(k, v, plan)
        blocks = attention_blocks(plan.layout, plan.rank, plan.causal)
        out, lse, extras = attend(q, k_all, v_all, blocks, plan.kernel, plan.scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.blocks, ctx.extras = plan, blocks, extras
        return out

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        plan: AttentionPlan = ctx.plan
        k_all, v_all = gather_kv(k, v, plan)
        dq, dk_all, dv_all = attend_backward(
            dout.contiguous(),
            q,
            k_all,
            v_all,
            out,
            lse,
            ctx.extras,
            ctx.blocks,
            plan.kernel,
            plan.scale,
        )
        dk, dv = reduce_scatter_kv(dk_all, dv_all, plan, k.dtype)
        return dq, dk, dv, None


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
) -> torch.Tensor:
    """Attention of this rank's rows over the whole sequence, differentiable in q, k, v."""
    return _ContextParallelAttention.apply(q, k, v, plan)
