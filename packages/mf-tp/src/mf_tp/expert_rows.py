"""Expert rows between ranks: the row orders the dispatch needs, and the expert-TP exchange.

Responsibility: the pieces of moving token rows that :mod:`mf_tp.moe`'s expert-parallel
dispatch and expert tensor parallelism (ETP) share, and ETP's own two steps.

Expert tensor parallelism splits every expert's FFN over an ETP group: each ETP rank holds
``F / t`` of every local expert's hidden units (column-wise ``fc``, row-wise ``out``). The
rows an ETP rank received from the expert-parallel dispatch are its own tokens only, so
before the experts run, :func:`gather_expert_rows` gives every ETP rank the rows of all
``t`` ranks (grouped by local expert), and after them :func:`reduce_scatter_expert_rows`
sums the ``t`` partial outputs of each row and returns it to the rank it came from. Both
are all-to-alls with autograd (:func:`mf_tp.mappings.all_to_all`): the gather's backward
sums each row's gradients from every ETP rank, the reduction's backward sends each rank's
gradient to every ETP rank, so the expert weights' gradients cover the rows of the whole
ETP group and need no reduction over it.

It must not: route tokens, or hold state beyond one call's :class:`ExpertRowsState`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mf_tp.mappings import all_to_all

__all__ = ["ExpertRowsState", "gather_expert_rows", "reduce_scatter_expert_rows"]


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order`` (``x[order][inverse] == x``)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def ensure_joins_backward(rows: torch.Tensor) -> torch.Tensor:
    """Make ``rows`` require grad so this rank runs an all-to-all's backward exchange.

    The exchange's backward is a collective: if one rank's rows needed no
    gradient (a first layer fed raw data, frozen experts) it would skip it
    while its peers wait. The gradient that arrives here is simply discarded.
    """
    if torch.is_grad_enabled() and not rows.requires_grad:
        return rows.detach().requires_grad_(True)
    return rows


def regroup_by_local_expert(counts: torch.Tensor) -> torch.Tensor:
    """Order turning (source, local expert) blocks into (local expert, source) blocks.

    ``counts[s, l]`` is the size of block (source ``s``, local expert ``l``).
    """
    sources, num_local = counts.shape
    block_expert = torch.arange(num_local, device=counts.device).repeat(sources)
    row_expert = block_expert.repeat_interleave(counts.reshape(-1))
    return torch.argsort(row_expert, stable=True)


@dataclass(frozen=True)
class RowRoutes:
    """Where one token row per (token, destination EP rank) goes, and which choices it carries.

    Attributes:
        choices: ``[R]`` long, in send order (by destination rank, then token): the flat
            (token, choice) index ``t * k + j`` of the first choice of token ``t`` whose
            expert lives on the row's destination.
        local_experts: ``[R, k]`` long, the destination's local expert of each carried
            choice, -1 for the others (what the destination needs to fan the row out).
        send_counts: ``[p]`` long, rows for each EP rank.
    """

    choices: torch.Tensor
    local_experts: torch.Tensor
    send_counts: torch.Tensor


def route_unique_rows(
    expert_indices: torch.Tensor, experts_per_rank: int, ep_size: int
) -> RowRoutes:
    """Plan one row per (token, destination rank), not one per choice.

    A token whose ``k`` experts share a rank travels to it once; the destination
    fans it out to its experts (:func:`fan_out_order`).

    Args:
        expert_indices: ``[T, k]`` long, the global expert of each choice.
        experts_per_rank: ``L``; rank ``r`` owns experts ``[r * L, (r + 1) * L)``.
        ep_size: ``p``.
    """
    top_k = expert_indices.shape[1]
    dest_Tk = torch.div(expert_indices, experts_per_rank, rounding_mode="floor")
    same_Tkk = dest_Tk.unsqueeze(2) == dest_Tk.unsqueeze(1)
    before_kk = torch.ones(top_k, top_k, dtype=torch.bool, device=dest_Tk.device).tril(-1)
    first_Tk = ~(same_Tkk & before_kk).any(dim=2)  # no earlier choice to the same rank
    firsts = first_Tk.reshape(-1).nonzero().squeeze(1)
    row_dest = dest_Tk.reshape(-1).index_select(0, firsts)
    order = torch.argsort(row_dest, stable=True)  # by destination, tokens in order
    choices, row_dest = firsts.index_select(0, order), row_dest.index_select(0, order)
    tokens = torch.div(choices, top_k, rounding_mode="floor")
    carried = dest_Tk.index_select(0, tokens) == row_dest.unsqueeze(1)
    local = expert_indices.index_select(0, tokens) - (row_dest * experts_per_rank).unsqueeze(1)
    local_experts = torch.where(carried, local, torch.full_like(local, -1))
    send_counts = torch.bincount(row_dest, minlength=ep_size)
    return RowRoutes(choices, local_experts, send_counts)


def fan_out_order(
    local_experts: torch.Tensor, experts_per_rank: int
) -> tuple[torch.Tensor, list[int]]:
    """The expert input's rows as (received row, choice) indices, each local expert's contiguous.

    Args:
        local_experts: ``[R, k]`` long, the received rows' local experts (-1: not here).
        experts_per_rank: ``L``.

    Returns:
        ``(choices [N], rows per local expert)``: row ``i`` of the expert input is received
        row ``choices[i] // k``, for its choice ``choices[i] % k``; within an expert the rows
        keep the received order (by source rank, then token).
    """
    flat = local_experts.reshape(-1)
    valid = (flat >= 0).nonzero().squeeze(1)
    experts = flat.index_select(0, valid)
    order = torch.argsort(experts, stable=True)
    return valid.index_select(0, order), torch.bincount(
        experts, minlength=experts_per_rank
    ).tolist()


def sum_choices(
    rows: torch.Tensor, choices: torch.Tensor, num_rows: int, top_k: int
) -> torch.Tensor:
    """``[num_rows, H]``: for each row, the sum of ``rows`` placed at its (row, choice) slots.

    ``choices`` are distinct flat ``row * k + choice`` indices (a deterministic copy into
    zeros, then a sum over the ``k`` slots: no atomics).
    """
    slots = rows.new_zeros(num_rows * top_k, rows.shape[1]).index_copy(0, choices, rows)
    return slots.view(num_rows, top_k, rows.shape[1]).sum(dim=1)


@dataclass(frozen=True)
class ExpertRowsState:
    """What :func:`reduce_scatter_expert_rows` needs to undo :func:`gather_expert_rows`.

    Attributes:
        regroup_order: ``[N_all]`` long; row ``i`` of the gathered input is received row
            ``regroup_order[i]`` (received rows are ordered by source, then local expert).
        rows_from: rows each ETP rank contributed, in ETP rank order.
        own_rows: this rank's rows ``n``.
        etp_group: the ETP group.
    """

    regroup_order: torch.Tensor
    rows_from: list[int]
    own_rows: int
    etp_group: dist.ProcessGroup


def gather_expert_rows(
    rows: torch.Tensor, rows_per_expert: list[int], etp_group: dist.ProcessGroup
) -> tuple[torch.Tensor, list[int], ExpertRowsState]:
    """Every ETP rank's rows for the local experts, each expert's rows contiguous.

    Args:
        rows: ``[n, H]``, this rank's rows of local expert 0, then 1, ...
        rows_per_expert: ``L`` counts summing to ``n``.
        etp_group: the expert-tensor-parallel group (ranks holding the same experts).

    Returns:
        ``(gathered [N_all, H], rows per local expert of all ranks, state)``.
    """
    size = dist.get_world_size(etp_group)
    counts = torch.tensor(rows_per_expert, dtype=torch.long, device=rows.device)
    every = [torch.empty_like(counts) for _ in range(size)]
    dist.all_gather(every, counts, group=etp_group)  # no autograd: sizes only
    counts_tL = torch.stack(every)
    rows_from = counts_tL.sum(1).tolist()
    own = rows.shape[0]
    sent = ensure_joins_backward(rows).repeat(size, 1)  # a copy for every ETP rank
    received = all_to_all(etp_group, sent, rows_from, [own] * size)
    order = regroup_by_local_expert(counts_tL)
    state = ExpertRowsState(order, rows_from, own, etp_group)
    return received.index_select(0, order), counts_tL.sum(0).tolist(), state


def reduce_scatter_expert_rows(partial: torch.Tensor, state: ExpertRowsState) -> torch.Tensor:
    """Sum each gathered row's partial outputs over the ETP group, back on its own rank.

    Args:
        partial: ``[N_all, H]`` in :func:`gather_expert_rows`' order, this rank's partial
            sums (its ``F / t`` hidden units' share of each row's output).
        state: what :func:`gather_expert_rows` returned.

    Returns:
        ``[n, H]``: this rank's rows, summed over every ETP rank's share.
    """
    by_source = partial.index_select(0, inverse_permutation(state.regroup_order))
    size = len(state.rows_from)
    returned = all_to_all(
        state.etp_group, ensure_joins_backward(by_source), [state.own_rows] * size, state.rows_from
    )
    return returned.view(size, state.own_rows, partial.shape[1]).sum(0)
