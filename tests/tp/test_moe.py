"""The mixture-of-experts layer: router math, dropless dispatch, EP parity with one process.

- Router: the chosen experts, weights, load-balance loss and counts against a
  hand computation.
- Dispatch/combine in one process: a hypothesis round trip with identity
  experts, and the row layout the experts see.
- EP = 2 and EP = 4 on gloo: every rank builds the expert-parallel layer and
  the single-process reference (all experts) from the same seed, and checks
  the initial weights, the outputs, the input gradients, every local expert
  gradient (summed over all ranks' tokens) and the router gradient (this
  rank's tokens only). The routing is made uneven on purpose: one expert gets
  no token at all and rank 0 sends nothing to rank 1.
- Bad input: each error names the argument and value.

Only the order of fp32 sums differs between EP and the reference, hence
atol = rtol = 1e-5.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import mf_tp
import mf_utils
from tests._multiprocess import run_on_ranks

ATOL = 1e-5
RTOL = 1e-5
HIDDEN, FFN, NUM_EXPERTS, TOP_K = 16, 24, 8, 2
LOAD_BALANCE_COEFF = 0.1
SEED = 1234
BLOCKED = -20.0  # an input feature this low makes its expert's logit hopeless
README = Path(__file__).resolve().parents[2] / "packages" / "mf-tp" / "README.md"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=what)


def test_router_matches_hand_computation() -> None:
    torch.manual_seed(0)
    num_tokens, hidden, num_experts, top_k = 9, 6, 5, 2
    router = mf_tp.TopKRouter(hidden, num_experts, top_k)
    x = torch.randn(num_tokens, hidden)
    result = router(x)

    probs = torch.softmax(x @ router.weight.detach().t(), dim=-1)
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    chosen.scatter_(1, result.expert_indices, True)
    assert result.expert_indices.dtype == torch.long
    assert chosen.sum(1).eq(top_k).all(), "the k choices of a token must be distinct"
    # The chosen experts are the top-k: each chosen probability beats every other one.
    lowest_chosen = probs.masked_fill(~chosen, float("inf")).min(1).values
    highest_other = probs.masked_fill(chosen, float("-inf")).max(1).values
    assert (lowest_chosen >= highest_other).all()

    picked = probs.gather(1, result.expert_indices)
    _close(result.weights, picked / picked.sum(1, keepdim=True), "weights")
    _close(result.weights.sum(1), torch.ones(num_tokens), "weights sum to 1")

    counts = torch.bincount(result.expert_indices.reshape(-1), minlength=num_experts)
    assert torch.equal(result.tokens_per_expert, counts)
    assert int(counts.sum()) == num_tokens * top_k
    assert not result.tokens_per_expert.requires_grad

    fraction = counts.float() / (num_tokens * top_k)
    expected_loss = num_experts * sum(fraction[e] * probs[:, e].mean() for e in range(num_experts))
    _close(result.load_balance_loss, expected_loss, "load_balance_loss")
    result.load_balance_loss.backward()
    assert router.weight.grad is not None
    assert router.weight.grad.abs().sum() > 0


def test_router_weights_follow_input_dtype_and_empty_batch() -> None:
    torch.manual_seed(0)
    router = mf_tp.TopKRouter(4, 3, 2, dtype=torch.bfloat16)
    result = router(torch.randn(5, 4, dtype=torch.bfloat16))
    assert result.weights.dtype == torch.bfloat16
    assert result.load_balance_loss.dtype == torch.float32
    empty = router(torch.zeros(0, 4, dtype=torch.bfloat16))
    assert empty.expert_indices.shape == (0, 2)
    assert empty.load_balance_loss.item() == 0.0  # not NaN
    assert empty.tokens_per_expert.tolist() == [0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    hidden=st.integers(1, 5),
    num_experts=st.integers(1, 6),
    data=st.data(),
)
def test_dispatch_then_combine_with_identity_experts_is_identity(
    num_tokens: int, hidden: int, num_experts: int, data: st.DataObject
) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    x = torch.randn(num_tokens, hidden, generator=gen)
    # k distinct experts per token, in random order.
    indices = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :top_k]
    weights = torch.randn(num_tokens, top_k, generator=gen).softmax(1)

    expert_input, state = mf_tp.dispatch_tokens(x, indices, num_experts)

    # Block e holds, in token order, the tokens that chose expert e.
    expected_blocks = [x[(indices == e).any(1)] for e in range(num_experts)]
    assert state.tokens_per_local_expert == [len(b) for b in expected_blocks]
    assert torch.equal(expert_input, torch.cat(expected_blocks))
    out = mf_tp.combine_tokens(expert_input, weights, state)
    torch.testing.assert_close(out, x, atol=1e-6, rtol=1e-6)


def test_combine_sends_gradient_to_router_weights() -> None:
    x = torch.arange(6.0).view(3, 2)
    indices = torch.tensor([[0, 1], [1, 0], [1, 0]])
    weights = torch.full((3, 2), 0.5, requires_grad=True)
    expert_input, state = mf_tp.dispatch_tokens(x, indices, 2)
    scale = torch.tensor([1.0, 3.0]).repeat_interleave(torch.tensor(state.tokens_per_local_expert))
    out = mf_tp.combine_tokens(expert_input * scale[:, None], weights, state)
    _close(out, x * 2.0, "0.5 * 1x + 0.5 * 3x")
    out.sum().backward()
    # d out / d weights[t, j] = sum_h (scale of the chosen expert) * x[t, h]
    expected = torch.tensor([[1.0, 3.0], [3.0, 1.0], [3.0, 1.0]]) * x.sum(1, keepdim=True)
    _close(weights.grad, expected, "weights.grad")


def test_layer_marks_expert_parameters_and_groups_experts() -> None:
    torch.manual_seed(0)
    layer = mf_tp.MoELayer(HIDDEN, FFN, NUM_EXPERTS, TOP_K)
    for name, param in layer.named_parameters():
        assert mf_utils.is_expert_parallel_parameter(param) == name.startswith("experts."), name
    assert layer.experts.fc_weight.shape == (NUM_EXPERTS, FFN, HIDDEN)
    assert layer.experts.out_weight.shape == (NUM_EXPERTS, HIDDEN, FFN)
    expert = mf_tp.ExpertMLP(4, 8)
    assert all(mf_utils.is_expert_parallel_parameter(p) for p in expert.parameters())
    assert expert(torch.zeros(0, 4)).shape == (0, 4)  # an expert with no token still works


def test_layer_keeps_leading_dims_and_reports_routing() -> None:
    torch.manual_seed(0)
    layer = mf_tp.MoELayer(HIDDEN, FFN, NUM_EXPERTS, TOP_K)
    x = torch.randn(2, 3, HIDDEN, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    assert layer.tokens_per_expert is not None
    assert int(layer.tokens_per_expert.sum()) == 6 * TOP_K
    assert layer.load_balance_loss is not None
    assert layer.load_balance_loss.requires_grad
    (out.sum() + layer.load_balance_loss).backward()
    assert x.grad is not None
    assert layer.router.weight.grad is not None


def test_meta_layer_is_uninitialised_until_reset() -> None:
    torch.manual_seed(SEED)
    eager = mf_tp.MoELayer(HIDDEN, FFN, NUM_EXPERTS, TOP_K)
    torch.manual_seed(SEED)
    lazy = mf_tp.MoELayer(HIDDEN, FFN, NUM_EXPERTS, TOP_K, device="meta")
    assert lazy.router.weight.is_meta
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for name, value in eager.state_dict().items():
        assert torch.equal(lazy.state_dict()[name], value), name
    # to_empty replaced the Parameters; reset_parameters marked the new ones.
    assert all(mf_utils.is_expert_parallel_parameter(p) for p in lazy.experts.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 9}, r"top_k must be in \[1, num_experts=8\], got top_k=9"),
        ({"top_k": 0}, r"top_k must be a positive int, got 0"),
        ({"num_experts": 0}, r"num_experts must be a positive int, got 0"),
        ({"hidden_size": -1}, r"hidden_size must be a positive int, got -1"),
        ({"ffn_hidden_size": 0}, r"ffn_hidden_size must be a positive int, got 0"),
        ({"hidden_size": True}, r"hidden_size must be a positive int, got True"),
    ],
)
def test_layer_rejects_bad_sizes(kwargs: dict[str, int], match: str) -> None:
    args = {"hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_experts": 8, "top_k": 2}
    with pytest.raises(ValueError, match=match):
        mf_tp.MoELayer(**{**args, **kwargs})


def test_router_and_dispatch_reject_bad_input() -> None:
    with pytest.raises(ValueError, match=r"TopKRouter: top_k must be in \[1, num_experts=3\]"):
        mf_tp.TopKRouter(4, 3, 4)
    with pytest.raises(ValueError, match=r"expected tokens of shape \[T, 4\], got \(2, 5\)"):
        mf_tp.TopKRouter(4, 3, 1)(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"expert_indices must lie in \[0, 2\)"):
        mf_tp.dispatch_tokens(torch.zeros(2, 3), torch.tensor([[0], [2]]), 2)
    with pytest.raises(ValueError, match="hidden_states has 3 tokens but expert_indices has 2"):
        mf_tp.dispatch_tokens(torch.zeros(3, 3), torch.tensor([[0], [1]]), 2)
    _, state = mf_tp.dispatch_tokens(torch.zeros(2, 3), torch.tensor([[0], [1]]), 2)
    with pytest.raises(ValueError, match=r"weights must be \[2, 1\], got \(2, 2\)"):
        mf_tp.combine_tokens(torch.zeros(2, 3), torch.zeros(2, 2), state)
    with pytest.raises(ValueError, match="MoELayer: expected the last dim to be hidden_size=16"):
        mf_tp.MoELayer(HIDDEN, FFN, 2, 1)(torch.zeros(3, 5))


def _router_weight() -> torch.Tensor:
    """Gate on feature e for expert e, so an input feature can steer the routing."""
    gen = torch.Generator().manual_seed(7)
    weight = 0.02 * torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
    weight[:, :NUM_EXPERTS] += 0.5 * torch.eye(NUM_EXPERTS)
    return weight


def _blocked_experts(rank: int, ep_size: int) -> list[int]:
    """Nobody picks the last expert; rank 0 picks none of rank 1's experts."""
    local = NUM_EXPERTS // ep_size
    blocked = {NUM_EXPERTS - 1}
    if rank == 0:
        blocked |= set(range(local, 2 * local))
    return sorted(blocked)


