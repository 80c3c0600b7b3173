"""``mf-plan``: read the question, build the engine for it, print the answer.

A user's mistake is one line on stderr (``mf-plan: error: ...``) and exit
status 2; a plan, fitting or not, is printed with status 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mf.plan.inputs import parse_inputs
from mf.plan.meta_model import model_source
from mf.plan.model_state import plan_model_state
from mf.plan.report import plan_json, plan_table

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mf-plan``; returns the process exit code."""
    try:
        inputs = parse_inputs(sys.argv[1:] if argv is None else argv)
        source = model_source(inputs.model)
    except ValueError as error:
        print(f"mf-plan: error: {error}", file=sys.stderr, flush=True)
        return 2
    state = plan_model_state(
        source,
        inputs.gpus,
        zero=inputs.zero,
        precision=inputs.precision,
        cp=inputs.cp,
        dp_outer=inputs.dp_outer,
        rank=inputs.rank,
    )
    print(plan_json(inputs, source, state) if inputs.json else plan_table(inputs, source, state))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
