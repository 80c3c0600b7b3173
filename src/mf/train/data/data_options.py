"""The command-line options of what a run trains on: ``--data`` and how to read it.

Kept apart from ``mf.train.run.options`` so the data options have one home; its
parser adds them with ``add_data_options`` and checks them with ``check_data_options``.
"""

from __future__ import annotations

import argparse

from mf.train.settings import TrainOptions
from mf.train.sources.model_folder import ModelFolder

__all__ = ["add_data_options", "check_data_options"]


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--data`` and the options of reading it (``--text-field`` ... ``--no-pack``)."""
    add = parser.add_argument
    add(
        "--data",
        default=None,
        help="a UTF-8 text file (one document), or a .jsonl file of one JSON object per line: "
        "text, messages (a conversation), or prompt and completion (strings or messages); "
        "the shape is detected from the first line (default: the built-in corpus)",
    )
    add(
        "--text-field",
        default="text",
        help="the field of each --data .jsonl object that holds its document",
    )
    add(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to render conversations with, for a --model folder that "
        "has none (or to replace its own)",
    )
    add(
        "--train-on-prompt",
        action="store_true",
        help="with messages or prompt-completion data: count every token in the loss, not "
        "only the answers' (the assistant turns, the completion)",
    )
    add(
        "--no-pack",
        action="store_true",
        help="with messages or prompt-completion data: one example per sequence, padded, "
        "instead of several packed into each (kept apart: positions restart, no token "
        "attends to another example)",
    )


def check_data_options(options: TrainOptions, folder: ModelFolder | None) -> None:
    """Refuse the instruction-data options on a preset, which trains on byte text only.

    Raises:
        ValueError: ``--chat-template``, ``--train-on-prompt`` or ``--no-pack`` without
            ``--model PATH``.
    """
    given = [
        name
        for name, on in (
            ("--chat-template", options.chat_template is not None),
            ("--train-on-prompt", options.train_on_prompt),
            ("--no-pack", options.no_pack),
        )
        if on
    ]
    if folder is None and given:
        raise ValueError(
            f"{given[0]} is for --model PATH (a model folder's instruction data); "
            f"--model {options.model!r} is a preset, which trains on text"
        )
