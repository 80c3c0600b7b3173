"""An estimate of one optimizer step's time from the device's figures and the engine's collectives.

[Note: the step-time estimate]
An estimate, labelled as one wherever it is printed: no kernel is timed.

- Compute: ``6 x parameters x tokens`` (forward and backward of every weight)
  plus attention's ``12 x layers x width x seq_len x tokens`` (the scores and
  the weighted sum, forward and backward, causal masking not discounted), per
  rank, at ``MFU`` of the device's peak FLOP/s. A third of it is the forward.
- Communication: each collective of the plan (``mf.plan.wire``) at a ring's
  bytes sent per rank over the link its group uses: NVLink when all its ranks
  are on one node, else the network (a ring runs at its slowest link). The
  ranks are laid out as mf-train's mesh lays them: a replica's dp x cp ranks
  are consecutive, so they share a node when ``--gpus / --dp-outer`` is at
  most ``--gpus-per-node``; the replicas of a shard span nodes when ``--gpus``
  exceeds it.
- Overlap, as the engine runs them: a micro-batch's forward gathers (ZeRO-3,
  prefetched) run under its forward compute, and its backward gathers and
  gradient reductions under its backward compute, so each phase takes the
  longer of the two. The reductions run in the last micro-batch only (mf-train
  runs the others in ``no_sync``); the gathers in every one. What comes after
  the backward is exposed: the replicas' all-reduce and ZeRO 1-2's gather of
  the stepped weights. The optimizer's own arithmetic, latencies, the first
  gather that nothing hides, and the host's time are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mf.models import PRESETS
from mf.plan.devices import Device
from mf.plan.meta_model import ModelSource
from mf.plan.wire import WirePlan

__all__ = ["MFU", "StepTime", "estimate_step_time", "model_width"]

MFU = 0.4
"""The share of the device's peak FLOP/s the estimate assumes the compute reaches."""


@dataclass(frozen=True, slots=True)
class StepTime:
    """An estimate of one optimizer step (see [Note: the step-time estimate]).

    Attributes:
        compute_s: the step's compute at ``MFU``.
        communication_s: the step's collectives at their links' bandwidth, if none overlapped.
        step_s: the step, with the engine's overlap.
        tokens_per_s: tokens the whole run trains per second.
    """

    compute_s: float
    communication_s: float
    step_s: float
    tokens_per_s: float

    def as_dict(self) -> dict[str, float | bool]:
        """The fields and ``mfu``, marked as an estimate, for JSON."""
        return {"estimate": True, "mfu": MFU, **asdict(self)}


def model_width(source: ModelSource) -> int:
    """The model's hidden size (attention's FLOPs grow with it)."""
    return source.folder.width if source.folder is not None else PRESETS[source.name].d_model


def estimate_step_time(
    source: ModelSource,
    wire: WirePlan,
    device: Device,
    *,
    gpus: int,
    gpus_per_node: int,
    dp_outer: int,
    cp: int,
    micro_batch: int,
    seq_len: int,
    grad_accum: int = 1,
) -> StepTime | None:
    """The estimated step of one rank; None when the device's FLOP/s or links are not known."""
    if device.peak_tflops is None or device.nvlink_gbps is None or device.network_gbps is None:
        return None
    tokens = micro_batch * seq_len // cp  # per rank per micro-batch
    attention = 12 * source.layers * model_width(source) * seq_len
    flops = (6 * source.parameters + attention) * tokens
    compute = flops / (device.peak_tflops * 1e12 * MFU)
    forward, backward = compute / 3, 2 * compute / 3
    inner_gbps = device.nvlink_gbps if gpus // dp_outer <= gpus_per_node else device.network_gbps
    outer_gbps = device.nvlink_gbps if gpus <= gpus_per_node else device.network_gbps
    seconds = {"forward": 0.0, "backward": 0.0, "reduce": 0.0, "step": 0.0}
    for c in wire.collectives:
        gbps = outer_gbps if c.what == "gradients across replicas" else inner_gbps
        phase = "reduce" if c.what == "gradients" else c.phase
        seconds[phase] += c.sent / (gbps * 1e9)
    last = max(backward, seconds["backward"] + seconds["reduce"])
    step = (
        grad_accum * max(forward, seconds["forward"])
        + (grad_accum - 1) * max(backward, seconds["backward"])
        + last
        + seconds["step"]
    )
    communication = grad_accum * (seconds["forward"] + seconds["backward"])
    communication += seconds["reduce"] + seconds["step"]
    global_tokens = tokens * grad_accum * gpus
    return StepTime(grad_accum * compute, communication, step, global_tokens / step)
