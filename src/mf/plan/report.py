"""A plan as people read it (a table) and as tools read it (JSON).

Every figure a plan assumed is printed with it (the device's memory, FLOP/s and
links, the mesh, the dtypes), and what is not predicted yet is said in the
output itself, so a reader never takes a partial answer for a whole one. Pure
formatting: nothing here builds or measures.
"""

from __future__ import annotations

import json
from typing import Any

from mf.plan.activations import Activations
from mf.plan.devices import Device, GiB
from mf.plan.inputs import PlanInputs
from mf.plan.meta_model import ModelSource
from mf.plan.model_state import ModelState
from mf.plan.phases import PhaseBytes
from mf.plan.step_time import MFU, StepTime
from mf.plan.wire import WirePlan

__all__ = ["NOT_PREDICTED", "plan_json", "plan_table"]

NOT_PREDICTED = (
    "the engine's pooled reduction buffers and the optimizer's temporaries",
    "the allocator's slack",
    "ring attention's exchanges under --cp",
)
"""What a plan leaves out today (docs/planning.md)."""

FOLDER_ACTIVATIONS = "activations of a folder's model (presets only so far)"
"""Left out, too, for a folder: its peaks are not planned, only its model state."""


def _device_line(device: Device) -> str:
    stated = [f"{device.memory_bytes / GiB:.1f} GiB"]
    if device.peak_tflops is not None:
        stated.append(f"{device.peak_tflops:g} TFLOP/s bf16")
    if device.nvlink_gbps is not None:
        stated.append(f"NVLink {device.nvlink_gbps:g} GB/s")
    if device.network_gbps is not None:
        stated.append(f"network {device.network_gbps:g} GB/s")
    return f"{device.name} ({', '.join(stated)})"


def _need(state: ModelState, phases: PhaseBytes | None) -> int:
    """The bytes a plan says a rank needs: the peak, or without one the model state in use."""
    return state.held + state.gathered_unit if phases is None else phases.peak


def _not_predicted(phases: PhaseBytes | None) -> list[str]:
    return [*([] if phases is not None else [FOLDER_ACTIVATIONS]), *NOT_PREDICTED]


def _row(name: str, value: int) -> str:
    return f"  {name:<26}{value:>15,d} {value / GiB:>10.3f}"


def _phase_lines(activations: Activations, phases: PhaseBytes) -> list[str]:
    recompute = ", activation checkpointing" if activations.checkpointing else ""
    rows = [
        ("after the wrap", phases.after_wrap),
        ("forward peak", phases.forward),
        ("backward peak", phases.backward),
        ("optimizer step", phases.step),
    ]
    return [
        "",
        f"{'per phase':<28}{'bytes':>15} {'GiB':>10}   (micro-batch {activations.micro_batch} "
        f"x {activations.seq_len} tokens{recompute})",
        _row("activations, forward", activations.forward_peak),
        _row("activations, backward", activations.backward_peak),
        *(_row(name, value) for name, value in rows),
    ]


def _wire_lines(wire: WirePlan) -> list[str]:
    lines = [
        "",
        f"{'on the wire per step (rank)':<38}{'calls':>6} {'ranks':>5} {'dtype':>8} {'sent':>15} "
        f"{'minimum':>15}",
    ]
    for c in wire.collectives:
        name = f"{c.phase}: {c.what}"
        lines.append(
            f"  {name:<36}{c.calls:>6} {c.ranks:>5} {c.dtype:>8} {c.sent:>15,d} {c.minimum:>15,d}"
            f"   {c.op.replace('_', '-')}"
        )
    lines.append(f"  {'sent by this rank':<36}{'':>21} {wire.sent:>15,d} {wire.minimum:>15,d}")
    return lines


def _step_lines(step: StepTime | None) -> list[str]:
    if step is None:
        return ["", "step time: no estimate (the device's FLOP/s and links are not known)"]
    return [
        "",
        f"step time, an ESTIMATE (MFU {MFU:g} of peak, ring collectives at the links' "
        "bandwidth, overlapped as the engine runs them)",
        f"  compute {step.compute_s * 1e3:,.1f} ms, communication {step.communication_s * 1e3:,.1f}"
        f" ms, step {step.step_s * 1e3:,.1f} ms: {step.tokens_per_s:,.0f} tokens/s",
    ]


