"""The documents or examples of ``--data``: a UTF-8 text file, or JSON lines.

A file whose name ends in ``.jsonl`` holds one JSON object per line, in one of
the shapes of ``mf.train.data.formats`` (text, messages, prompt-completion);
blank lines are skipped. Any other file is one text document, its whole text. A
bad line stops the run before it starts, with one line naming the file and the
line number.
"""

from __future__ import annotations

from pathlib import Path

from mf.train.data.formats import TEXT, DataFile, read_data_file

__all__ = ["JSONL_SUFFIX", "read_data", "read_documents"]

JSONL_SUFFIX = ".jsonl"


def read_data(path: str, text_field: str = "text") -> DataFile:
    """The shape and examples of the file at ``path`` (see the module docstring).

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
    data = read_data_file(file, text, text_field) if file.suffix == JSONL_SUFFIX else None
    data = data or DataFile(TEXT, [text])
    if data.shape == TEXT and not any(d.strip() for d in data.examples):
        raise ValueError(f"--data: {path!r} is empty")
    return data


def read_documents(path: str, text_field: str = "text") -> list[str]:
    """The text documents of the file at ``path``: what a preset's byte model trains on.

    Raises:
        ValueError: one line: as ``read_data``, or a file of conversations or
            prompt-completion pairs, which need a model folder's tokenizer.
    """
    data = read_data(path, text_field)
    if data.shape != TEXT:
        raise ValueError(
            f"--data {path!r}: {data.shape} data needs --model PATH, a transformers folder "
            "whose tokenizer (and chat template) renders it; a preset trains on text"
        )
    return data.examples
