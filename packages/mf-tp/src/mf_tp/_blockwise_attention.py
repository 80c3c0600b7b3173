"""One rank's exact attention over the whole sequence, from its queries and all keys.

Responsibility: given a rank's local queries ``q [B, H, S/N, D]`` and the
keys and values of the whole sequence in global order ``k, v [B, Hkv, S, D]``,
compute the rank's rows of attention over the whole sequence (forward), and
the gradients of those rows with respect to ``q`` and to every key and value
(backward). Pure and single-process: the collectives live in
:mod:`mf_tp._cp_attention`, so this math is testable by simulating every rank
in one process.

Blocks. Without a mask, a rank's rows attend to all ``S`` keys: one kernel
call. Under a causal mask, each local chunk of rows (global chunk ``c`` of
length ``C``, see :mod:`mf_tp._sequence_layout`) attends to keys
``[0, cC)`` with no mask and to its own chunk ``[cC, (c+1)C)`` with the
causal mask; the two partial results are merged with their log-sum-exp::

    lse = log(exp(lse_1) + exp(lse_2))
    out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)

With the balanced layout every rank runs ``2N - 1`` unmasked and 2 masked
chunk-sized blocks' worth of work: the same on every rank.

The backward runs each block's backward with the merged ``out`` and ``lse``
(see [Note: block backward with merged statistics] in
:mod:`mf_tp._attention_kernels`) and accumulates in fp32.

It must not: communicate, or modify its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from mf_tp._attention_kernels import AttentionKernel, BlockResult, BlockSaved, lse_dtype
from mf_tp._sequence_layout import SequenceLayout

__all__ = ["AttentionBlock", "attend", "attend_backward", "attention_blocks", "merge_blocks"]


@dataclass(frozen=True, slots=True)
class AttentionBlock:
    """Local query ``rows`` against global key positions ``keys``, masked causally or not."""

    rows: slice
    keys: slice
    causal: bool


def attention_blocks(layout: SequenceLayout, rank: int, causal: bool) -> list[list[AttentionBlock]]:
    """The blocks of rank ``rank``, grouped by the local rows they produce (merged per group)."""
    if not causal:
        return [[AttentionBlock(slice(0, layout.local_len), slice(0, layout.seq_len), False)]]
    size = layout.chunk_len
    groups = []
    for index, chunk in enumerate(layout.chunks(rank)):
        rows = slice(index * size, (index + 1) * size)
        earlier = [AttentionBlock(rows, slice(0, chunk * size), False)] if chunk > 0 else []
        groups.append(
            [*earlier, AttentionBlock(rows, slice(chunk * size, (chunk + 1) * size), True)]
        )
    return groups


def merge_blocks(
    results: list[BlockResult], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions of the same rows by their log-sum-exp: (out in ``dtype``, lse)."""
    if len(results) == 1:
        return results[0].out, results[0].lse
    lse = torch.stack([r.lse for r in results]).logsumexp(0)  # [B, H, rows]
    # cast: sum() of tensors is a tensor (0 + t, then +), but typeshed types an empty sum as 0
    out = cast(
        torch.Tensor,
        sum(
            r.out.to(torch.promote_types(dtype, torch.float32))
            * torch.exp(r.lse - lse).unsqueeze(-1)
            for r in results
        ),
    )
    return out.to(dtype), lse


def _keys(t: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
    return t[:, :, block.keys]


def _rows(t: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
    return t[:, :, block.rows]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: list[list[AttentionBlock]],
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, list[list[Any]]]:
    """Forward of one rank: ``(out [B, H, S/N, Dv], lse [B, H, S/N], kernel extras)``.

    ``q`` holds the rank's rows; ``k``, ``v`` the whole sequence in global order.
    """
    if len(blocks) == 1 and len(blocks[0]) == 1:
        (block,) = blocks[0]
        result = kernel.forward(
            q, _keys(k, block), _keys(v, block), causal=block.causal, scale=scale
        )
        return result.out, result.lse, [[result.aux]]
    batch, heads, length, _ = q.shape
    out = q.new_empty((batch, heads, length, v.shape[-1]))
    lse = torch.empty((batch, heads, length), dtype=lse_dtype(q.dtype), device=q.device)
    extras = []
    for group in blocks:
        results = [
            kernel.forward(_rows(q, b), _keys(k, b), _keys(v, b), causal=b.causal, scale=scale)
            for b in group
        ]
        rows = group[0].rows
        out[:, :, rows], lse[:, :, rows] = merge_blocks(results, q.dtype)
        extras.append([r.aux for r in results])
    return out, lse, extras


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    extras: list[list[Any]],
    blocks: list[list[AttentionBlock]],
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of one rank: ``(dq [B, H, S/N, D], dk, dv [B, Hkv, S, D] in fp32 or wider)``.

    ``dk`` and ``dv`` cover the whole sequence: this rank's share of every
    key's gradient, zero where its rows did not attend; summing them over the
    ranks gives the full gradients.
    """
    accumulate = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=accumulate, device=q.device)
    dk = torch.zeros(k.shape, dtype=accumulate, device=k.device)
    dv = torch.zeros(v.shape, dtype=accumulate, device=v.device)
    for group, group_extras in zip(blocks, extras, strict=True):
        for block, aux in zip(group, group_extras, strict=True):
            saved = BlockSaved(
                _rows(dout, block),
                _rows(q, block),
                _keys(k, block),
                _keys(v, block),
                _rows(out, block),
                _rows(lse, block),
                aux,
            )
            dq_b, dk_b, dv_b = kernel.backward(saved, causal=block.causal, scale=scale)
            dq[:, :, block.rows] += dq_b
            dk[:, :, block.keys] += dk_b
            dv[:, :, block.keys] += dv_b
    return dq.to(q.dtype), dk, dv
