"""The root README's using-mf-in-your-own-code examples run as written on 2 gloo ranks."""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch

from tests._multiprocess import run_on_ranks

README = pathlib.Path(__file__).parents[2] / "README.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _needs_torchtitan(code: str) -> bool:
    return "from torchtitan" in code


def _rank_examples(rank: int, world: int, examples: list[str], cwd: str) -> None:
    os.chdir(cwd)  # an example may write files (a checkpoint under runs/)
    for code in examples:
        exec(compile(code, str(README), "exec"), {"__name__": "__example__"})


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_readme_examples_run(tmp_path) -> None:
    examples = [code for code in _examples() if not _needs_torchtitan(code)]
    assert [("fully_shard" in code, "ColumnParallelLinear" in code) for code in examples] == [
        (True, False),
        (False, True),
        (True, False),
        (True, False),
    ]
    assert "get_state_dict" in examples[2]
    assert "LlamaForCausalLM" in examples[3]
    run_on_ranks(_rank_examples, 2, examples, str(tmp_path), timeout=100)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_readme_torchtitan_example_runs(tmp_path) -> None:
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as error:
        pytest.skip(f"torchtitan does not import with torch {torch.__version__}: {error}")
    examples = [code for code in _examples() if _needs_torchtitan(code)]
    assert len(examples) == 1
    run_on_ranks(_rank_examples, 2, examples, str(tmp_path), timeout=180)
    assert (tmp_path / "runs" / "torchtitan-example" / "step_0000001").is_dir()
