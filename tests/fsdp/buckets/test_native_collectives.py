"""The parity suites again, on the collectives' native-backend branches (``native_collectives``).

On gloo mf_fsdp's collectives take paths of their own: point-to-point transfers
for large buckets, gloo's coalesced all-gather called on the group, small
reductions packed into one all-reduce by mf, the mean taken in the collective.
NCCL (any backend but gloo) takes the others: the native call at every size,
torch's ``_coalescing_manager`` for packs of every kind, in-place reduce-scatters
handed to the backend, the division before the reduction. The CUDA tests run at
world 1, where a group of one skips every collective, so without this module
those branches would run only on a multi-GPU machine.

Here gloo serves them (``tests/fsdp/_issued.py``): each test runs a parity
suite's own rank function unchanged inside ``native_collectives()`` at world 2
or 4, so the suite's checks against one process hold on those branches, and the
collectives spied on show that they were taken (no point-to-point transfer; the
branches named in each test).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

import mf_fsdp
from mf.models import GPT, GPTConfig
from mf_fsdp.buckets.collectives import POINT_TO_POINT_MIN_BYTES
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    CONFIG,
    assert_matches_reference,
    batch,
    full_params,
    make_optimizer,
    optimizer_step,
    reference_run,
    unit_classes,
)
from tests.fsdp._issued import Issued, native_collectives, spy_collectives
from tests.fsdp.engine import test_hsdp, test_parity, test_rank_paths, test_step_in_backward


def _rank_native(
    rank: int, world: int, fn: Callable[..., None], args: tuple[Any, ...], report: str
) -> None:
    """``fn(rank, world, *args)`` on the native branches; rank 0 reports the branches taken."""
    with native_collectives(), spy_collectives() as issued:
        fn(rank, world, *args)
    sent = [call for call in issued if call.kind == "point_to_point"]
    assert not sent, f"{len(sent)} point-to-point transfers on the native branches"
    if rank == 0:
        branches = sorted({call.branch() for call in issued})
        pathlib.Path(report).write_text(json.dumps(branches))


def _run(tmp_path, world: int, fn: Callable[..., None], *args: Any, timeout: float) -> set[str]:
    """Run ``fn`` on ``world`` ranks inside ``native_collectives()``; the branches taken."""
    report = tmp_path / "branches.json"
    run_on_ranks(_rank_native, world, fn, args, str(report), timeout=timeout)
    return set(json.loads(report.read_text()))


EVERY_PACK = {
    "all_gather coalesced",
    "reduce_scatter coalesced",
    "reduce_scatter coalesced in place",
    "all_reduce coalesced",
}
"""A pack of every kind through ``_coalescing_manager`` (the tiny GPT's buckets fit one
window): ZeRO-1/2/3's gathers, ZeRO-2/3's reductions, ZeRO-1's in place (its grad store
is this rank's piece of the local grads), ZeRO-0's all-reduces."""

ALONE = {"all_gather", "reduce_scatter", "reduce_scatter in place"}
"""The native calls one at a time (a window of 0, or a bucket alone in its pack)."""


@pytest.mark.multiprocess
def test_every_strategy_at_world_2(tmp_path) -> None:
    branches = _run(
        tmp_path, 2, test_parity._rank_parity, [0, 1, 2, 3], ["sgd", "adam"], timeout=240
    )
    assert branches >= EVERY_PACK, branches


@pytest.mark.multiprocess
def test_every_strategy_at_world_4(tmp_path) -> None:
    branches = _run(tmp_path, 4, test_parity._rank_parity, [0, 1, 2, 3], ["sgd"], timeout=300)
    assert branches >= EVERY_PACK, branches


@pytest.mark.multiprocess
def test_hsdp_and_hybrid_sharded_at_world_4(tmp_path) -> None:
    cases = test_hsdp.HSDP_CASES[::2] + test_hsdp.HFSDP_CASES[::2]
    refs = test_hsdp._references(cases)
    branches = _run(tmp_path, 4, test_hsdp._rank_parity, cases, refs, timeout=600)
    assert branches >= EVERY_PACK, branches


@pytest.mark.multiprocess
def test_skipped_units_at_world_2(tmp_path) -> None:
    runs = [
        (f"{name} {opt_name} z{strategy}", {"zero_dp_strategy": strategy}, opt_name, plan, 1)
        for name, plan in test_rank_paths.CASES.items()
        for opt_name in ("sgd", "adam")
        for strategy in range(4)
    ]
    branches = _run(tmp_path, 2, test_rank_paths._check_runs, runs, timeout=300)
    assert branches >= EVERY_PACK, branches


@pytest.mark.multiprocess
def test_step_in_the_backward_at_world_2_and_4(tmp_path) -> None:
    cases = [(3, "sgd", 1), (3, "momentum", 2), (2, "adam", 1), (2, "momentum", 2)]
    branches = _run(tmp_path, 2, test_step_in_backward._rank_parity, cases, {}, timeout=300)
    branches |= _run(tmp_path, 4, test_step_in_backward._rank_hsdp, timeout=300)
    assert EVERY_PACK - {"all_reduce coalesced", "reduce_scatter coalesced in place"} <= branches


LARGE = GPTConfig(vocab_size=CONFIG.vocab_size, seq_len=CONFIG.seq_len, d_model=192, n_heads=4)
"""A block of 443k parameters (1.7 MiB in fp32): over ``POINT_TO_POINT_MIN_BYTES``, and
over the default window, so each block's bucket is gathered and reduced by a call of its
own."""


def _large_model() -> GPT:
    import torch

    torch.manual_seed(0)
    return GPT(LARGE)


def _large(issued: list[Issued]) -> set[str]:
    """The branches of calls on buckets of ``POINT_TO_POINT_MIN_BYTES`` or more."""
    return {
        call.branch()
        for call in issued
        if call.numel * call.dtype.itemsize >= POINT_TO_POINT_MIN_BYTES
    }


def _rank_large_buckets(rank: int, world: int) -> None:
    ref_losses, ref_params = reference_run("sgd", world, 3, make=_large_model)
    for native in (False, True):
        for strategy in range(4):
            module = _large_model()
            opt = make_optimizer("sgd", module.parameters())
            with native_collectives() if native else contextlib.nullcontext():
                with spy_collectives() as issued:
                    model, opt = mf_fsdp.fully_shard(
                        module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
                    )
                    losses = [optimizer_step(model(*batch(s, rank)), opt, world) for s in range(3)]
                params = full_params(model)
            label = f"{'native' if native else 'gloo'} z{strategy}"
            assert_matches_reference(losses, params, ref_losses, ref_params, label, 1e-5, 1e-6)
            if not native:  # gloo's own branch for such buckets: point to point
                sent = {call.kind for call in issued}
                assert ("point_to_point" in sent) is (strategy > 0), (label, sent)
                continue
            large = _large(issued)
            expected = {
                0: {"all_reduce"},
                1: {"reduce_scatter in place", "all_gather"},
                2: {"reduce_scatter", "all_gather"},
                3: {"reduce_scatter", "all_gather"},
            }[strategy]
            assert large == expected, (label, large)


@pytest.mark.multiprocess
def test_buckets_over_the_point_to_point_size_take_the_native_calls() -> None:
    """Native calls at every size: buckets that gloo sends point to point go to the
    backend's own collectives under the switch, and train as one process does."""
    run_on_ranks(_rank_large_buckets, 2, timeout=240)
