"""Expert-parallel mixture of experts: a top-k router, dropless token dispatch, the layer.

Responsibility: route each token to ``k`` of ``E`` experts, move the token
rows to the expert-parallel (EP) rank that owns each chosen expert, run the
experts, and bring the results back, weighted by the router. Every step is
autograd-correct: the gradients w.r.t. the input, the router weight and every
expert parameter equal those of the same layer run in one process.

Layout. EP rank ``r`` of an EP group of size ``p`` owns the global experts
``[r * L, (r + 1) * L)`` with ``L = E / p`` (contiguous ownership, so a
token's destination rank is ``expert // L``). Shapes: ``T`` tokens, ``H``
hidden, ``k`` choices per token, ``N`` rows that this rank's experts process.

Dropless: there is no capacity factor; every (token, choice) pair is
processed, however unevenly the router spreads them. The price is one small
exchange of row counts before the rows move (the receive sizes are data
dependent), and a host sync to read them.

Dispatch, per rank::

    x [T, H] --one row per (token, destination rank), by destination--> [R, H]
       --all-to-all (rows for rank j go to rank j, with their local experts)--> [R', H]
       --fan out to the choices made here, by (local expert, source)--> [N, H]

A token whose chosen experts share a rank travels to it once (issue 58: per choice it
went twice at top-2 over 2 ranks, 32% over the least). :func:`combine_tokens` sends
the router weights of each row's choices along, sums each row's expert outputs
weighted on the experts' rank, sends that one row back and sums a token's rows
from its destinations. Without expert parallelism the rows are simply sorted by
expert.

Initialisation is the same model at any EP size: :meth:`MoELayer.reset_parameters`
draws every expert's weights, in global order, from the default CPU generator
and keeps only the local ones, so the generator advances identically on every
rank and at every EP size.

It must not: drop tokens, or hold routing state other than the latest
``load_balance_loss`` / ``tokens_per_expert`` that :class:`MoELayer` exposes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mf_tp.expert_rows import (
    RowRoutes,
    ensure_joins_backward,
    fan_out_order,
    gather_expert_rows,
    inverse_permutation,
    reduce_scatter_expert_rows,
    route_unique_rows,
    sum_choices,
)
from mf_tp.grouped_experts import GroupedExperts
from mf_tp.mappings import all_to_all
from mf_utils import set_expert_parallel_attribute

__all__ = [
    "ExpertMLP",
    "MoELayer",
    "RoutingResult",
    "TokenDispatchState",
    "TopKRouter",
    "combine_tokens",
    "dispatch_tokens",
]

# Standard deviation of the normal initialisation of router and expert weights.
INIT_STD = 0.02

_Group = dist.ProcessGroup


def _check_positive_int(value: object, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def _check_top_k(top_k: object, num_experts: int, where: str) -> int:
    k = _check_positive_int(top_k, "top_k", where)
    if k > num_experts:
        raise ValueError(f"{where}: top_k must be in [1, num_experts={num_experts}], got top_k={k}")
    return k


def _ep_size_and_rank(ep_group: _Group | None) -> tuple[int, int]:
    """``(size, rank)`` of the EP group; ``(1, 0)`` for None (one rank holds every expert)."""
    if ep_group is None:
        return 1, 0
    if not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"mf_tp.moe: ep_group must be a ProcessGroup or None, got {ep_group!r}")
    return dist.get_world_size(ep_group), dist.get_rank(ep_group)


def _experts_per_rank(num_experts: int, ep_size: int, where: str) -> int:
    """``L = num_experts / ep_size``; contiguous ownership needs an exact division."""
    if num_experts % ep_size != 0:
        raise ValueError(
            f"{where}: num_experts {num_experts} is not divisible by the expert-parallel "
            f"(EP) size {ep_size}; every EP rank must own the same number of experts"
        )
    return num_experts // ep_size


@dataclass(frozen=True)
class RoutingResult:
    """What :class:`TopKRouter` decided for a batch of ``T`` tokens.

    Attributes:
        expert_indices: ``[T, k]`` long, the chosen global experts, best first.
        weights: ``[T, k]`` in the input's dtype, the chosen experts' softmax
            probabilities renormalised to sum to 1 per token (with autograd).
        load_balance_loss: scalar fp32 tensor with autograd, Switch-Transformer
            style ``E * sum_e f_e * P_e``; 1.0 when routing is perfectly even.
        tokens_per_expert: ``[E]`` long, how many of the ``T * k`` assignments
            went to each expert (no autograd).
    """

    expert_indices: torch.Tensor
    weights: torch.Tensor
    load_balance_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


class TopKRouter(nn.Module):
    """Choose ``top_k`` of ``num_experts`` experts per token from a linear gate.

    The gate weight is an ordinary replicated parameter (not an expert
    parameter): every EP rank holds all of it, and its gradient here covers
    only this rank's tokens, so reduce it over the data-parallel ranks like
    any dense weight.

    Modules built on the meta device are left uninitialised (call
    :meth:`reset_parameters` after materialising them).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        where = "TopKRouter"
        self.hidden_size = _check_positive_int(hidden_size, "hidden_size", where)
        self.num_experts = _check_positive_int(num_experts, "num_experts", where)
        self.top_k = _check_top_k(top_k, num_experts, where)
        weight = torch.empty(num_experts, hidden_size, device=device, dtype=dtype)
        self.weight = nn.Parameter(weight)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the gate weight ``N(0, INIT_STD)`` from the default CPU generator (fp32)."""
        drawn = torch.empty(self.num_experts, self.hidden_size).normal_(0.0, INIT_STD)
        with torch.no_grad():
            self.weight.copy_(drawn)

    def forward(self, hidden_states: torch.Tensor) -> RoutingResult:
        """Route ``[T, H]`` tokens; see :class:`RoutingResult` for what comes back."""
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"TopKRouter: expected tokens of shape [T, {self.hidden_size}], "
                f"got {tuple(hidden_states.shape)}"
            )
        # Softmax in fp32: in bf16 the probabilities (so the choices and the loss) lose precision.
        probs_TE = F.linear(hidden_states, self.weight).float().softmax(dim=-1)
        top_probs_Tk, expert_indices_Tk = probs_TE.topk(self.top_k, dim=-1)
        weights_Tk = top_probs_Tk / top_probs_Tk.sum(dim=-1, keepdim=True)
        tokens_per_expert = torch.bincount(
            expert_indices_Tk.reshape(-1), minlength=self.num_experts
        )
        return RoutingResult(
            expert_indices=expert_indices_Tk,
            weights=weights_Tk.to(hidden_states.dtype),
            load_balance_loss=self._load_balance_loss(probs_TE, tokens_per_expert),
            tokens_per_expert=tokens_per_expert,
        )

    def _load_balance_loss(
        self, probs: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """``E * sum_e f_e * P_e``: pushes probability mass towards under-used experts.

        ``f_e`` (fraction of assignments, no gradient) times ``P_e`` (mean
        probability, differentiable); zero for an empty batch instead of NaN.
        """
        num_tokens = probs.shape[0]
        fraction_E = tokens_per_expert.float() / max(num_tokens * self.top_k, 1)
        mean_prob_E = probs.sum(dim=0) / max(num_tokens, 1)
        return self.num_experts * (fraction_E * mean_prob_E).sum()


@dataclass(frozen=True)
class TokenDispatchState:
    """What :func:`combine_tokens` needs to undo :func:`dispatch_tokens`.

    Attributes:
        sort_order: without expert parallelism, ``[T*k]`` long: row ``i`` of the
            expert input is flat (token, choice) row ``sort_order[i]`` (row
            ``t*k + j`` is choice ``j`` of token ``t``); None with it.
        routes: with expert parallelism, the rows sent (one per token and
            destination rank, :func:`mf_tp.expert_rows.route_unique_rows`); else None.
        recv_choices: with expert parallelism, ``[N]`` long: row ``i`` of the expert
            input is received row ``recv_choices[i] // k`` for its choice
            ``recv_choices[i] % k``; else None.
        send_split_sizes: rows this rank sent to each EP rank.
        recv_split_sizes: rows this rank received from each EP rank.
        tokens_per_local_expert: rows of each local expert, in local order; the
            expert input is these blocks back to back.
        num_tokens: ``T``.
        top_k: ``k``.
        ep_group: the EP group, or None when nothing is communicated.
    """

    sort_order: torch.Tensor | None
    routes: RowRoutes | None
    recv_choices: torch.Tensor | None
    send_split_sizes: list[int]
    recv_split_sizes: list[int]
    tokens_per_local_expert: list[int]
    num_tokens: int
    top_k: int
    ep_group: _Group | None


def dispatch_tokens(
    hidden_states: torch.Tensor,
    expert_indices: torch.Tensor,
    num_experts: int,
    ep_group: _Group | None = None,
) -> tuple[torch.Tensor, TokenDispatchState]:
    """Send each token's row to the EP rank of each expert it chose (dropless).

    Args:
        hidden_states: ``[T, H]`` tokens of this rank.
        expert_indices: ``[T, k]`` long, global expert of each choice.
        num_experts: ``E``, the number of experts over the whole EP group.
        ep_group: the expert-parallel group; None (or a group of size 1)
            means this rank holds every expert and nothing is communicated.

    Returns:
        ``(expert_input, state)``: ``expert_input`` is ``[N, H]``, the rows of
        local expert 0 first, then local expert 1, ... (sizes in
        ``state.tokens_per_local_expert``); ``state`` is for
        :func:`combine_tokens`.

    Raises:
        ValueError: on bad shapes, or if ``num_experts`` is not divisible by
            the EP size.
    """
    where = "dispatch_tokens"
    _check_positive_int(num_experts, "num_experts", where)
    ep_size, _ = _ep_size_and_rank(ep_group)
    per_rank = _experts_per_rank(num_experts, ep_size, where)
    if hidden_states.dim() != 2 or expert_indices.dim() != 2:
        raise ValueError(
            f"{where}: expected hidden_states [T, H] and expert_indices [T, k], got "
            f"{tuple(hidden_states.shape)} and {tuple(expert_indices.shape)}"
        )
    num_tokens, top_k = expert_indices.shape
    if hidden_states.shape[0] != num_tokens:
        raise ValueError(
            f"{where}: hidden_states has {hidden_states.shape[0]} tokens but "
            f"expert_indices has {num_tokens}"
        )
    if bool(((expert_indices < 0) | (expert_indices >= num_experts)).any()):
        raise ValueError(f"{where}: expert_indices must lie in [0, {num_experts})")

    if ep_size == 1:
        flat_experts = expert_indices.reshape(-1)
        # Stable: rows of one expert keep token order, so the result is deterministic.
        sort_order = torch.argsort(flat_experts, stable=True)
        sorted_rows = hidden_states.index_select(0, sort_order // top_k)  # [T*k, H]
        state = TokenDispatchState(
            sort_order=sort_order,
            routes=None,
            recv_choices=None,
            send_split_sizes=[num_tokens * top_k],
            recv_split_sizes=[num_tokens * top_k],
            tokens_per_local_expert=torch.bincount(flat_experts, minlength=num_experts).tolist(),
            num_tokens=num_tokens,
            top_k=top_k,
            ep_group=None,
        )
        return sorted_rows, state

    assert ep_group is not None  # no group has size 1
    routes = route_unique_rows(expert_indices, per_rank, ep_size)
    recv_counts = torch.empty_like(routes.send_counts)
    dist.all_to_all_single(recv_counts, routes.send_counts, group=ep_group)  # no autograd
    send_sizes, recv_sizes = routes.send_counts.tolist(), recv_counts.tolist()
    recv_experts = routes.local_experts.new_empty(sum(recv_sizes), top_k)
    dist.all_to_all_single(
        recv_experts, routes.local_experts, recv_sizes, send_sizes, group=ep_group
    )
    rows = hidden_states.index_select(0, torch.div(routes.choices, top_k, rounding_mode="floor"))
    received = all_to_all(ep_group, ensure_joins_backward(rows), recv_sizes, send_sizes)
    recv_choices, per_expert = fan_out_order(recv_experts, per_rank)
    state = TokenDispatchState(
        sort_order=None,
        routes=routes,
        recv_choices=recv_choices,
        send_split_sizes=send_sizes,
        recv_split_sizes=recv_sizes,
        tokens_per_local_expert=per_expert,
        num_tokens=num_tokens,
        top_k=top_k,
        ep_group=ep_group,
    )
    return received.index_select(0, torch.div(recv_choices, top_k, rounding_mode="floor")), state


def combine_tokens(
    expert_output: torch.Tensor, weights: torch.Tensor, state: TokenDispatchState
) -> torch.Tensor:
    """Bring expert outputs home and sum each token's ``k`` rows weighted by ``weights``.

    Args:
        expert_output: ``[N, H]``, rows in the order :func:`dispatch_tokens` gave.
        weights: ``[T, k]`` router weights (the gradient flows into them too).
        state: what :func:`dispatch_tokens` returned with the expert input.

    Returns:
        ``[T, H]``: ``out[t] = sum_j weights[t, j] * expert_j(x[t])``.
    """
    num_tokens, top_k = state.num_tokens, state.top_k
    if tuple(weights.shape) != (num_tokens, top_k):
        raise ValueError(
            f"combine_tokens: weights must be [{num_tokens}, {top_k}], got {tuple(weights.shape)}"
        )
    if expert_output.dim() != 2 or expert_output.shape[0] != sum(state.tokens_per_local_expert):
        raise ValueError(
            f"combine_tokens: expert_output must be [{sum(state.tokens_per_local_expert)}, H], "
            f"got {tuple(expert_output.shape)}"
        )
    if state.sort_order is not None:  # no expert parallelism
        flat_rows = expert_output.index_select(0, inverse_permutation(state.sort_order))
        per_choice_TkH = flat_rows.view(num_tokens, top_k, expert_output.shape[1])
        return (per_choice_TkH * weights.unsqueeze(-1)).sum(dim=1)
    routes, recv_choices = state.routes, state.recv_choices
    assert routes is not None
    assert recv_choices is not None
    assert state.ep_group is not None
    # Each sent row's router weights travel to its experts' rank, which uses those of the
    # choices it serves (``recv_choices``).
    sent_weights = weights.index_select(0, torch.div(routes.choices, top_k, rounding_mode="floor"))
    recv_weights = all_to_all(
        state.ep_group,
        ensure_joins_backward(sent_weights),
        state.recv_split_sizes,
        state.send_split_sizes,
    )
    weighted = expert_output * recv_weights.reshape(-1).index_select(0, recv_choices).unsqueeze(1)
    received_rows = sum(state.recv_split_sizes)
    per_row = sum_choices(weighted, recv_choices, received_rows, top_k)  # [R', H]
    returned = all_to_all(
        state.ep_group,
        ensure_joins_backward(per_row),
        state.send_split_sizes,
        state.recv_split_sizes,
    )
    return sum_choices(returned, routes.choices, num_tokens, top_k)


def _draw_expert_weights(hidden_size: int, ffn_hidden_size: int) -> dict[str, torch.Tensor]:
    """One expert's initial weights, fp32 on the CPU from the default generator (biases 0)."""
    return {
        "fc.weight": torch.empty(ffn_hidden_size, hidden_size).normal_(0.0, INIT_STD),
        "fc.bias": torch.zeros(ffn_hidden_size),
        "out.weight": torch.empty(hidden_size, ffn_hidden_size).normal_(0.0, INIT_STD),
        "out.bias": torch.zeros(hidden_size),
    }


