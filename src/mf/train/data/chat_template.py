"""A model folder's chat template: the folder's own, or ``--chat-template FILE``.

Conversations are rendered by transformers' ``apply_chat_template`` with the
template the folder ships (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja``), which transformers renders in its sandboxed Jinja
environment: no code from the folder runs. ``--chat-template FILE`` gives a
template (Jinja text) to a folder that has none, or replaces its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["read_chat_template", "use_chat_template"]


def use_chat_template(tokenizer: Any, template_file: str | None, data: str, shape: str) -> None:
    """Give ``tokenizer`` the template of ``template_file``; refuse conversations without one.

    Raises:
        ValueError: one line: the file cannot be read, or ``shape`` data for a
            tokenizer with no chat template.
    """
    if template_file is not None:
        tokenizer.chat_template = read_chat_template(template_file)
    if not tokenizer.chat_template:
        raise ValueError(
            f"--data {data!r} holds {shape} data, but the model folder has no chat template "
            "(chat_template in tokenizer_config.json, or chat_template.jinja) to render it; "
            "give one with --chat-template FILE"
        )


def read_chat_template(template_file: str) -> str:
    """The Jinja text of ``--chat-template FILE``.

    Raises:
        ValueError: one line: the file cannot be read as UTF-8 text.
    """
    try:
        return Path(template_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"--chat-template {template_file!r}: cannot read it as UTF-8 text ({error})"
        ) from None
