"""Conversations of random questions and one fixed answer, for the chat export tests.

The answer is learnable and the questions are not, so a few steps teach a tiny
model to answer any question with it and then end its turn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["ANSWER", "fixed_answer_chats"]

ANSWER = "the same answer"


def fixed_answer_chats(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` conversations: a random-letter question, then ``ANSWER``; JSON lines."""
    draw = random.Random(seed)
    lines = []
    for _ in range(count):
        question = "".join(draw.choice("abcdefghijklmnop") for _ in range(8))
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": ANSWER}]
        lines.append(json.dumps({"messages": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path
