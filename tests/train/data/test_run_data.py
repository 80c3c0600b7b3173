"""A folder run's data for each shape of ``--data``: named, rendered, masked and padded.

Through ``training_data`` with parsed options, as the launcher and every rank
call it: under ``--no-pack``, messages and prompt-completion files become one
padded example per sequence whose targets are the answers' tokens (``IGNORED``
elsewhere, padding included), every real token under ``--train-on-prompt``; the
corpus is named with its shape. ``--chat-template FILE`` serves a folder without
a template. Packing is ``test_packing``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mf.train.data.answer_masks import answer_mask
from mf.train.data.examples import IGNORED, ExampleData
from mf.train.data.run_data import training_data
from mf.train.data.tokenized import TokenData
from mf.train.run.options import parse_options
from tests.train.data.chat_folders import CHATML

_TURNS = [
    {"role": "user", "content": "Say yes"},
    {"role": "assistant", "content": "Yes."},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Yes, again."},
]


def _write(path: Path, objects: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(o) for o in objects) + "\n")
    return str(path)


def _data(folder: Path, data: str, *extra: str):
    argv = ["--model", str(folder), "--data", data, "--device", "cpu", "--seq-len", "96"]
    return training_data(parse_options([*argv, *extra]))


def test_messages_are_masked_to_their_answers(chatml: Path, tmp_path: Path) -> None:
    path = _write(tmp_path / "chat.jsonl", [{"messages": _TURNS}] * 10)
    data, name = _data(chatml, path, "--no-pack")
    assert isinstance(data, ExampleData)
    example = _first(path)
    assert example.answers == ((1, 2), (3, 4))
    tokens, mask = answer_mask(data.tokenizer, example)
    assert name.startswith(f"{path} (messages, 10 examples one per sequence (--no-pack), ")
    inputs, targets = data.batch("train", 0, 0, 0, 1, 1, 96)
    length = len(tokens)
    assert inputs[0, : length - 1].tolist() == tokens[:-1]
    wanted = [t if m else IGNORED for t, m in zip(tokens[1:], mask[1:], strict=True)]
    assert targets[0, : length - 1].tolist() == wanted
    assert (targets[0, length - 1 :] == IGNORED).all()  # the padding
    assert data.tokenizer.decode([t for t in wanted if t != IGNORED]) == (
        "Yes.<|im_end|>\nYes, again.<|im_end|>\n"
    )
    assert len(data.train) == 9 * length  # padding left out
    assert len(data.validation) == length  # one held out


def _first(path: str):
    from mf.train.data.documents import read_data

    return read_data(path).examples[0]


def test_train_on_prompt_counts_every_real_token(chatml: Path, tmp_path: Path) -> None:
    path = _write(tmp_path / "chat.jsonl", [{"messages": _TURNS}] * 10)
    data, name = _data(chatml, path, "--train-on-prompt", "--no-pack")
    assert "loss on every token (--train-on-prompt)" in name
    _, targets = data.batch("train", 0, 0, 0, 1, 1, 96)
    length = int(data.lengths[0])
    assert (targets[0, : length - 1] != IGNORED).all()
    assert (targets[0, length - 1 :] == IGNORED).all()


@pytest.mark.parametrize(
    ("objects", "shape"),
    [
        ([{"prompt": "The sky is", "completion": " blue"}] * 4, "prompt-completion"),
        (
            [{"prompt": _TURNS[:1], "completion": _TURNS[1:2]}] * 4,
            "conversational prompt-completion",
        ),
    ],
)
def test_prompt_completion_files(
    chatml: Path, tmp_path: Path, objects: list[dict], shape: str
) -> None:
    data, name = _data(chatml, _write(tmp_path / "pairs.jsonl", objects), "--no-pack")
    assert isinstance(data, ExampleData)
    assert f"({shape}, 4 examples one per sequence" in name
    _, targets = data.batch("train", 0, 0, 0, 1, 1, 96)
    counted = data.tokenizer.decode(targets[0][targets[0] != IGNORED].tolist())
    assert counted == (" blue<|im_end|>" if shape == "prompt-completion" else "Yes.<|im_end|>\n")


def test_text_files_stay_packed_and_are_named_text(chatml: Path, tmp_path: Path) -> None:
    path = _write(tmp_path / "text.jsonl", [{"text": "some words " * 40}] * 8)
    data, name = _data(chatml, path)
    assert isinstance(data, TokenData)
    assert name == f"{path} (text)"


def test_a_chat_template_file_serves_a_folder_without_one(
    untemplated: Path, tmp_path: Path
) -> None:
    path = _write(tmp_path / "chat.jsonl", [{"messages": _TURNS}] * 4)
    with pytest.raises(ValueError, match="has no chat template .* give one with --chat-template"):
        _data(untemplated, path)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    data, _ = _data(untemplated, path, "--chat-template", str(template))
    assert data.decode(data.rows[0]).startswith("<|im_start|>system\nYou are a helpful")
