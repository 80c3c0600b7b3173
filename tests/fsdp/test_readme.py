"""The README's example runs as written on 2 gloo ranks."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests._multiprocess import run_on_ranks

README = pathlib.Path(__file__).parents[2] / "packages" / "mf-fsdp" / "README.md"


def _example() -> str:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert match is not None, "README.md has no python example"
    return match.group(1)


def _rank_example(rank: int, world: int, code: str) -> None:
    exec(compile(code, str(README), "exec"), {"__name__": "__example__"})


@pytest.mark.multiprocess
def test_readme_example_runs() -> None:
    run_on_ranks(_rank_example, 2, _example(), timeout=120)
