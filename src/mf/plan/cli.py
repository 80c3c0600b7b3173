"""``mf-plan``: read the question, build the engine for it, print the answer.

A user's mistake is one line on stderr (``mf-plan: error: ...``) and exit
status 2; a plan, fitting or not, is printed with status 0.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from mf.plan.activations import Activations, plan_activations
from mf.plan.inputs import PlanInputs, parse_inputs
from mf.plan.meta_model import ModelSource, model_source, planned_seq_len
from mf.plan.model_state import plan_engine
from mf.plan.phases import plan_phases
from mf.plan.report import plan_json, plan_table
from mf.plan.search import Candidate, search
from mf.plan.search_report import search_json, search_table
from mf.plan.step_time import estimate_step_time

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mf-plan``; returns the process exit code."""
    try:
        inputs = parse_inputs(sys.argv[1:] if argv is None else argv)
        source = model_source(inputs.model)
        seq_len = planned_seq_len(source, inputs.seq_len)
        if inputs.search:
            score = functools.partial(_score, inputs, source)
            found = search(inputs, source, lambda c: _rank_key(score(c)))
            answer = search_json if inputs.json else search_table
            print(answer(inputs, source, found, score))
            return 0
        grad_accum = _grad_accum(inputs)
        activations = _activations(inputs, source, seq_len)
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
    step = estimate_step_time(
        source,
        wire,
        inputs.device,
        gpus=inputs.gpus,
        gpus_per_node=inputs.gpus_per_node,
        dp_outer=inputs.dp_outer,
        cp=inputs.cp,
        micro_batch=inputs.micro_batch,
        seq_len=seq_len,
        grad_accum=grad_accum,
    )
    report = plan_json if inputs.json else plan_table
    print(report(inputs, source, state, activations, phases, wire, step))
    return 0


def _grad_accum(inputs: PlanInputs) -> int:
    """Micro-batches per step that make up ``--global-batch`` (1 without one)."""
    if inputs.global_batch is None:
        return 1
    per_step = inputs.micro_batch * (inputs.gpus // (inputs.cp * inputs.tp))
    if inputs.global_batch % per_step:
        raise ValueError(
            f"--global-batch {inputs.global_batch}: not a multiple of --micro-batch "
            f"{inputs.micro_batch} x {per_step // inputs.micro_batch} data-parallel ranks"
        )
    return inputs.global_batch // per_step


def _score(inputs: PlanInputs, source: ModelSource, candidate: Candidate) -> dict[str, float]:
    """What ranks a configuration: its estimated tokens/s and step time.

    Where the device's FLOP/s and links are not known (``--gpu-memory``): the bytes a
    rank sends per token it trains.
    """
    step = estimate_step_time(
        source,
        candidate.wire,
        inputs.device,
        gpus=inputs.gpus,
        gpus_per_node=inputs.gpus_per_node,
        dp_outer=candidate.dp_outer,
        cp=candidate.cp,
        micro_batch=candidate.micro_batch,
        seq_len=candidate.seq_len,
        grad_accum=candidate.grad_accum,
    )
    if step is None:
        tokens = candidate.micro_batch * candidate.seq_len / candidate.cp
        return {_BYTES_PER_TOKEN: candidate.wire.sent / tokens}
    return {_TOKENS_PER_S: step.tokens_per_s, "step ms (estimate)": step.step_s * 1e3}


_TOKENS_PER_S, _BYTES_PER_TOKEN = "tokens/s (estimate)", "bytes sent/token"


def _rank_key(figures: dict[str, float]) -> float:
    """Lowest first: the most tokens/s, or without an estimate the fewest bytes per token."""
    if _TOKENS_PER_S in figures:
        return -figures[_TOKENS_PER_S]
    return figures[_BYTES_PER_TOKEN]


def _activations(inputs: PlanInputs, source: ModelSource, seq_len: int) -> Activations | None:
    """One micro-batch's activations on a rank (None for a folder: presets only so far).

    Under ``--cp`` a rank holds ``seq_len / cp`` tokens of each sequence; they are
    planned as a sequence of that length (ordinary attention, not the ring's).
    """
    if source.folder is not None:
        return None
    return plan_activations(
        source,
        micro_batch=inputs.micro_batch,
        seq_len=max(1, seq_len // inputs.cp),
        precision=inputs.precision,
        checkpointing=inputs.activation_checkpointing,
    )


if __name__ == "__main__":
    raise SystemExit(main())
