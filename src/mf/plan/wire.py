"""Bytes on the wire per step per rank, read from the engine's buckets, against the ring minimum.

[Note: the collectives of a step]
mf-fsdp issues one collective per bucket for each of these (it may pack small
ones into one call: the bytes are the same), every step, from the buckets the
planner built (``mf.plan.model_state``):

- ZeRO-3, forward: an all-gather of every bucket (compute dtype, padded) over
  the dp_shard x cp group.
- ZeRO-3, backward: an all-gather of every unit's buckets again, except the
  units the forward leaves gathered for the backward: the last units of the
  forward that fit in the engine's communication window
  (``suggested_communication_unit_size`` elements, at least one unit; the
  engine's own ``CommWindow.kept_for_backward``). The root's buckets stay
  gathered through the backward. The first step of a run has no recorded order
  yet and gathers the kept units again; a plan is of the steps after it.
- ZeRO 1-3, backward: a reduce-scatter of every trained bucket's gradients in
  the communication dtype (fp32 under ``--precision bf16``), padded; ZeRO-0:
  an all-reduce instead.
- HSDP (``--dp-outer`` > 1), at the optimizer step: an all-reduce of each
  rank's reduced gradient shard over the replicas.
- ZeRO 1-2, step: after the optimizer step, an all-gather of every bucket's
  stepped weights (compute dtype, padded).

A collective's *payload* is the bucket it works on (an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor), padding included. What one
rank *sends* is a ring's share of it: ``(n - 1) / n`` of the payload for an
all-gather or reduce-scatter over ``n`` ranks, ``2 (n - 1) / n`` for an
all-reduce (the least any algorithm sends for these, per rank). The *minimum*
is the same bound on the unpadded bytes, so the gap is the engine's padding.
On gloo mf runs some of these point to point or packs small reductions as an
all-reduce (``mf_fsdp.buckets.transfers``, ``coalescing``); the payloads are
the same, and NCCL, a GPU run's backend, runs them natively.
mf-train adds two 4-byte all-reduces per step (the token count and the loss),
which are not counted. ``tests/plan/test_wire.py`` counts the engine's calls on
real gloo ranks (ZeRO 1 and 3, and HSDP) and holds this plan to them exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from mf_fsdp import MegatronFSDP
from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.engine.comm_window import CommWindow

__all__ = ["Collective", "WirePlan", "plan_wire"]

_RING = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
"""Payloads a ring sends per rank, times ``(n - 1) / n``."""


@dataclass(frozen=True, slots=True)
class Collective:
    """The collectives of one kind, phase, group and dtype in one step of one rank.

    Attributes:
        what: what moves ("weights", "gradients", "gradients across replicas").
        phase: "forward", "backward" or "step".
        op: "all_gather", "reduce_scatter" or "all_reduce".
        ranks: the group's size.
        dtype: the dtype that travels.
        calls: collectives issued (one per bucket, before any packing).
        payload: bytes of the buckets they work on, padding included.
        unpadded: the same without padding.
    """

    what: str
    phase: str
    op: str
    ranks: int
    dtype: str
    calls: int
    payload: int
    unpadded: int

    def _ring(self, nbytes: int) -> int:
        return _RING[self.op] * nbytes * (self.ranks - 1) // self.ranks

    @property
    def sent(self) -> int:
        """Bytes this rank sends for them (a ring's share of the payload)."""
        return self._ring(self.payload)

    @property
    def minimum(self) -> int:
        """The same share of the unpadded bytes: the least any algorithm sends."""
        return self._ring(self.unpadded)

    def as_dict(self) -> dict[str, int | str]:
        """The fields, ``sent`` and ``minimum``, for JSON."""
        return {**asdict(self), "sent": self.sent, "minimum": self.minimum}


@dataclass(frozen=True, slots=True)
class WirePlan:
    """Every collective of one step of one rank (see [Note: the collectives of a step]).

    Attributes:
        collectives: one row per kind, phase, group and dtype.
        staging: an allowance, not a plan, for the buffers the gradient reductions in
            flight may hold beyond the model state (see [Note: the reductions' staging]).
        unreduced: the whole model's gradients in the compute dtype, padded: what
            ``no_sync`` may hold unreduced between micro-batches.
    """

    collectives: tuple[Collective, ...]
    staging: int = 0
    unreduced: int = 0

    @property
    def sent(self) -> int:
        """Bytes this rank sends per step."""
        return sum(c.sent for c in self.collectives)

    @property
    def minimum(self) -> int:
        """The least it could send for the same collectives (no padding)."""
        return sum(c.minimum for c in self.collectives)

    def sent_per_step(self, grad_accum: int) -> int:
        """Bytes sent per optimizer step of ``grad_accum`` micro-batches.

        The gathers of the forward and backward come with every micro-batch; the
        rest once a step (mf-train runs the micro-batches before the last in ``no_sync``).
        """
        return sum(
            c.sent
            * (grad_accum if c.phase in ("forward", "backward") and c.what == "weights" else 1)
            for c in self.collectives
        )

    def as_dict(self) -> dict[str, object]:
        """The collectives and the totals, for JSON."""
        return {
            "collectives": [c.as_dict() for c in self.collectives],
            "sent": self.sent,
            "minimum": self.minimum,
            "staging_allowance": self.staging,
        }


_ACROSS = "gradients across replicas"


def plan_wire(model: MegatronFSDP, zero: int) -> WirePlan:
    """The collectives one step after the first issues on this rank of ``model``'s engine.

    ``model`` is the engine as mf-train's sharding call built it (on the meta
    device, in a fake world, or real); ``zero`` its ``--zero``. Reads the
    engine's buckets and units; the units are the engine's own list (private,
    and held to the truth by the exact test on real ranks).
    """
    units = list(model._units)  # forward order
    kept: set[int] = set()
    if zero == 3 and model.ddp_config.overlap_param_gather:
        window = model.ddp_config.suggested_communication_unit_size
        kept = {id(u) for u in CommWindow.window_of(units, len(units) - 1, -1, window)}
    regathered = {id(g) for u in units if id(u) not in kept for g in u.groups}
    rows: dict[tuple[str, str, str, int, str], list[int]] = {}
    for key, payload, unpadded in _calls(model, zero, regathered):
        row = rows.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += payload
        row[2] += unpadded
    order = {"forward": 0, "backward": 1, "step": 2}
    ranked = sorted(rows.items(), key=lambda item: order[item[0][1]])
    trained = [g for g in model.groups if g.requires_grad]
    unreduced = sum(g.layout.padded_numel * g.dtypes.compute.itemsize for g in trained)
    return WirePlan(
        tuple(Collective(*key, *row) for key, row in ranked), _staging(trained, model), unreduced
    )


def _staging(trained: list[Bucket], model: MegatronFSDP) -> int:
    """[Note: the reductions' staging] An allowance for the reductions' buffers in a backward.

    The plan's phases do not count the engine's pooled reduction buffers yet
    (docs/planning.md). Until they do, ``mf-plan --search`` keeps a configuration
    only if it also fits this allowance: the elements of the reductions that may be
    in flight at once, a queued communication window and a launched one (each at
    least the largest unit), at most the whole model, times the bytes of one
    element in the compute dtype (the local gradients) and twice in the
    communication dtype (the copy reduced and its result). On two gloo ranks the
    tiny preset's backward holds exactly this (1,207,040 bytes) at micro-batch 1.
    """
    if not trained:
        return 0
    total = sum(g.layout.padded_numel for g in trained)
    largest = max((u.numel for u in model._units), default=0)
    window = model.ddp_config.suggested_communication_unit_size
    per_element = max(g.dtypes.compute.itemsize + 2 * g.dtypes.comm.itemsize for g in trained)
    return min(total, 2 * max(window, largest)) * per_element


def _calls(
    model: MegatronFSDP, zero: int, regathered: set[int]
) -> Iterator[tuple[tuple[str, str, str, int, str], int, int]]:
    """``((what, phase, op, ranks, dtype), payload, unpadded)`` for each call, bucket by bucket."""
    outer = model.dist_index.outer_size
    for g in model.groups:
        n = g.layout.world_size
        compute = g.dtypes.compute
        size, real = g.layout.padded_numel, g.layout.numel
        if n > 1 and zero == 3:
            yield _call("weights", "forward", "all_gather", n, compute, size, real)
            if id(g) in regathered:
                yield _call("weights", "backward", "all_gather", n, compute, size, real)
        if g.requires_grad and n > 1:
            op = "all_reduce" if zero == 0 else "reduce_scatter"
            yield _call("gradients", "backward", op, n, g.dtypes.comm, size, real)
        if g.requires_grad and outer > 1:
            store = g.layout.shard_size if zero else size
            dtype = g.buffers.store_dtype if g.buffers is not None else g.dtypes.grads
            yield _call(_ACROSS, "step", "all_reduce", outer, dtype, store, real * store // size)
        if n > 1 and zero in (1, 2):
            yield _call("weights", "step", "all_gather", n, compute, size, real)


def _call(
    what: str, phase: str, op: str, ranks: int, dtype: torch.dtype, numel: int, real: int
) -> tuple[tuple[str, str, str, int, str], int, int]:
    size = dtype.itemsize
    return (what, phase, op, ranks, str(dtype).removeprefix("torch.")), numel * size, real * size
