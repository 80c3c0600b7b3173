"""Text data for ``mf-train``: a corpus, a byte tokenizer and deterministic batches.

The default corpus is the Python Language Reference that ships inside every
CPython (``pydoc_data.topics``, PSF licence, about 465 KB of English prose
and code), so the first run needs no download. ``--data PATH`` trains on the
user's own UTF-8 text file (or JSON lines, ``mf.train.data.documents``)
instead. Bytes are the tokens (vocabulary 256),
so any text works without a tokenizer to fit or ship.

Batches are a pure function of (seed, step, rank): a resumed run draws the
same batches as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mf.train.data.documents import read_documents

__all__ = [
    "BUILTIN_CORPUS",
    "BYTES",
    "VOCAB_SIZE",
    "ByteCodec",
    "TextData",
    "builtin_documents",
    "decode",
    "encode",
    "load_corpus",
]

VOCAB_SIZE = 256
BUILTIN_CORPUS = "the Python Language Reference (pydoc_data.topics)"
_VALIDATION_FRACTION = 0.1


def encode(text: str) -> torch.Tensor:
    """Turn text into a 1-D int64 tensor of its UTF-8 bytes."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Turn byte tokens back into text (invalid UTF-8 sequences are replaced)."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(values).decode("utf-8", errors="replace")


def builtin_documents() -> list[str]:
    """The built-in corpus: the Language Reference's topics, in name order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _builtin_corpus() -> str:
    return "\n\n".join(builtin_documents())


def load_corpus(path: str | None, text_field: str = "text") -> tuple[str, str]:
    """Return (text, description) of the user's file at ``path``, or of the built-in corpus.

    A JSONL file's documents (``mf.train.data.documents``) are joined by blank lines.

    Raises:
        ValueError: if the file does not exist, is not a file, is empty, is not UTF-8,
            or has a bad JSONL line.
    """
    if path is None:
        return _builtin_corpus(), BUILTIN_CORPUS
    return "\n\n".join(read_documents(path, text_field)), str(Path(path))


class ByteCodec:
    """Bytes as tokens: ``encode`` and ``decode`` as methods (a tokenizer's interface)."""

    encode = staticmethod(encode)
    decode = staticmethod(decode)


BYTES = ByteCodec()


@dataclass(frozen=True)
class TextData(ByteCodec):
    """A tokenized corpus split into training and held-out validation tokens."""

    train: torch.Tensor
    validation: torch.Tensor

    @classmethod
    def from_text(cls, text: str, seq_len: int) -> TextData:
        """Tokenize ``text`` and hold out its last 10% for validation.

        Raises:
            ValueError: if either split is shorter than one sequence of ``seq_len + 1`` tokens.
        """
        tokens = encode(text)
        split = int(len(tokens) * (1 - _VALIDATION_FRACTION))
        data = cls(tokens[:split], tokens[split:])
        shortest = min(len(data.train), len(data.validation))
        if shortest < seq_len + 1:
            raise ValueError(
                f"--seq-len {seq_len} is too long for the corpus: its {len(tokens)} tokens give a "
                f"validation split of {len(data.validation)}; use --seq-len below {shortest}"
            )
        return data

    def batch(
        self,
        split: str,
        step: int,
        seed: int,
        rank: int,
        world_size: int,
        micro_batch: int,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's (inputs, targets), each [micro_batch, seq_len], for ``step``.

        The global batch of ``world_size * micro_batch`` windows is drawn from a
        generator seeded by (seed, step, split); each rank takes its own rows.
        """
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        tokens = self.train if split == "train" else self.validation
        # No hash(): string hashing is salted per process, and every rank must agree.
        stream = (seed * 1_000_003 + step) * 2 + (split == "validation")
        generator = torch.Generator().manual_seed(stream % (2**62))
        starts = torch.randint(
            0, len(tokens) - seq_len, (world_size * micro_batch,), generator=generator
        )[rank * micro_batch : (rank + 1) * micro_batch]
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