def plan_table(
    inputs: PlanInputs,
    source: ModelSource,
    state: ModelState,
    activations: Activations | None = None,
    phases: PhaseBytes | None = None,
    wire: WirePlan | None = None,
    step: StepTime | None = None,
) -> str:
    """The plan as a table: settings, bytes per rank by kind and by phase, and whether they fit."""
    compute = "fp32" if inputs.precision == "fp32" else "bf16"
    lines = [
        f"mf-plan: {source.name!r} ({source.parameters / 1e6:,.1f}M parameters, "
        f"{source.layers} layers) on {inputs.gpus} GPUs, {_device_line(inputs.device)}",
        f"mesh: dp_outer {inputs.dp_outer} x dp {inputs.dp_shard} x cp {inputs.cp} x tp "
        f"{inputs.tp}; ZeRO {inputs.zero}; {compute} compute, fp32 main weights; AdamW",
        f"engine: built at world {state.world} on a fake process group, meta tensors: "
        f"{state.buckets} buckets, {100 * state.padding_fraction:.2f}% padding",
        "",
        f"{f'model state of rank {state.rank}':<28}{'bytes':>15} {'GiB':>10}",
    ]
    rows = [
        (f"weights kept ({compute})", state.params),
        ("main weights (fp32)", state.main_params),
        ("gradients at the step", state.grads),
        ("optimizer state (AdamW)", state.optimizer_state),
        ("held through a step", state.held),
    ]
    if inputs.zero == 3:
        rows.append(("+ largest unit gathered", state.gathered_unit))
        rows.append(("= while a unit runs", state.held + state.gathered_unit))
    lines += [_row(name, value) for name, value in rows]
    if activations is not None and phases is not None:
        lines += _phase_lines(activations, phases)
    if wire is not None:
        lines += _wire_lines(wire)
        lines += _step_lines(step)
    memory = inputs.device.memory_bytes
    need = _need(state, phases)
    what = "model state" if phases is None else "peak"
    verdict = "fits" if need <= memory else "does NOT fit"
    lines += [
        "",
        f"{what} {verdict}: {need / GiB:.3f} of {memory / GiB:.1f} GiB "
        f"({100 * need / memory:.1f}%)",
        f"not predicted yet: {', '.join(_not_predicted(phases))}",
    ]
    return "\n".join(lines)


def plan_json(
    inputs: PlanInputs,
    source: ModelSource,
    state: ModelState,
    activations: Activations | None = None,
    phases: PhaseBytes | None = None,
    wire: WirePlan | None = None,
    step: StepTime | None = None,
) -> str:
    """The plan as one JSON object (bytes as integers; ``null`` where not planned)."""
    document: dict[str, Any] = {
        "model": {"name": source.name, "parameters": source.parameters, "layers": source.layers},
        "gpus": inputs.gpus,
        "device": {
            "name": inputs.device.name,
            "memory_bytes": inputs.device.memory_bytes,
            "peak_tflops": inputs.device.peak_tflops,
            "nvlink_gbps": inputs.device.nvlink_gbps,
            "network_gbps": inputs.device.network_gbps,
            "gpus_per_node": inputs.gpus_per_node,
        },
        "settings": {
            "zero": inputs.zero,
            "tp": inputs.tp,
            "cp": inputs.cp,
            "dp_outer": inputs.dp_outer,
            "dp_shard": inputs.dp_shard,
            "precision": inputs.precision,
            "optimizer": "adamw",
            "micro_batch": inputs.micro_batch,
            "seq_len": inputs.seq_len,
            "activation_checkpointing": inputs.activation_checkpointing,
        },
        "model_state": state.as_dict(),
        "model_state_fits": state.held + state.gathered_unit <= inputs.device.memory_bytes,
        "activations": None if activations is None else activations.as_dict(),
        "phases": None if phases is None else phases.as_dict(),
        "wire": None if wire is None else wire.as_dict(),
        "step_time_estimate": None if step is None else step.as_dict(),
        "fits": _need(state, phases) <= inputs.device.memory_bytes,
        "not_predicted": _not_predicted(phases),
    }
    return json.dumps(document, indent=2)
