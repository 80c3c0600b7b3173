"""The root README's using-mf-in-your-own-code examples run as written on 2 gloo ranks."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests._multiprocess import run_on_ranks

README = pathlib.Path(__file__).parents[2] / "README.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _rank_examples(rank: int, world: int, examples: list[str]) -> None:
    for code in examples:
        exec(compile(code, str(README), "exec"), {"__name__": "__example__"})


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_readme_examples_run() -> None:
    examples = _examples()
    assert [("fully_shard" in code, "ColumnParallelLinear" in code) for code in examples] == [
        (True, False),
        (False, True),
        (True, False),
        (True, False),
    ]
    assert "get_state_dict" in examples[2]
    assert "LlamaForCausalLM" in examples[3]
    run_on_ranks(_rank_examples, 2, examples, timeout=100)
