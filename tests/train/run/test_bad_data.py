"""Bad instruction data: one line naming the file and line, exit code 2, no process started.

Each case runs ``mf-train``'s main in this process: stderr must be exactly one
line. One case runs the command in a fresh interpreter, where nothing may print
before the line (torch's warning about torchao's Enums, which transformers'
modelling imports on the way, is silenced: ``model_folder._ENUM_REGISTRATION``).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mf.train.run.cli import main as cli_main

_USER = {"role": "user", "content": "Hi"}
_ANSWER = {"role": "assistant", "content": "Hello"}
_GOOD = {"messages": [_USER, _ANSWER]}
_CASES = {
    "unknown role": (
        [_GOOD, {"messages": [{"role": "robot", "content": "x"}, _ANSWER]}],
        "line 2: messages[0] has the unknown role 'robot'",
    ),
    "no assistant": ([_GOOD, _GOOD, {"messages": [_USER]}], "line 3: the conversation has no"),
    "content": (
        [{"messages": [_USER, {"role": "assistant", "content": 7}]}],
        "line 1: messages[1] (assistant) has an int content, expected a string",
    ),
    "too long": (
        [_GOOD, {"messages": [_USER, {"role": "assistant", "content": "word " * 100}]}],
        "line 2: the example is",
    ),
    "no template": ([_GOOD, _GOOD], "holds messages data, but the model folder has no chat"),
    "preset": ([_GOOD, _GOOD], "messages data needs --model PATH"),
}


def _case(name: str, chatml: Path, untemplated: Path, tmp_path: Path) -> tuple[list[str], Path]:
    """The ``mf-train`` arguments of case ``name``, and its data file."""
    objects, _ = _CASES[name]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(o) for o in objects) + "\n")
    folder = {"no template": str(untemplated), "preset": "tiny"}.get(name, str(chatml))
    seq_len = "48" if name == "preset" else "96"  # the tiny preset has 64 positions
    argv = ["--model", folder, "--data", str(data), "--device", "cpu", "--seq-len", seq_len]
    return [*argv, "--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")], data


def _assert_one_line(name: str, code: int, stderr: str, data: Path) -> None:
    lines = stderr.splitlines()
    assert code == 2, (name, stderr)
    assert len(lines) == 1, (name, lines)
    assert lines[0].startswith(f"mf-train: error: --data {str(data)!r}"), (name, lines)
    assert _CASES[name][1] in lines[0], (name, lines[0])


@pytest.mark.parametrize("name", list(_CASES))
def test_each_bad_input_is_one_line_and_exit_code_2(
    name: str, chatml: Path, untemplated: Path, tmp_path: Path
) -> None:
    argv, data = _case(name, chatml, untemplated, tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(argv)
    _assert_one_line(name, code, err.getvalue(), data)
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.timeout(240)
def test_the_command_prints_nothing_before_the_line(
    chatml: Path, untemplated: Path, tmp_path: Path
) -> None:
    """A fresh ``mf-train``: torch's import-time warnings would come before the error."""
    argv, data = _case("unknown role", chatml, untemplated, tmp_path)
    mf_train = str(Path(sys.executable).with_name("mf-train"))  # this environment's command
    done = subprocess.run([mf_train, *argv], capture_output=True, text=True, timeout=200)
    _assert_one_line("unknown role", done.returncode, done.stderr, data)


@pytest.mark.parametrize(
    "option", [["--chat-template", "t.jinja"], ["--train-on-prompt"], ["--no-pack"]]
)
def test_instruction_options_on_a_preset_are_one_line(option: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(["--model", "tiny", "--device", "cpu", *option])
    assert code == 2
    assert err.getvalue().splitlines() == [
        f"mf-train: error: {option[0]} is for --model PATH (a model folder's instruction "
        "data); --model 'tiny' is a preset, which trains on text"
    ]


@pytest.mark.parametrize(
    ("objects", "extra", "message"),
    [
        (
            [_GOOD, _GOOD],
            ["--nproc", "2", "--cp", "2"],
            "--cp 2 does not serve packed examples (messages --data); pass --no-pack to pad "
            "one example per sequence",
        ),
        (
            [{"text": "some words"}] * 2,
            ["--no-pack"],
            "--no-pack is for messages or prompt-completion --data; text is cut into --seq-len "
            "sequences, not padded",
        ),
    ],
)
def test_packing_options_that_cannot_serve_are_one_line(
    chatml: Path, tmp_path: Path, objects: list[dict], extra: list[str], message: str
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(o) for o in objects) + "\n")
    argv = ["--model", str(chatml), "--data", str(data), "--device", "cpu", "--seq-len", "96"]
    argv += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"), *extra]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(argv)
    assert code == 2
    assert err.getvalue().splitlines() == [f"mf-train: error: {message}"]
    assert not (tmp_path / "out").exists()  # nothing started
