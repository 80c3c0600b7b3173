"""Parameters the engine cannot carry stop in one line on every rank (``engine/discover.py``).

Each case was a silent wrong result or a crash before the checks:
- a tensor subclass without FSDP2's extension: its values were copied into flat
  buffers and the module went on computing with the subclass's own, never updated
  (now sharded as an extension parameter under ZeRO-2/3, whose hooks may be set on
  its sharded local tensor until the first forward, which refuses it without them);
- two parameters that are overlapping views of one tensor: each got its own buffer,
  so after two SGD steps the model differed from the unwrapped one;
- a parameter whose dtype differs across ranks: gloo aborted the process in C++.

Views that do not overlap (pieces of one flat buffer) train exactly as unwrapped.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import mf_fsdp
from tests._multiprocess import run_on_ranks


class _Pair(nn.Module):
    """Two linear maps whose weights may be views of one tensor."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        super().__init__()
        self.a = nn.Parameter(first)
        self.b = nn.Parameter(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.t()).tanh() @ self.b


def _views(overlap: bool) -> _Pair:
    """Weights ``a`` (4 x 4) and ``b`` (4 x 4) carved out of one storage."""
    torch.manual_seed(0)
    flat = torch.randn(40)
    second = 8 if overlap else 16  # rows 2.. of ``a`` are ``b``'s first rows when overlapping
    return _Pair(flat[:16].view(4, 4), flat[second : second + 16].view(4, 4))


def _sgd_steps(model: nn.Module, rank: int, world: int, steps: int = 2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        loss = model(torch.randn(3, 4, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _two_tensor_linear() -> nn.Linear:
    """A linear map whose weight is a ``TwoTensor`` (a subclass without FSDP2's hooks)."""
    plain = nn.Linear(4, 4)
    plain.weight = nn.Parameter(TwoTensor(plain.weight.detach(), plain.weight.detach().clone()))
    return plain


def _rank_checks(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"parameters 'a' and 'b' share memory \(overlapping"):
        mf_fsdp.fully_shard_model(_views(overlap=True))

    with pytest.raises(TypeError, match=r"parameter 'weight' is a .*TwoTensor, a tensor subclass"):
        mf_fsdp.fully_shard_model(_two_tensor_linear(), zero_dp_strategy=1)
    # ZeRO-2/3 shard it as FSDP2 does: its hooks may be set on the sharded local tensor
    # until the first forward, which stops every rank when they are still missing.
    model = mf_fsdp.fully_shard_model(_two_tensor_linear())
    with pytest.raises(
        TypeError,
        match=r"parameter 'weight' is a .*TwoTensor without FSDP2's all-gather "
        r"extension at the first forward \(ranks \[0, 1\]",
    ):
        model(torch.randn(2, 4))

    lazy = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(TypeError, match=r"parameter '0.weight' is an uninitialized parameter"):
        mf_fsdp.fully_shard_model(lazy)

    skewed = nn.Linear(4, 4, dtype=torch.bfloat16 if rank == 1 else torch.float32)
    with pytest.raises(
        ValueError,
        match=r"ranks disagree on parameter #0: rank 0 has weight: Parameter torch.float32 "
        r"\(4, 4\) grad=True; rank 1 has weight: Parameter torch.bfloat16",
    ):
        mf_fsdp.fully_shard_model(skewed)

    # A plain parameter's sharded local tensor is a view of a flat bucket: hooks set on it
    # after the wrap would not be called (FSDP2 calls them), so the first forward refuses.
    model = mf_fsdp.fully_shard_model(nn.Linear(4, 4))
    model.module.weight._local_tensor.fsdp_pre_all_gather = lambda mesh: ((), None)
    with pytest.raises(TypeError, match=r"parameter 'weight' is a plain tensor whose sharded"):
        model(torch.randn(2, 4))

    # Last: hooks that change what is gathered after the first forward stop every rank
    # (their process groups are torn down).
    model = mf_fsdp.fully_shard_model(_two_tensor_linear())
    local = model.module.weight._local_tensor
    local.fsdp_pre_all_gather = lambda mesh: ((local.a,), None)
    local.fsdp_post_all_gather = lambda outputs, meta, dtype, out=None: (
        None if out is not None else (outputs[0], outputs)
    )
    model(torch.randn(2, 4))
    local.fsdp_pre_all_gather = lambda mesh: ((local.a.double(),), None)
    with pytest.raises(RuntimeError, match=r"fsdp_pre_all_gather returned .*float64.*where its "):
        model(torch.randn(2, 4))


@pytest.mark.multiprocess
def test_unsupported_parameters_stop_every_rank_in_one_line() -> None:
    run_on_ranks(_rank_checks, 2)


def _rank_disjoint_views_train_exactly(rank: int, world: int) -> None:
    # Each rank's batch differs: the reference averages the ranks' gradients by hand.
    reference = _views(overlap=False)
    opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    expected = []
    for step in range(2):
        grads = None
        losses = []
        for r in range(world):
            g = torch.Generator().manual_seed(10 * step + r)
            loss = reference(torch.randn(3, 4, generator=g)).square().mean()
            losses.append(loss.item())
            part = torch.autograd.grad(loss, [reference.a, reference.b])
            grads = part if grads is None else [x + y for x, y in zip(grads, part, strict=True)]
        for p, g in zip((reference.a, reference.b), grads, strict=True):
            p.grad = g / world
        opt.step()
        opt.zero_grad()
        expected.append(losses[rank])
    model = mf_fsdp.fully_shard_model(_views(overlap=False))
    assert _sgd_steps(model, rank, world) == pytest.approx(expected, rel=1e-6)
    for name, value in (("a", reference.a), ("b", reference.b)):
        torch.testing.assert_close(getattr(model.module, name).full_tensor(), value.detach())


@pytest.mark.multiprocess
def test_disjoint_views_of_one_buffer_train_exactly() -> None:
    run_on_ranks(_rank_disjoint_views_train_exactly, 2)
