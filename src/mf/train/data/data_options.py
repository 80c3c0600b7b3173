"""The command-line options of what a run trains on: ``--data`` and how to read it.

Kept apart from ``mf.train.run.options`` so the data options have one home; its
parser adds them with ``add_data_options``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_data_options"]


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--data``, ``--text-field``, ``--chat-template`` and ``--train-on-prompt``."""
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