def _batch(rank: int, ep_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens ``[2, 3 + rank, H]`` and its fixed upstream gradient."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 3 + rank, HIDDEN, generator=gen)
    x[..., _blocked_experts(rank, ep_size)] = BLOCKED
    return x, torch.randn(x.shape, generator=gen)


def _forward_and_loss(
    layer: mf_tp.MoELayer, x: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and rank's loss: a fixed function of it plus the load-balance term."""
    out = layer(x)
    assert layer.load_balance_loss is not None
    return out, (out * g).sum() + LOAD_BALANCE_COEFF * layer.load_balance_loss


def _build_same_seed(ep_group: dist.ProcessGroup | None) -> tuple[mf_tp.MoELayer, torch.Tensor]:
    torch.manual_seed(SEED)
    layer = mf_tp.MoELayer(HIDDEN, FFN, NUM_EXPERTS, TOP_K, ep_group=ep_group)
    return layer, torch.get_rng_state()


def _reference_run(
    reference: mf_tp.MoELayer, rank: int, ep_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, every rank's batch separately: rank ``rank``'s results + summed expert grads."""
    expert_grads = {
        n: torch.zeros_like(p) for n, p in reference.named_parameters() if n.startswith("experts.")
    }
    mine: dict[str, torch.Tensor] = {}
    for r in range(ep_size):
        reference.zero_grad(set_to_none=True)
        x, g = _batch(r, ep_size)
        x.requires_grad_(True)
        out, loss = _forward_and_loss(reference, x, g)
        loss.backward()
        for name, grad in expert_grads.items():
            param_grad = reference.get_parameter(name).grad
            if param_grad is not None:
                grad += param_grad
        if r == rank:
            mine = {
                "out": out.detach(),
                "x.grad": x.grad,
                "router.grad": reference.router.weight.grad.clone(),
                "tokens_per_expert": reference.tokens_per_expert,
            }
    return mine, expert_grads


def _mine(grad: torch.Tensor, rank: int, ep_size: int) -> torch.Tensor:
    """Rank ``rank``'s experts' rows of a full ``[E, ...]`` expert tensor."""
    local = NUM_EXPERTS // ep_size
    return grad[rank * local : (rank + 1) * local]


def _rank_ep_parity(rank: int, ep_size: int) -> None:
    group = dist.group.WORLD
    layer, rng_after_ep = _build_same_seed(group)
    reference, rng_after_reference = _build_same_seed(None)
    local = NUM_EXPERTS // ep_size
    assert layer.local_expert_indices == list(range(rank * local, (rank + 1) * local))
    # The default generator advanced the same at EP size 1 and ep_size.
    assert torch.equal(rng_after_ep, rng_after_reference)

    # Same initial weights, parameter-shaped at any EP size: the EP checkpoint's entries
    # are the full [E, ...] tensors and load into the EP=1 layer with strict=True.
    ep_state, reference_state = layer.state_dict(), reference.state_dict()
    assert set(ep_state) == set(reference_state)
    full_state = {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in ep_state.items()
    }
    for name, value in full_state.items():
        assert torch.equal(value, reference_state[name]), name
    reference.load_state_dict(full_state, strict=True)

    with torch.no_grad():
        layer.router.weight.copy_(_router_weight())
        reference.router.weight.copy_(_router_weight())
    expected, expected_expert_grads = _reference_run(reference, rank, ep_size)

    x, g = _batch(rank, ep_size)
    x.requires_grad_(True)
    out, loss = _forward_and_loss(layer, x, g)
    _close(out, expected["out"], "output")
    loss.backward()
    _close(x.grad, expected["x.grad"], "input gradient")
    _close(layer.router.weight.grad, expected["router.grad"], "router gradient")
    for name, param in layer.named_parameters():
        if name.startswith("experts."):
            expected_grad = _mine(expected_expert_grads[name], rank, ep_size)
            _close(param.grad.to_local(), expected_grad, f"gradient of {name}")
    assert torch.equal(layer.tokens_per_expert, expected["tokens_per_expert"])

    # The uneven routing this test is about really happened.
    total = layer.tokens_per_expert.clone()
    dist.all_reduce(total, group=group)
    assert total[NUM_EXPERTS - 1] == 0, "the last expert should get no token"
    if rank == 0:
        assert layer.tokens_per_expert[local : 2 * local].sum() == 0, "rank 0 sends to rank 1"
    if rank == ep_size - 1:
        grads = [p.grad.to_local()[-1] for p in layer.experts.parameters()]
        assert not any(grad.any() for grad in grads), "the unused last expert got a gradient"

    # A rank whose tokens need no gradient still joins the backward exchanges.
    layer.zero_grad(set_to_none=True)
    x_again = x.detach().requires_grad_(rank != 0)
    _forward_and_loss(layer, x_again, g)[1].backward()
    for name, param in layer.named_parameters():
        if name.startswith("experts."):
            expected_grad = _mine(expected_expert_grads[name], rank, ep_size)
            _close(param.grad.to_local(), expected_grad, f"gradient of {name} (no input grad)")

    # The EP size must divide the number of experts.
    bad = NUM_EXPERTS + 1
    match = rf"num_experts {bad} is not divisible by the expert-parallel \(EP\) size {ep_size}"
    with pytest.raises(ValueError, match=match):
        mf_tp.MoELayer(HIDDEN, FFN, bad, TOP_K, ep_group=group)
    with pytest.raises(ValueError, match=match):
        mf_tp.dispatch_tokens(torch.zeros(1, 2), torch.zeros(1, 1, dtype=torch.long), bad, group)


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_parallel_matches_single_process(ep_size: int) -> None:
    run_on_ranks(_rank_ep_parity, ep_size, timeout=60)


def test_readme_moe_example_runs() -> None:
    text = README.read_text()
    section = re.search(r"## Mixture of experts.*?```python\n(.*?)```", text, re.S)
    assert section is not None, "README lost its mixture-of-experts example"
    exec(compile(section.group(1), "README-moe-example", "exec"), {})


def _rank_dispatch_sends_a_token_once_per_rank(rank: int, ep_size: int) -> None:
    num_experts, local = 4, 2  # rank r owns experts 2r and 2r + 1
    x = torch.arange(12.0).view(4, 3) + 100 * rank
    # Token 0: both experts on rank 1; 1: both on rank 0; 2: one on each; 3: 3 then 1.
    indices = torch.tensor([[2, 3], [1, 0], [0, 3], [3, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.2, 0.8], [0.5, 0.5]], requires_grad=True)
    expert_input, state = mf_tp.dispatch_tokens(x, indices, num_experts, dist.group.WORLD)
    # One row per (token, destination rank): rank 0 gets tokens 1, 2, 3; rank 1 gets 0, 2, 3.
    assert state.send_split_sizes == [3, 3], state.send_split_sizes
    assert state.recv_split_sizes == [3, 3], state.recv_split_sizes
    # Each local expert gets every choice of it, from both ranks (4 per expert here).
    assert sum(state.tokens_per_local_expert) == 2 * 4
    # Expert e multiplies by e + 1: out[t] = sum_j w[t, j] * (expert_j + 1) * x[t].
    first = rank * local
    counts = torch.tensor(state.tokens_per_local_expert)
    scale = (torch.arange(local) + first + 1.0).repeat_interleave(counts)
    out = mf_tp.combine_tokens(expert_input * scale[:, None], weights, state)
    factor = (weights * (indices + 1.0)).sum(1, keepdim=True)
    _close(out, factor * x, "weighted experts")
    out.sum().backward()
    _close(weights.grad, (indices + 1.0) * x.sum(1, keepdim=True), "weights.grad")


@pytest.mark.multiprocess
def test_dispatch_sends_a_token_once_per_destination_rank() -> None:
    run_on_ranks(_rank_dispatch_sends_a_token_once_per_rank, 2, timeout=60)
