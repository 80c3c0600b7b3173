"""Bytes one rank holds at each phase of a training step: model state, gathered window, activations.

[Note: the phases of a step]
Each phase adds to the model state (``mf.plan.model_state``, exact) what is
alive at its peak:

- after the wrap: the kept weights, the main weights and the optimizer state
  (mf-fsdp makes the optimizer's state as it wraps, its [Note: eager optimizer
  state]); no gradient yet.
- forward peak: that, the forward's activations at their peak (at the loss,
  ``mf.plan.activations``) and, under ZeRO-3, the gathered window of the
  forward: the weights of no unit (gathered for the whole step) and the unit
  that runs, in the compute dtype.
- backward peak: that, with the backward's peak of activations and temporaries
  instead of the forward's, the window of the backward (one more unit: the one
  prefetched while a unit runs), and the gradients. The gradients are counted
  whole from the start of the backward. Under ZeRO 0-2 the engine makes its
  gradient buffers whole at the start of the backward, so this is what it
  holds; under ZeRO-3 the reduced shards fill in unit by unit while the
  activations drain, so the figure is an upper bound, high by at most the
  gradients at the step.
- optimizer step: the model state held through the step and the backward's
  window, which the engine keeps in its pool for the next step's gathers. The
  optimizer's own temporaries are not counted.

The peak is the largest of the four; ``tests/plan/test_peaks.py`` holds it
within 10% of what MemTracker measures on real gloo ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mf.plan.activations import Activations
from mf.plan.model_state import ModelState

__all__ = ["PhaseBytes", "plan_phases"]


@dataclass(frozen=True, slots=True)
class PhaseBytes:
    """Bytes one rank holds at each phase of a step (see [Note: the phases of a step]).

    Attributes:
        after_wrap: model state before the first step.
        forward: at the forward's peak.
        backward: at the backward's peak (an upper bound under ZeRO-3).
        step: during the optimizer step.
    """

    after_wrap: int
    forward: int
    backward: int
    step: int

    @property
    def peak(self) -> int:
        """The most bytes at any phase."""
        return max(self.after_wrap, self.forward, self.backward, self.step)

    def as_dict(self) -> dict[str, int]:
        """The phases and ``peak``, for JSON."""
        return {**asdict(self), "peak": self.peak}


def plan_phases(state: ModelState, activations: Activations) -> PhaseBytes:
    """A rank's bytes per phase, from its model state and one micro-batch's activations."""
    wrapped = state.params + state.main_params + state.optimizer_state
    forward_window = state.gathered_root + state.gathered_unit
    backward_window = forward_window + state.gathered_next
    return PhaseBytes(
        after_wrap=wrapped,
        forward=wrapped + forward_window + activations.forward_peak,
        backward=wrapped + state.grads + backward_window + activations.backward_peak,
        step=state.held + backward_window,
    )
