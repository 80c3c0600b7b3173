"""The four shapes a ``--data`` JSONL file may take, detected from its first object.

- ``text``: ``{"text": str}`` (``--text-field`` names the field): language modelling,
  every token counted;
- ``messages``: ``{"messages": [{"role": ..., "content": str}, ...]}``: a conversation,
  its assistant turns the answers;
- ``prompt-completion``: ``{"prompt": str, "completion": str}``: the completion the answer;
- ``conversational prompt-completion``: ``{"prompt": [message, ...], "completion":
  [message, ...]}``: the completion's turns the answer.

Every line must have the first line's shape. A role other than system, user or
assistant, a content that is not a string, a conversation without an assistant
turn and an empty completion are refused here, before any process starts, in one
line naming the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CONVERSATIONAL_PROMPT_COMPLETION",
    "MESSAGES",
    "PROMPT_COMPLETION",
    "ROLES",
    "TEXT",
    "Conversation",
    "DataFile",
    "PromptCompletion",
    "jsonl_records",
    "read_data_file",
]

TEXT = "text"
MESSAGES = "messages"
PROMPT_COMPLETION = "prompt-completion"
CONVERSATIONAL_PROMPT_COMPLETION = "conversational prompt-completion"
ROLES = ("system", "user", "assistant")
"""The roles a conversation's messages may take."""


@dataclass(frozen=True)
class Conversation:
    """Messages rendered through the chat template, with the ranges of them that are answers.

    ``answers``: ``(start, end)`` message-index ranges: one per assistant turn for
    ``messages`` data, the whole completion for conversational prompt-completion data.
    """

    where: str
    messages: tuple[dict[str, str], ...]
    answers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PromptCompletion:
    """A standard prompt-completion pair: plain strings, the completion the answer."""

    where: str
    prompt: str
    completion: str


@dataclass(frozen=True)
class DataFile:
    """A JSONL file's shape and its examples (strings for ``text`` data)."""

    shape: str
    examples: list[Any]

    @property
    def conversational(self) -> bool:
        """Whether its examples go through a chat template."""
        return self.shape in (MESSAGES, CONVERSATIONAL_PROMPT_COMPLETION)


def jsonl_records(file: Path, text: str) -> list[tuple[str, dict[str, Any]]]:
    """Each non-blank line's JSON object with where it is (``--data 'FILE' line N``).

    Raises:
        ValueError: one line: a line that is not JSON or not an object.
    """
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--data {str(file)!r} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        records.append((where, record))
    return records


def _kind(value: Any) -> str:
    """``value``'s JSON type with its article: "an int", "a list"."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _shape(record: dict[str, Any], text_field: str) -> str:
    if "messages" in record and text_field not in record:
        return MESSAGES
    if "prompt" in record and "completion" in record and text_field not in record:
        conversational = isinstance(record["prompt"], list)
        return CONVERSATIONAL_PROMPT_COMPLETION if conversational else PROMPT_COMPLETION
    return TEXT


def _messages(where: str, value: Any, field: str) -> tuple[dict[str, str], ...]:
    """``value`` as checked messages: a list of objects with a known role and string content."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field!r} is {_kind(value)}, expected a list")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{where}: {field}[{index}] is not an object with 'role' and 'content'"
            )
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(
                f"{where}: {field}[{index}] has the unknown role {role!r}; expected one of "
                f"{', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: {field}[{index}] ({role}) has {_kind(content)} content, "
                "expected a string"
            )
        messages.append({"role": role, "content": content})
    return tuple(messages)


def _string(where: str, record: dict[str, Any], field: str) -> str:
    if field not in record:
        raise ValueError(
            f"{where}: the object has no {field!r} field (it has {sorted(record)[:5]})"
        )
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: the {field!r} field is {_kind(value)}, expected a string")
    return value


def _example(where: str, record: dict[str, Any], shape: str, text_field: str) -> Any:
    """The example of one line of a file of ``shape``; one ValueError when it is not one."""
    if shape == TEXT:
        if text_field not in record:
            raise ValueError(
                f"{where}: the object has no {text_field!r} field (it has {sorted(record)[:5]}); "
                "name the text field with --text-field, or give messages or prompt and completion"
            )
        return _string(where, record, text_field)
    if shape == PROMPT_COMPLETION:
        return PromptCompletion(
            where, _string(where, record, "prompt"), _string(where, record, "completion")
        )
    if shape == MESSAGES:
        messages = _messages(where, record.get("messages"), "messages")
        answers = tuple((i, i + 1) for i, m in enumerate(messages) if m["role"] == "assistant")
        if not answers:
            raise ValueError(f"{where}: the conversation has no assistant turn to learn from")
        if answers[0][0] == 0:
            raise ValueError(
                f"{where}: the conversation begins with an assistant turn; expected a system "
                "or user turn before the first answer (its prompt)"
            )
        return Conversation(where, messages, answers)
    prompt = _messages(where, record.get("prompt"), "prompt")
    completion = _messages(where, record.get("completion"), "completion")
    if not prompt or not completion:
        empty = "prompt" if not prompt else "completion"
        raise ValueError(f"{where}: the {empty} is empty; expected at least one message")
    return Conversation(where, prompt + completion, ((len(prompt), len(prompt) + len(completion)),))


def read_data_file(file: Path, text: str, text_field: str) -> DataFile:
    """The shape of the JSONL ``text`` (its first object's) and every line's example.

    Raises:
        ValueError: one line naming the file and line: bad JSON, a line of another
            shape than the first, or a bad example (see the module docstring).
    """
    records = jsonl_records(file, text)
    if not records:
        raise ValueError(f"--data: {str(file)!r} is empty")
    shape = _shape(records[0][1], text_field)
    examples = []
    for where, record in records:
        mine = _shape(record, text_field)
        if mine != shape:
            raise ValueError(
                f"{where}: a {mine} object (keys {sorted(record)[:5]}) in a {shape} file; "
                "every line must have the shape of the first"
            )
        examples.append(_example(where, record, shape, text_field))
    return DataFile(shape, examples)
