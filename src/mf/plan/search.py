"""``mf-plan --search``: the mf-train configurations of a model on N GPUs that fit, best first.

[Note: what the search tries]
The settings mf-train accepts that shape memory or traffic at ``--tp 1``:
``--zero`` 1, 2 and 3; ``--dp-outer``, each divisor of the GPU count; and
``--micro-batch``, the powers of two up to ``--micro-batch`` and that value,
each dividing the per-rank share of ``--global-batch`` when one is given
(``--grad-accum`` makes up the rest). mf-train has no activation checkpointing
option, so the search does not use it. ``--cp`` stays 1: under it the plan's
activations are ordinary attention's over ``seq-len / cp`` tokens, and ring
attention's buffers, which it does not count, measured 9-23% over the plan on
the tiny preset: a configuration returned must run.

A configuration fits when its planned peak, and its backward with the
allowance for the reductions' staging (``mf.plan.wire``), fit the memory.

For each (ZeRO, replicas), only the largest micro-batch that fits is kept: a
larger micro-batch carries more tokens for the same weights' traffic, so it is
never slower by the step-time estimate. The engine is built once per (ZeRO,
replicas), ZeRO-3 first; once something fits, ZeRO 1-2 are not built where the
whole model's compute weights, which they keep, exceed the memory alone. The
activations are run once per micro-batch and reused. Pure planning: nothing is
printed here.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mf.plan.activations import Activations, plan_activations
from mf.plan.devices import GiB
from mf.plan.inputs import PlanInputs
from mf.plan.meta_model import ModelSource, planned_seq_len
from mf.plan.model_state import ModelState, plan_engine
from mf.plan.phases import PhaseBytes, plan_phases
from mf.plan.wire import WirePlan

__all__ = ["Candidate", "NoFitError", "search"]


class NoFitError(ValueError):
    """No configuration fits: the message names the smallest memory that would."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One mf-train configuration and its plan.

    Attributes:
        zero, dp_outer, cp, micro_batch, grad_accum: mf-train's settings.
        seq_len: tokens per sequence (before the ``--cp`` split).
        state, wire: the engine's model state and collectives per micro-batch step.
        activations, phases: one micro-batch's activations and the phases (None: a folder).
    """

    zero: int
    dp_outer: int
    cp: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    state: ModelState
    wire: WirePlan
    activations: Activations | None
    phases: PhaseBytes | None

    @property
    def need(self) -> int:
        """Bytes a rank needs: the peak, or the backward with the staging allowance.

        For a folder, the model state while a unit runs, with the allowance. With
        ``--grad-accum`` above 1 the allowance also holds the whole model's local
        gradients in the compute dtype: mf-train runs the micro-batches before the
        last in ``no_sync``, which keeps them unreduced.
        """
        staging = self.wire.staging + (self.wire.unreduced if self.grad_accum > 1 else 0)
        if self.phases is None:
            return self.state.held + self.state.gathered_unit + staging
        return max(self.phases.peak, self.phases.backward + staging)

    def settings(self) -> str:
        """The settings as mf-train's flags."""
        return (
            f"--zero {self.zero} --dp-outer {self.dp_outer} --cp {self.cp} "
            f"--micro-batch {self.micro_batch} --grad-accum {self.grad_accum} "
            f"--seq-len {self.seq_len}"
        )

    def command(self, inputs: PlanInputs) -> str:
        """The command line of this configuration.

        ``mf-train`` on one node; on several, torchrun's launch of mf-train's worker,
        run on each node (``--nproc`` is then the world size).
        """
        launch = "mf-train"
        if inputs.gpus > inputs.gpus_per_node:
            launch = (
                f"torchrun --nnodes {inputs.gpus // inputs.gpus_per_node} --nproc-per-node "
                f"{inputs.gpus_per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                "-m mf.train.rank.worker"
            )
        return (
            f"{launch} --model {shlex.quote(inputs.model)} --nproc {inputs.gpus} "
            f"{self.settings()} --precision {inputs.precision}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(inputs: PlanInputs, dp: int) -> list[int]:
    """The micro-batches to try, largest first (each dividing a rank's share of the batch)."""
    sizes = {inputs.micro_batch} | {1 << k for k in range(inputs.micro_batch.bit_length())}
    sizes = {m for m in sizes if m <= inputs.micro_batch}
    if inputs.global_batch is not None:
        if inputs.global_batch % dp:
            return []
        sizes = {m for m in sizes if (inputs.global_batch // dp) % m == 0}
    return sorted(sizes, reverse=True)


def _shapes(inputs: PlanInputs) -> Iterator[tuple[int, int]]:
    """(zero, dp_outer) of every strategy and mesh the search tries, ZeRO-3 first."""
    for zero in (3, 2, 1):
        for dp_outer in _divisors(inputs.gpus):
            yield zero, dp_outer


def search(
    inputs: PlanInputs,
    source: ModelSource,
    rank_key: Callable[[Candidate], float],
) -> list[Candidate]:
    """The configurations that fit ``inputs.device``, best first by ``rank_key`` (lowest first).

    Raises:
        NoFitError: none fits; the message names the smallest memory that would, and where.
    """
    seq_len = planned_seq_len(source, inputs.seq_len)
    whole = source.parameters * (4 if inputs.precision == "fp32" else 2)  # compute weights
    activations: dict[int, Activations] = {}
    fitting: list[Candidate] = []
    smallest: Candidate | None = None
    dp = inputs.gpus  # --cp 1, --tp 1
    for zero, dp_outer in _shapes(inputs):
        if zero < 3 and fitting and whole > inputs.device.memory_bytes:
            continue  # ZeRO 1-2 keep the whole weights: it cannot fit, nor change the answer
        state, wire = plan_engine(
            source, inputs.gpus, zero=zero, precision=inputs.precision, dp_outer=dp_outer
        )
        for micro_batch in _micro_batches(inputs, dp):
            acts = None
            if source.folder is None:
                if micro_batch not in activations:
                    activations[micro_batch] = plan_activations(
                        source,
                        micro_batch=micro_batch,
                        seq_len=seq_len,
                        precision=inputs.precision,
                        checkpointing=False,
                    )
                acts = activations[micro_batch]
            total = inputs.global_batch or micro_batch * dp
            candidate = Candidate(
                zero,
                dp_outer,
                1,
                micro_batch,
                total // (micro_batch * dp),
                seq_len,
                state,
                wire,
                acts,
                None if acts is None else plan_phases(state, acts),
            )
            if smallest is None or candidate.need < smallest.need:
                smallest = candidate
            if candidate.need <= inputs.device.memory_bytes:
                fitting.append(candidate)
                break  # the largest micro-batch that fits (see the Note)
    if not fitting:
        if smallest is None:
            raise NoFitError(
                f"--global-batch {inputs.global_batch}: no micro-batch of at most "
                f"--micro-batch {inputs.micro_batch} divides any data-parallel rank's share "
                f"on {inputs.gpus} GPUs"
            )
        raise NoFitError(
            f"--search: no configuration of {source.name!r} on {inputs.gpus} GPUs fits "
            f"{inputs.device.memory_bytes / GiB:.3f} GiB; the smallest needs "
            f"{_gib_up(smallest.need)} GiB per GPU ({smallest.settings()})"
        )
    return sorted(fitting, key=rank_key)


def _gib_up(nbytes: int) -> str:
    """``nbytes`` in GiB, rounded up to three decimals (a memory that does fit)."""
    return f"{-(-nbytes * 1000 // GiB) / 1000:.3f}"
