"""Model-state bytes per rank, read from mf's engine built for real at world N on meta tensors.

[Note: the engine sizes itself]
The planner does not model the engine's layout: it builds it. The planned model
is made on the meta device, the fake process group plays rank ``r`` of ``N``, and
mf-train's own sharding call (``shard_module``) wraps the model with its buffers
on the meta device. Every bucket, its padding, each rank's shard and the
gathered units are then the engine's, and a meta tensor has a size but no bytes,
so a 70B model at 1024 ranks costs only its bookkeeping. What is read:

- ``params`` / ``main_params``: the engine's ``memory_footprint()`` after the wrap
  (compute-dtype weights kept between steps, and fp32 main weights where they
  are separate).
- ``grads``: what the engine holds at the optimizer step. Every bucket is made
  to hold its reduced gradients, as after a backward (on meta: sizes only), the
  footprint is read, and the buckets are released again.
- ``optimizer_state``: the optimizer's rule (``OPTIMIZER_STATES``) applied to the
  shards the engine gives the optimizer: the local rows of every sharded
  parameter. This is the one number not read from a built object, so the tests
  check it against a real optimizer's state on real ranks.
- ``gathered_unit``: ZeRO-3's gather of the largest unit (its buckets whole, in
  the compute dtype): the least a rank adds to its state while a unit runs;
  ``gathered_next``, the second largest (the unit the backward prefetches while
  one runs), and ``gathered_root``, the buckets of no unit (embeddings, final
  norm, head), gathered from the first forward to the end of the backward.

What is not here: activations, the prefetch window's depth, temporaries of the
collectives and the allocator's slack (docs/planning.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mf.plan.fake_world import fake_world
from mf.plan.meta_model import ModelSource, meta_model
from mf.plan.wire import WirePlan, plan_wire
from mf.train.rank.setup import shard_module, train_mesh
from mf_fsdp import MegatronFSDP

__all__ = ["OPTIMIZER_STATES", "ModelState", "OptimizerRule", "plan_engine", "plan_model_state"]


@dataclass(frozen=True, slots=True)
class OptimizerRule:
    """What an optimizer keeps per parameter it steps.

    Attributes:
        states_per_element: state tensors shaped like the parameter (in its dtype).
        scalar_bytes: bytes of per-parameter scalars (Adam's ``step``: one fp32).
    """

    states_per_element: int
    scalar_bytes: int


OPTIMIZER_STATES: dict[str, OptimizerRule] = {
    "adamw": OptimizerRule(states_per_element=2, scalar_bytes=4),  # exp_avg, exp_avg_sq; step
    "sgd": OptimizerRule(states_per_element=1, scalar_bytes=0),  # momentum_buffer
}
"""The optimizers a plan knows: mf-train's AdamW, and SGD with momentum."""


@dataclass(frozen=True, slots=True)
class ModelState:
    """Bytes one rank holds of the model state (see [Note: the engine sizes itself]).

    Attributes:
        rank: the rank planned (among ``world``).
        world: the ranks of the job.
        params: compute-dtype weights kept between steps.
        main_params: fp32 main weights held apart from them.
        grads: gradients held at the optimizer step.
        optimizer_state: the optimizer's state of this rank's shards.
        gathered_unit: ZeRO-3: the largest unit's gathered weights (0 otherwise).
        gathered_next: ZeRO-3: the second largest unit's gathered weights (0 otherwise).
        gathered_root: ZeRO-3: the gathered weights of no unit (0 otherwise).
        buckets: the engine's buckets.
        padding_fraction: the share of the buckets that is padding.
    """

    rank: int
    world: int
    params: int
    main_params: int
    grads: int
    optimizer_state: int
    gathered_unit: int
    gathered_next: int
    gathered_root: int
    buckets: int
    padding_fraction: float

    @property
    def held(self) -> int:
        """Bytes held through a step (weights, main weights, gradients, optimizer state)."""
        return self.params + self.main_params + self.grads + self.optimizer_state

    def as_dict(self) -> dict[str, int | float]:
        """The fields and ``held``, for JSON."""
        return {**asdict(self), "held": self.held}


def plan_model_state(
    source: ModelSource,
    world: int,
    *,
    zero: int,
    precision: str,
    cp: int = 1,
    dp_outer: int = 1,
    optimizer: str = "adamw",
    rank: int = 0,
) -> ModelState:
    """Rank ``rank``'s model-state bytes in a run of ``world`` ranks with these settings.

    The settings are mf-train's ``--zero``, ``--precision``, ``--cp`` and ``--dp-outer``
    (``--tp 1``); the caller has checked them (``mf.plan.inputs``).

    Raises:
        ValueError: ``optimizer`` is not one of ``OPTIMIZER_STATES``.
    """
    state, _ = plan_engine(
        source,
        world,
        zero=zero,
        precision=precision,
        cp=cp,
        dp_outer=dp_outer,
        optimizer=optimizer,
        rank=rank,
    )
    return state


def plan_engine(
    source: ModelSource,
    world: int,
    *,
    zero: int,
    precision: str,
    cp: int = 1,
    dp_outer: int = 1,
    optimizer: str = "adamw",
    rank: int = 0,
) -> tuple[ModelState, WirePlan]:
    """``plan_model_state``'s bytes and the step's collectives (``mf.plan.wire``), one build."""
    rule = OPTIMIZER_STATES.get(optimizer)
    if rule is None:
        raise ValueError(
            f"optimizer: expected one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
        )
    with fake_world(world, rank):
        mesh = train_mesh("cpu", world, tp=1, cp=cp, dp_outer=dp_outer)
        module, units = meta_model(source)
        model, _ = shard_module(
            module, [], mesh, units, zero=zero, precision=precision, device=torch.device("meta")
        )
        return _read_state(model, rule, zero, rank, world), plan_wire(model, zero)


def _read_state(
    model: MegatronFSDP, rule: OptimizerRule, zero: int, rank: int, world: int
) -> ModelState:
    """The model state of the built engine ``model`` (see [Note: the engine sizes itself])."""
    kept = model.memory_footprint()
    grads = _grads_at_step(model)
    stats = model.bucket_stats()
    gathered: dict[str, int] = defaultdict(int)
    for s in stats:
        gathered[s.unit_name] += s.padded_numel * s.dtype.itemsize
    root = gathered.pop("", 0)
    largest = [*sorted(gathered.values(), reverse=True), 0, 0] if zero == 3 else [0, 0]
    numel = sum(s.numel for s in stats)
    padded = sum(s.padded_numel for s in stats)
    return ModelState(
        rank=rank,
        world=world,
        params=kept["params"],
        main_params=kept["main_params"],
        grads=grads,
        optimizer_state=_optimizer_state(model.parameters(), rule),
        gathered_unit=largest[0],
        gathered_next=largest[1],
        gathered_root=root if zero == 3 else 0,
        buckets=len(stats),
        padding_fraction=1 - numel / padded if padded else 0.0,
    )


def _grads_at_step(model: MegatronFSDP) -> int:
    """The gradient bytes the engine holds once a backward has reduced every bucket.

    Each bucket's store is held (on meta: a size, no bytes), read, and released
    as ``zero_grad(set_to_none=True)`` releases it. The buckets' buffers are the
    engine's own objects, not its public API: the exact check against real ranks
    (``tests/plan/test_model_state.py``) is what keeps this reading true.
    """
    buffers = [b.buffers for b in model.groups if b.buffers is not None]  # None: frozen
    for buffer in buffers:
        buffer.store(zeroed=False)
    held = model.memory_footprint()["grads"]
    for buffer in buffers:
        buffer.zero_store(release=True)
    return held


def _optimizer_state(params: Iterable[nn.Parameter], rule: OptimizerRule) -> int:
    """``rule`` applied to the rows of each trained parameter this rank steps."""
    total = 0
    for p in params:
        if not p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        total += rule.states_per_element * local.numel() * local.element_size()
        total += rule.scalar_bytes
    return total