class ExpertMLP(nn.Module):
    """One expert: ``out(gelu(fc(x)))``, ``[N, H] -> [N, H]``.

    Every parameter carries the expert mark
    (:func:`mf_utils.set_expert_parallel_attribute`), so data-parallel
    gradient reduction treats it as living on one EP rank only. The mark is a
    Parameter attribute: materialising a meta-built expert with ``to_empty``
    creates new Parameters, and :meth:`reset_parameters` marks them again.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        where = "ExpertMLP"
        self.hidden_size = _check_positive_int(hidden_size, "hidden_size", where)
        self.ffn_hidden_size = _check_positive_int(ffn_hidden_size, "ffn_hidden_size", where)
        # Built on meta: nn.Linear's own init would draw from the default generator.
        self.fc = nn.Linear(hidden_size, ffn_hidden_size, device="meta", dtype=dtype)
        self.out = nn.Linear(ffn_hidden_size, hidden_size, device="meta", dtype=dtype)
        self.mark_expert_parameters()
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            self.to_empty(device=target)
            self.reset_parameters()

    def mark_expert_parameters(self) -> None:
        """Set the expert mark on every parameter of this expert."""
        for param in self.parameters():
            set_expert_parallel_attribute(param)

    def reset_parameters(self) -> None:
        """Draw fresh weights (see :func:`_draw_expert_weights`) and re-mark the parameters."""
        self.load_initial_weights(_draw_expert_weights(self.hidden_size, self.ffn_hidden_size))

    def load_initial_weights(self, drawn: dict[str, torch.Tensor]) -> None:
        """Copy ``drawn`` (names as in the state dict) into the parameters and mark them."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(drawn[name])
        self.mark_expert_parameters()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Apply the expert to ``[N, H]`` rows (``N`` may be 0)."""
        return self.out(F.gelu(self.fc(hidden_states)))


class MoELayer(nn.Module):
    """Dropless top-k mixture-of-experts MLP, its experts spread over an EP group.

    With an ``etp_group`` each expert's FFN is split over it too (expert tensor
    parallelism, separate from the attention's TP): after the EP dispatch every
    ETP rank gathers the rows of its ETP peers, computes its share of their
    hidden units, and the partial outputs are summed back onto each row's rank
    (:mod:`mf_tp.expert_rows`). The ETP ranks see different tokens (they are
    data-parallel for the rest of the model); the expert weights' gradients
    cover all of them.

    ``experts`` is a :class:`mf_tp.GroupedExperts`: four parameters with a
    leading expert dim, parameter-shaped over all ``E`` experts at every EP
    size (DTensors ``Shard(0)`` over the EP group when it has more than one
    rank, each rank computing with its own experts' rows). So a state-dict
    entry (``experts.fc_weight [E, F, H]``) is the same tensor at every EP
    size, and a checkpoint written at one EP size loads at another. A
    checkpoint with the per-expert entries of mf-tp before 0.3.0
    (``experts.5.fc.weight``) is refused, naming
    :func:`mf_tp.convert_per_expert_state_dict`.

    After each forward, ``load_balance_loss`` (a scalar in the graph: add a
    multiple of it to the loss) and ``tokens_per_expert`` (``[E]`` long,
    detached: for logging) describe this rank's latest routing.

    Gradients: expert parameters receive the contributions of every rank's
    tokens routed to them; the router weight only this rank's. Reduce the
    router (and other dense) gradients over data parallelism as usual, and
    expert gradients only over the ranks that hold the same experts.
    """

    load_balance_loss: torch.Tensor | None
    tokens_per_expert: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        ep_group: _Group | None = None,
        etp_group: _Group | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        where = "MoELayer"
        self.hidden_size = _check_positive_int(hidden_size, "hidden_size", where)
        self.ffn_hidden_size = _check_positive_int(ffn_hidden_size, "ffn_hidden_size", where)
        self.num_experts = _check_positive_int(num_experts, "num_experts", where)
        self.top_k = _check_top_k(top_k, num_experts, where)
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = _ep_size_and_rank(ep_group)
        self.num_local_experts = _experts_per_rank(num_experts, self.ep_size, where)
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        # Built on meta and initialised once, below, so that construction draws
        # nothing that depends on the EP size.
        self.router = TopKRouter(hidden_size, num_experts, top_k, device="meta", dtype=dtype)
        self.experts = GroupedExperts(
            num_experts,
            hidden_size,
            ffn_hidden_size,
            ep_group=ep_group,
            etp_group=etp_group,
            device="meta",
            dtype=dtype,
        )
        self.etp_group = etp_group if self.experts.etp_size > 1 else None
        self.register_load_state_dict_pre_hook(_refuse_per_expert_entries)
        self.load_balance_loss = None
        self.tokens_per_expert = None
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            self.to_empty(device=target)
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the same model at any EP size for the same seed.

        Draws the router weight, then every expert's weights for all
        ``num_experts`` experts in global order, from the default CPU
        generator in fp32; keeps the local experts' and discards the rest.
        """
        self.router.reset_parameters()
        self.experts.load_initial_weights(
            [
                _draw_expert_weights(self.hidden_size, self.ffn_hidden_size)
                for _ in range(self.num_experts)
            ]
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., H]``: route, dispatch, run the local experts, combine."""
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoELayer: expected the last dim to be hidden_size={self.hidden_size}, "
                f"got shape {tuple(hidden_states.shape)}"
            )
        tokens_TH = hidden_states.reshape(-1, self.hidden_size)
        routing = self.router(tokens_TH)
        expert_input, state = dispatch_tokens(
            tokens_TH, routing.expert_indices, self.num_experts, self.ep_group
        )
        rows_per_expert = state.tokens_per_local_expert
        if self.etp_group is not None:  # every ETP rank's rows, then their partial sums back
            expert_input, rows_per_expert, rows = gather_expert_rows(
                expert_input, rows_per_expert, self.etp_group
            )
            expert_output = reduce_scatter_expert_rows(
                self.experts(expert_input, rows_per_expert), rows
            )
        else:
            expert_output = self.experts(expert_input, rows_per_expert)
        out_TH = combine_tokens(expert_output, routing.weights, state)
        self.load_balance_loss = routing.load_balance_loss
        self.tokens_per_expert = routing.tokens_per_expert.detach()
        return out_TH.view(hidden_states.shape)


def _refuse_per_expert_entries(
    module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *args: object
) -> None:
    """Stop a load of a checkpoint with per-expert entries, naming the converter."""
    per_expert = re.compile(rf"{re.escape(prefix)}experts\.\d+\.")
    old = next((key for key in state_dict if per_expert.match(key)), None)
    if old is not None:
        raise ValueError(
            f"MoELayer.load_state_dict: entry {old!r} is a per-expert entry of mf-tp before "
            "0.3.0; expected grouped ones (experts.fc_weight [E, F, H], ...): convert the "
            "checkpoint with mf_tp.convert_per_expert_state_dict"
        )
