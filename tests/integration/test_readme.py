"""The library examples of the README and docs/using-mf.md run as written on 2 gloo ranks."""

from __future__ import annotations

import os
import pathlib
import re

import pytest
import torch

from tests._multiprocess import run_on_ranks

ROOT = pathlib.Path(__file__).parents[2]
PAGES = (ROOT / "README.md", ROOT / "docs" / "using-mf.md")


def _examples() -> list[tuple[str, str]]:
    """(page, code) of every python block of the pages, in order."""
    return [
        (page.name, code)
        for page in PAGES
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    ]


def _complete(code: str) -> bool:
    """A whole program (the others are fragments of one shown beside it)."""
    return "init_process_group" in code


def _needs_torchtitan(code: str) -> bool:
    return "from torchtitan" in code


def _rank_examples(rank: int, world: int, examples: list[tuple[str, str]], cwd: str) -> None:
    os.chdir(cwd)  # an example may write files (a checkpoint under runs/)
    for page, code in examples:
        exec(compile(code, page, "exec"), {"__name__": "__example__"})


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_readme_examples_run(tmp_path) -> None:
    examples = [(p, c) for p, c in _examples() if _complete(c) and not _needs_torchtitan(c)]
    # The README's fully_shard loop, then using-mf.md's: tensor-parallel layers, DSD and
    # DCP, a transformers Llama, Muon + AdamW.
    assert [page for page, _ in examples] == ["README.md"] + ["using-mf.md"] * 4
    signatures = ["fully_shard", "ColumnParallelLinear", "get_state_dict", "LlamaForCausalLM"]
    signatures.append("torch.optim.Muon")
    for (_, code), signature in zip(examples, signatures, strict=True):
        assert signature in code, signature
    run_on_ranks(_rank_examples, 2, examples, str(tmp_path), timeout=130)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_readme_torchtitan_example_runs(tmp_path) -> None:
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as error:
        pytest.skip(f"torchtitan does not import with torch {torch.__version__}: {error}")
    examples = [(p, c) for p, c in _examples() if _needs_torchtitan(c)]
    assert len(examples) == 1
    run_on_ranks(_rank_examples, 2, examples, str(tmp_path), timeout=180)
    assert (tmp_path / "runs" / "torchtitan-example" / "step_0000001").is_dir()
