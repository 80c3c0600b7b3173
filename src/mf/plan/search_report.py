"""``mf-plan --search``'s answer: the configurations that fit as a table and ready command lines.

Pure formatting of ``mf.plan.search``'s candidates, best first; the JSON carries
every fitting configuration, the table and the command lines the best few.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from mf.plan.devices import GiB
from mf.plan.inputs import PlanInputs
from mf.plan.meta_model import ModelSource
from mf.plan.search import Candidate

__all__ = ["TOP", "search_json", "search_table"]

TOP = 5
"""Configurations the table shows and prints as command lines."""

Score = Callable[[Candidate], dict[str, float]]
"""What ranks a candidate, as named figures for the table and JSON."""


def search_table(
    inputs: PlanInputs, source: ModelSource, found: Sequence[Candidate], score: Score
) -> str:
    """The best ``TOP`` configurations, their bytes and score, and their command lines."""
    what = "state needs" if source.folder is not None else "needs"
    figures = list(score(found[0])) if found else []
    lines = [
        f"mf-plan --search: {source.name!r} ({source.parameters / 1e6:,.1f}M parameters) on "
        f"{inputs.gpus} GPUs of {inputs.device.memory_bytes / GiB:.1f} GiB "
        f"({inputs.device.name}), {inputs.precision}: {len(found)} configurations fit",
        "",
        f"  {'ZeRO':>4} {'dp_outer':>8} {'cp':>3} {'micro':>5} {'accum':>5} "
        f"{what + ' GiB':>16} {'sent GB/step':>12}" + "".join(f" {name:>18}" for name in figures),
    ]
    for c in found[:TOP]:
        row = score(c)
        lines.append(
            f"  {c.zero:>4} {c.dp_outer:>8} {c.cp:>3} {c.micro_batch:>5} {c.grad_accum:>5} "
            f"{c.need / GiB:>16.3f} {c.wire.sent_per_step(c.grad_accum) / 1e9:>12.3f}"
            + "".join(f" {row[name]:>18,.1f}" for name in figures)
        )
    lines += ["", "best first, as mf-train command lines:"]
    lines += [f"  {c.command(inputs)}" for c in found[:TOP]]
    return "\n".join(lines)


def search_json(
    inputs: PlanInputs, source: ModelSource, found: Sequence[Candidate], score: Score
) -> str:
    """Every configuration that fits, best first, as one JSON object."""
    document = {
        "model": {"name": source.name, "parameters": source.parameters, "layers": source.layers},
        "gpus": inputs.gpus,
        "memory_bytes": inputs.device.memory_bytes,
        "precision": inputs.precision,
        "configurations": [
            {
                "zero": c.zero,
                "dp_outer": c.dp_outer,
                "cp": c.cp,
                "micro_batch": c.micro_batch,
                "grad_accum": c.grad_accum,
                "seq_len": c.seq_len,
                "need_bytes": c.need,
                "wire_sent_bytes_per_step": c.wire.sent_per_step(c.grad_accum),
                **score(c),
                "command": c.command(inputs),
            }
            for c in found
        ],
    }
    return json.dumps(document, indent=2)
