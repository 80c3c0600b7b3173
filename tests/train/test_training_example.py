"""docs/training.md's worked examples run as written: a Llama folder made locally, fine-tuned
by ``mf-train --model PATH`` with ``--tensorboard`` and ``--profile``, loaded back in
transformers and generating; and the same folder chat-tuned with ``--chat-template``,
answering through its template in ``mf-sample --chat`` and in transformers.

The page's blocks between its ``worked-example`` markers are run in order in a fresh
folder: each ``uv run`` command as the same command in this interpreter (``uv run X`` is
the project's environment, which this is), the python block as ``generate.py``. Nothing
is downloaded (``HF_HUB_OFFLINE``), so CI runs it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "training.md"


def _example_blocks(name: str = "worked-example") -> list[tuple[str, str]]:
    """(language, code) of each fenced block between the page's ``name`` markers, in order."""
    text = PAGE.read_text()
    section = text[text.index(f"<!-- {name}:") : text.index(f"<!-- end of {name} -->")]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def _commands(code: str) -> list[list[str]]:
    """A bash block's ``uv run`` commands (backslash continuations joined) as argv lists."""
    joined = code.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line)
        assert words[:2] == ["uv", "run"], line  # the page's commands are all `uv run`
        program = words[2:]
        if program[0] == "mf-train":
            program = ["-m", "mf.train.run.cli", *program[1:]]
        elif program[0] == "mf-sample":
            program = ["-m", "mf.train.exports.sample", *program[1:]]
        elif program[0] == "python":
            program = program[1:]
        else:
            raise AssertionError(f"an example command this test does not know: {line}")
        commands.append([sys.executable, *program])
    return commands


def _run(argv: list[str], cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def _greedy(folder: Path) -> str:
    """40 greedy tokens after "The " from the transformers folder at ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prompt = tokenizer("The ", return_tensors="pt")
    return tokenizer.decode(model.generate(**prompt, max_new_tokens=40, do_sample=False)[0])


@pytest.mark.multiprocess  # mf-train starts 2 ranks
@pytest.mark.timeout(600)
def test_worked_example_runs_as_written(tmp_path: Path) -> None:
    blocks = _example_blocks()
    assert [language for language, _ in blocks] == ["bash", "python"]
    for argv in _commands(blocks[0][1]):
        _run(argv, tmp_path)
    (tmp_path / "generate.py").write_text(blocks[1][1])
    generated = _run([sys.executable, "generate.py"], tmp_path)
    # The text is the fine-tuned export's, not the initial folder's.
    trained = _greedy(tmp_path / "runs" / "llama-ft" / "model")
    assert generated == trained + "\n"  # print's newline
    assert trained != _greedy(tmp_path / "runs" / "llama-small")

    run = tmp_path / "runs" / "llama-ft"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 60
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0  # it fine-tuned
    assert any((run / "tensorboard").iterdir())
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.json").read_text())
        assert trace["traceEvents"], rank


@pytest.mark.multiprocess  # mf-train starts 2 ranks
@pytest.mark.timeout(600)
def test_chat_example_answers_as_written(tmp_path: Path) -> None:
    """The chat example: its data script, its commands, then the transformers script.

    ``mf-sample --chat`` prints the answer to its question and ``answer.py`` the
    answer to its own, each alone: generation stopped at the end of the turn.
    """
    blocks = _example_blocks("chat-example")
    assert [language for language, _ in blocks] == ["python", "bash", "python"]
    (tmp_path / "make_chat.py").write_text(blocks[0][1])
    outputs = [_run(argv, tmp_path) for argv in _commands(blocks[1][1])]
    assert outputs[-1] == "Rome.\n"  # mf-sample --chat "What is the capital of Italy?"
    (tmp_path / "answer.py").write_text(blocks[2][1])
    assert _run([sys.executable, "answer.py"], tmp_path) == "Madrid.\n"
    run = tmp_path / "runs" / "llama-chat-ft"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < 0.1 * metrics[0]["loss"]  # it learnt the answers
