"""vocab_parallel_cross_entropy equals F.cross_entropy in value and gradient.

In-process, hypothesis draws shapes, vocab sizes, label smoothing and logits
over a gloo group of one rank. A 2-rank spawn then checks many drawn cases with
the vocab split in two, targets forced onto both sides of the shard boundary.
Tolerance: rtol 1e-5, atol 1e-6 (fp32; the TP path sums exp and logits in a
different order than torch's log_softmax).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import mf_tp
from tests._multiprocess import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def single_rank_group() -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo world in this process (torn down after the module)."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    with tempfile.TemporaryDirectory(prefix="mf-tp-ce-") as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1
        )
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _compare(
    shard: torch.Tensor,
    full: torch.Tensor,
    target: torch.Tensor,
    smoothing: float,
    group: dist.ProcessGroup,
    rank: int,
    world: int,
) -> None:
    shard = shard.clone().requires_grad_(True)
    full = full.clone().requires_grad_(True)
    weights = torch.linspace(0.5, 1.5, target.numel()).reshape(target.shape)
    loss = mf_tp.vocab_parallel_cross_entropy(shard, target, smoothing, group=group)
    expected = F.cross_entropy(
        full.reshape(-1, full.shape[-1]),
        target.reshape(-1),
        reduction="none",
        label_smoothing=smoothing,
    ).reshape(target.shape)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(
        shard.grad, full.grad.chunk(world, dim=-1)[rank], rtol=RTOL, atol=ATOL
    )


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    vocab=st.integers(1, 33),
    smoothing=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_on_one_rank(
    single_rank_group: dist.ProcessGroup,
    shape: list[int],
    vocab: int,
    smoothing: float,
    scale: float,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=gen) * scale
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[-1] = vocab - 1
    _compare(logits, logits, target, smoothing, single_rank_group, 0, 1)


def test_half_precision_logits_give_fp32_loss(single_rank_group: dist.ProcessGroup) -> None:
    logits = torch.randn(3, 5).to(torch.bfloat16).requires_grad_(True)
    target = torch.tensor([0, 4, 2])
    loss = mf_tp.vocab_parallel_cross_entropy(logits, target, group=single_rank_group)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    expected = F.cross_entropy(logits.detach().float(), target, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)


def test_bad_input(single_rank_group: dist.ProcessGroup) -> None:
    group = single_rank_group
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"target must have shape \(2, 3\)"):
        mf_tp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), group=group)
    with pytest.raises(ValueError, match=r"target must lie in \[0, 4\), got values in \[0, 4\]"):
        mf_tp.vocab_parallel_cross_entropy(
            logits, torch.tensor([[0, 1, 4], [0, 0, 0]]), group=group
        )
    with pytest.raises(TypeError, match="target must be an integer tensor"):
        mf_tp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 3), group=group)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        mf_tp.vocab_parallel_cross_entropy(
            logits, torch.zeros(2, 3, dtype=torch.long), 1.5, group=group
        )
    with pytest.raises(ValueError, match="V/t > 0"):
        mf_tp.vocab_parallel_cross_entropy(
            torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), group=group
        )


def _rank_cross_entropy(rank: int, world: int, cases: int) -> None:
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(99)  # the same cases on every rank
    for _ in range(cases):
        ndim = int(torch.randint(1, 4, (), generator=gen))
        shape = torch.randint(1, 5, (ndim,), generator=gen).tolist()
        shard_vocab = int(torch.randint(1, 9, (), generator=gen))
        vocab = shard_vocab * world
        smoothing = float(torch.rand((), generator=gen)) if _ % 2 else 0.0
        scale = [0.1, 1.0, 30.0][_ % 3]
        full = torch.randn(*shape, vocab, generator=gen) * scale
        target = torch.randint(0, vocab, shape, generator=gen).view(-1)
        # Both sides of every shard boundary, and the two ends of the vocab.
        edges = [0, vocab - 1] + [b * shard_vocab + d for b in range(1, world) for d in (-1, 0)]
        target[: min(len(edges), target.numel())] = torch.tensor(edges)[: target.numel()]
        target = target.view(shape)
        shard = full.chunk(world, dim=-1)[rank]
        _compare(shard, full, target, smoothing, group, rank, world)


@pytest.mark.multiprocess
def test_matches_torch_with_vocab_split_over_two_ranks() -> None:
    run_on_ranks(_rank_cross_entropy, 2, 80)
