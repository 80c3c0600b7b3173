"""The documents of ``--data``: a UTF-8 text file, or JSON lines with a text field.

A file whose name ends in ``.jsonl`` holds one JSON object per line, whose
``--text-field`` (default ``text``) is one document; blank lines are skipped.
Any other file is one document, its whole text. A line that is not a JSON
object, lacks the field or holds something else than a string stops the run
before it starts, with one line naming the file and the line number.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["JSONL_SUFFIX", "read_documents"]

JSONL_SUFFIX = ".jsonl"


def _jsonl_documents(file: Path, text: str, field: str) -> list[str]:
    documents = []
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
        if field not in record:
            raise ValueError(
                f"{where}: the object has no {field!r} field (it has {sorted(record)[:5]}); "
                "name the text field with --text-field"
            )
        value = record[field]
        if not isinstance(value, str):
            raise ValueError(
                f"{where}: the {field!r} field is a {type(value).__name__}, expected a string"
            )
        documents.append(value)
    return documents


def read_documents(path: str, text_field: str = "text") -> list[str]:
    """The documents of the file at ``path`` (see the module docstring).

    Raises:
        ValueError: one line: the file is missing, not UTF-8, empty, or a JSONL line
            is bad (naming its number).
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--data: {path!r} does not exist or is not a file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--data: {path!r} is not UTF-8 text ({error.reason})") from None
    documents = _jsonl_documents(file, text, text_field) if file.suffix == JSONL_SUFFIX else [text]
    if not any(d.strip() for d in documents):
        raise ValueError(f"--data: {path!r} is empty")
    return documents
