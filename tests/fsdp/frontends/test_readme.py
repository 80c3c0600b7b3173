"""mf-fsdp's package page: its example runs as written on 2 gloo ranks.

The page's other python blocks are fragments of that program (the FSDP2 import);
the longer examples live in docs/using-mf.md (``tests/integration/test_readme.py``).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tests._multiprocess import run_on_ranks

README = pathlib.Path(__file__).parents[3] / "packages" / "mf-fsdp" / "README.md"


def _examples() -> list[str]:
    """The complete programs among the page's python blocks (the others are fragments)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [code for code in blocks if "init_process_group" in code]


def _rank_examples(rank: int, world: int, examples: list[str]) -> None:
    for code in examples:
        exec(compile(code, str(README), "exec"), {"__name__": "__example__"})


@pytest.mark.multiprocess
def test_readme_examples_run() -> None:
    examples = _examples()
    assert len(examples) == 1
    assert "mf_fsdp.fully_shard(" in examples[0]
    run_on_ranks(_rank_examples, 2, examples, timeout=120)
