"""mf-plan's collectives per step against the ones the engine issues on two real gloo ranks.

The plan (``mf.plan.wire``) reads the engine built on the meta device in a fake
world. Here the tiny preset is wrapped by mf-train's own sharding call on two
gloo ranks (and on four, two HSDP replicas) and trains three steps while the
engine's collective entry points (``mf_fsdp.buckets.collectives``, looked up
there by every caller) are wrapped to record each call's kind, group size,
dtype and payload, tagged with the phase it came in. From the second step on,
every phase's calls and bytes must equal the plan exactly (the first step
gathers more: no order is recorded yet).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from mf.models import GPT, PRESETS, Block
from mf.plan.meta_model import model_source
from mf.plan.model_state import plan_engine
from mf.train.rank.setup import shard_module, train_mesh
from tests._multiprocess import run_on_ranks

_CASES = {  # world: [(zero, precision, dp_outer)]
    2: [(1, "bf16", 1), (3, "bf16", 1), (3, "fp32", 1)],
    4: [(3, "bf16", 2)],  # HSDP: two replicas of two shards, the replicas' all-reduce
}
_STEPS = 3

Key = tuple[str, str, int, str]  # phase, op, ranks, dtype


@contextlib.contextmanager
def _recording(phase: list[str]) -> Iterator[Counter[tuple[Key, str]]]:
    """Count the engine's collectives by (phase, op, ranks, dtype): calls and payload bytes."""
    from mf_fsdp.buckets import collectives

    counts: Counter[tuple[Key, str]] = Counter()
    # name: (op, index of the tensor whose bytes are the payload, index of the group)
    entries = {
        "all_gather_into": ("all_gather", 0, 2),
        "reduce_scatter_into": ("reduce_scatter", 1, 3),
        "all_reduce": ("all_reduce", 0, 2),
    }
    originals = {name: getattr(collectives, name) for name in entries}

    def wrapped(name: str):
        op, tensor_at, group_at = entries[name]

        def call(*args, **kwargs):
            tensor, group = args[tensor_at], args[group_at]
            dtype = str(tensor.dtype).removeprefix("torch.")
            key = (phase[0], op, dist.get_world_size(group), dtype)
            counts[key, "calls"] += 1
            counts[key, "payload"] += tensor.numel() * tensor.element_size()
            return originals[name](*args, **kwargs)

        return call

    for name in entries:
        setattr(collectives, name, wrapped(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)


def _rank_measure(rank: int, world: int, planned: list[list[dict]]) -> None:
    wrong = []
    for (zero, precision, dp_outer), per_rank in zip(_CASES[world], planned, strict=True):
        mesh = train_mesh("cpu", world, tp=1, cp=1, dp_outer=dp_outer)
        torch.manual_seed(0)
        module = GPT(PRESETS["tiny"])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, (optimizer,) = shard_module(
            module, [optimizer], mesh, [Block], zero=zero, precision=precision
        )
        phase = ["forward"]
        for step in range(_STEPS):
            with _recording(phase) as counts:
                tokens = torch.randint(0, 256, (2, 17))
                phase[0] = "forward"
                loss = model(tokens[:, :-1], tokens[:, 1:])
                phase[0] = "backward"
                loss.backward()
                phase[0] = "step"
                optimizer.step()
                optimizer.zero_grad()
            if step and dict(counts) != per_rank[rank]:
                case = f"ZeRO {zero} {precision} dp_outer {dp_outer}"
                wrong.append(f"{case} step {step}: issued {dict(counts)}")
    assert not wrong, "\n".join(wrong) + f"\nplanned: {planned}"


def _planned(world: int, rank: int, zero: int, precision: str, dp_outer: int) -> dict:
    source = model_source("tiny")
    _, wire = plan_engine(
        source, world, zero=zero, precision=precision, dp_outer=dp_outer, rank=rank
    )
    counts: Counter = Counter()
    for c in wire.collectives:
        key = (c.phase, c.op, c.ranks, c.dtype)
        counts[key, "calls"] += c.calls
        counts[key, "payload"] += c.payload
    return dict(counts)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", sorted(_CASES))
def test_planned_collectives_are_what_the_engine_issues(world: int) -> None:
    planned = [[_planned(world, r, *case) for r in range(world)] for case in _CASES[world]]
    run_on_ranks(_rank_measure, world, planned, timeout=120)


def test_zero3_regathers_in_the_backward_all_but_the_window_it_keeps() -> None:
    """At scale the window keeps the last unit only: the backward regathers the others."""
    _, wire = plan_engine(model_source("150m"), 8, zero=3, precision="bf16")
    by_phase = {(c.phase, c.op): c for c in wire.collectives}
    forward, backward = by_phase["forward", "all_gather"], by_phase["backward", "all_gather"]
    layers = model_source("150m").layers
    assert forward.calls == backward.calls + 1 + 1  # the root's bucket, and the kept unit
    assert backward.calls == layers - 1
    gradients = by_phase["backward", "reduce_scatter"]
    assert gradients.dtype == "float32"
    assert gradients.calls == forward.calls
    assert gradients.sent == gradients.payload * 7 // 8
    assert wire.minimum <= wire.sent
    # Each micro-batch gathers again; the gradients are reduced once a step.
    assert wire.sent_per_step(2) == wire.sent + forward.sent + backward.sent
