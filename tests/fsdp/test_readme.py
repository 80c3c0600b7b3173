"""The README's examples run as written on 2 gloo ranks: the quick start, and Muon + AdamW."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests._multiprocess import run_on_ranks

README = pathlib.Path(__file__).parents[2] / "packages" / "mf-fsdp" / "README.md"


def _examples() -> list[str]:
    """The complete programs among the README's python blocks (the others are fragments)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [code for code in blocks if "init_process_group" in code]


def _rank_examples(rank: int, world: int, examples: list[str]) -> None:
    for code in examples:
        exec(compile(code, str(README), "exec"), {"__name__": "__example__"})


@pytest.mark.multiprocess
def test_readme_examples_run() -> None:
    examples = _examples()
    assert len(examples) == 2
    assert "torch.optim.Muon" in examples[1]
    run_on_ranks(_rank_examples, 2, examples, timeout=120)
