"""Data for a transformers model folder: its tokenizer, packed sequences, a fixed order.

The folder's tokenizer (``AutoTokenizer``, offline) turns each document into
tokens; the documents are concatenated with the tokenizer's EOS token after
each, and the last 10% of that stream is held out for validation, as for the
byte presets. Each split is packed into sequences of ``--seq-len + 1`` tokens
that overlap by one (the inputs and their next-token targets), no token left
out but the stream's tail.

The order is a pure function of (seed, step, rank): training sequence ``k`` of
the run (``k = step * global batch + rank * micro-batch + row``) is the
``k mod n``-th of epoch ``k // n``'s permutation of the ``n`` sequences, drawn
from the seed and the epoch. So every sequence is seen once per epoch, and a run
resumed at any step, mid-epoch included, sees the batches an unbroken one sees.
Validation takes the held-out sequences in order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from mf.train.sources.model_folder import ModelFolder

__all__ = ["TokenData", "TokenizerCodec", "epoch_order", "load_tokenizer", "sequence_indices"]

_VALIDATION_FRACTION = 0.1


def load_tokenizer(folder: ModelFolder) -> Any:
    """The folder's tokenizer, offline; one line when there is none or it cannot serve.

    Raises:
        ValueError: no tokenizer transformers can load, one without an EOS token,
            or one with more tokens than the model's embedding has rows.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder.path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"--model {str(folder.path)!r}: no tokenizer AutoTokenizer can load ({first}); "
            "expected tokenizer.json or the tokenizer files of the model"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--model {str(folder.path)!r}: its tokenizer has no EOS token, which mf-train "
            "puts between documents; expected eos_token in tokenizer_config.json"
        )
    vocab = int(folder.config.vocab_size)
    if len(tokenizer) > vocab:
        raise ValueError(
            f"--model {str(folder.path)!r}: its tokenizer has {len(tokenizer)} tokens, more than "
            f"the model's {vocab} (vocab_size in config.json)"
        )
    return tokenizer


class TokenizerCodec:
    """``encode`` and ``decode`` through the folder's tokenizer (``self.tokenizer``)."""

    tokenizer: Any

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as the tokenizer's tokens (no special tokens added)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        """Tokens back to text."""
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        return self.tokenizer.decode(values)


def sequence_indices(
    split: str, step: int, seed: int, rank: int, world_size: int, micro_batch: int, count: int
) -> list[int]:
    """Which of ``count`` sequences make this rank's rows of ``step`` (see the module docstring).

    Training takes epoch-wise permutations drawn from the seed; validation the
    sequences in order.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    first = (step * world_size + rank) * micro_batch
    indices = []
    for k in range(first, first + micro_batch):
        epoch, place = divmod(k, count)
        indices.append(int(epoch_order(seed, epoch, count)[place]) if split == "train" else place)
    return indices


@dataclass(frozen=True)
class TokenData(TokenizerCodec):
    """A tokenized corpus, split and packed, with the tokenizer that made it."""

    train: torch.Tensor
    validation: torch.Tensor
    tokenizer: Any = field(repr=False)

    @classmethod
    def from_documents(cls, documents: list[str], tokenizer: Any, seq_len: int) -> TokenData:
        """Tokenize the documents (EOS after each) and hold out the last 10% of the tokens.

        Raises:
            ValueError: if either split is shorter than one sequence of ``seq_len + 1``.
        """
        eos = tokenizer.eos_token_id
        encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
        stream = torch.tensor([t for ids in encoded for t in (*ids, eos)], dtype=torch.long)
        split = int(len(stream) * (1 - _VALIDATION_FRACTION))
        data = cls(stream[:split], stream[split:], tokenizer)
        shortest = min(len(data.train), len(data.validation))
        if shortest < seq_len + 1:
            raise ValueError(
                f"--seq-len {seq_len} is too long for the corpus: its {len(stream)} tokens give "
                f"a validation split of {len(data.validation)}; use --seq-len below {shortest}"
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
        """This rank's (inputs, targets), each [micro_batch, seq_len], for ``step``."""
        tokens = self.train if split == "train" else self.validation
        count = (len(tokens) - 1) // seq_len
        indices = sequence_indices(split, step, seed, rank, world_size, micro_batch, count)
        windows = torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in indices])
        return windows[:, :-1], windows[:, 1:]


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, count: int) -> torch.Tensor:
    """Epoch ``epoch``'s permutation of ``count`` training sequences, from the seed alone."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**62))
    return torch.randperm(count, generator=generator)
