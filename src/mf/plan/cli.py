"""``mf-plan``: read the question, build the engine for it, print the answer.

A user's mistake is one line on stderr (``mf-plan: error: ...``) and exit
status 2; a plan, fitting or not, is printed with status 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mf.models import PRESETS
from mf.plan.activations import Activations, plan_activations
from mf.plan.inputs import PlanInputs, parse_inputs
from mf.plan.meta_model import ModelSource, model_source
from mf.plan.model_state import plan_engine
from mf.plan.phases import plan_phases
from mf.plan.report import plan_json, plan_table
from mf.plan.search import Candidate, search
from mf.plan.search_report import search_json, search_table

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mf-plan``; returns the process exit code."""
    try:
        inputs = parse_inputs(sys.argv[1:] if argv is None else argv)
        source = model_source(inputs.model)
        activations = _activations(inputs, source)
        if inputs.search:
            found = search(inputs, source, lambda c: _bytes_per_token(c))
            answer = search_json if inputs.json else search_table
            print(answer(inputs, source, found, _proxy))
            return 0
    except ValueError as error:
        print(f"mf-plan: error: {error}", file=sys.stderr, flush=True)
        return 2
    state, wire = plan_engine(
        source,
        inputs.gpus,
        zero=inputs.zero,
        precision=inputs.precision,
        cp=inputs.cp,
        dp_outer=inputs.dp_outer,
        rank=inputs.rank,
    )
    phases = None if activations is None else plan_phases(state, activations)
    report = plan_json if inputs.json else plan_table
    print(report(inputs, source, state, activations, phases, wire))
    return 0


def _bytes_per_token(candidate: Candidate) -> float:
    """Bytes a rank sends per token it trains: the search's ranking until step time is planned."""
    return candidate.wire.sent / (candidate.micro_batch * candidate.seq_len / candidate.cp)


def _proxy(candidate: Candidate) -> dict[str, float]:
    return {"bytes sent/token": _bytes_per_token(candidate)}


def _activations(inputs: PlanInputs, source: ModelSource) -> Activations | None:
    """One micro-batch's activations on a rank (None for a folder: presets only so far).

    Under ``--cp`` a rank holds ``seq_len / cp`` tokens of each sequence; they are
    planned as a sequence of that length (ordinary attention, not the ring's).
    """
    if source.folder is not None:
        return None
    positions = PRESETS[source.name].seq_len
    seq_len = positions if inputs.seq_len is None else inputs.seq_len
    if not 0 < seq_len <= positions:
        raise ValueError(
            f"--seq-len must be in [1, {positions}] (the {source.name!r} model's positions), "
            f"got {seq_len}"
        )
    return plan_activations(
        source,
        micro_batch=inputs.micro_batch,
        seq_len=max(1, seq_len // inputs.cp),
        precision=inputs.precision,
        checkpointing=inputs.activation_checkpointing,
    )


if __name__ == "__main__":
    raise SystemExit(main())
