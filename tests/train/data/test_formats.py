"""The shape of a ``--data`` JSONL file, detected from its first line, and its bad lines.

Each of the four shapes (text, messages, prompt-completion, conversational
prompt-completion) is detected and read into its examples; a line of another
shape, an unknown role, a non-string content, a conversation without an
assistant turn and an empty completion are each one ValueError naming the file
and the line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mf.train.data.documents import read_data, read_documents
from mf.train.data.formats import (
    CONVERSATIONAL_PROMPT_COMPLETION,
    MESSAGES,
    PROMPT_COMPLETION,
    TEXT,
    Conversation,
    PromptCompletion,
)

_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye"},
]


def _file(tmp_path: Path, *objects: object) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in objects) + "\n\n")
    return str(path)


def test_each_shape_is_detected_and_read(tmp_path: Path) -> None:
    text = read_data(_file(tmp_path, {"text": "a"}, {"text": "b"}))
    assert (text.shape, text.examples) == (TEXT, ["a", "b"])

    messages = read_data(_file(tmp_path, {"messages": _CHAT}))
    assert messages.shape == MESSAGES
    assert messages.conversational
    (conversation,) = messages.examples
    assert isinstance(conversation, Conversation)
    assert conversation.answers == ((2, 3), (4, 5))  # every assistant turn
    assert conversation.where.endswith("line 1")

    standard = read_data(_file(tmp_path, {"prompt": "2+2=", "completion": "4"}))
    assert standard.shape == PROMPT_COMPLETION
    assert not standard.conversational
    assert standard.examples[0] == PromptCompletion(standard.examples[0].where, "2+2=", "4")

    pair = {"prompt": _CHAT[:2], "completion": _CHAT[2:3]}
    conversational = read_data(_file(tmp_path, pair))
    assert conversational.shape == CONVERSATIONAL_PROMPT_COMPLETION
    assert conversational.examples[0].answers == ((2, 3),)  # the whole completion


def test_a_preset_refuses_instruction_data_in_one_line(tmp_path: Path) -> None:
    path = _file(tmp_path, {"messages": _CHAT})
    with pytest.raises(ValueError, match="messages data needs --model PATH"):
        read_documents(path)


@pytest.mark.parametrize(
    ("objects", "message"),
    [
        (
            [{"messages": _CHAT}, {"text": "x"}],
            "line 2: a text object (keys ['text']) in a messages file",
        ),
        (
            [{"messages": [{"role": "tool", "content": "x"}]}],
            "line 1: messages[0] has the unknown role 'tool'; expected one of system, user, "
            "assistant",
        ),
        (
            [{"messages": _CHAT}, {"messages": [{"role": "user", "content": ["a", "b"]}]}],
            "line 2: messages[0] (user) has a list content, expected a string",
        ),
        (
            [{"messages": _CHAT[:2]}],
            "line 1: the conversation has no assistant turn to learn from",
        ),
        (
            [{"prompt": _CHAT[:2], "completion": []}],
            "line 1: the completion is empty",
        ),
        (
            [{"messages": _CHAT[2:]}],
            "line 1: the conversation begins with an assistant turn",
        ),
        ([{"prompt": [], "completion": _CHAT[2:3]}], "line 1: the prompt is empty"),
        ([{"prompt": "a", "completion": 3}], "line 1: the 'completion' field is an int"),
        ([{"messages": "hello"}], "line 1: 'messages' is a str, expected a list"),
    ],
)
def test_bad_lines_are_one_error_naming_the_file_and_line(
    tmp_path: Path, objects: list[object], message: str
) -> None:
    path = _file(tmp_path, *objects)
    with pytest.raises(ValueError, match="^--data ") as raised:
        read_data(path)
    assert str(raised.value) == str(raised.value).splitlines()[0]
    assert str(raised.value).startswith(f"--data {path!r} {message[:5]}"), raised.value
    assert message in str(raised.value)
