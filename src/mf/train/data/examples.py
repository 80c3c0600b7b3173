"""Instruction data for a model folder: one example per sequence, the loss on its answers.

Each example of a messages or prompt-completion file (``mf.train.data.formats``)
becomes its tokens and answer mask (``mf.train.data.answer_masks``), padded on
the right to ``--seq-len + 1`` tokens. Its targets are the next tokens where they
are answers (every real token under ``--train-on-prompt``) and ``-100``, which
the loss ignores, elsewhere, padding included: the causal attention of a real
token never sees the padding after it. An example longer than ``--seq-len + 1``
tokens is refused before the run starts, naming its line.

The last 10% of the examples (at least one) are held out for validation; the
order of the rest is ``mf.train.data.tokenized``'s, a pure function of
(seed, step, rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mf.train.data.answer_masks import answer_mask
from mf.train.data.formats import DataFile
from mf.train.data.tokenized import TokenizerCodec, sequence_indices

__all__ = ["IGNORED", "ExampleData"]

IGNORED = -100
"""The target of a token the loss does not count (``F.cross_entropy``'s ``ignore_index``)."""

_VALIDATION_FRACTION = 0.1


@dataclass(frozen=True)
class ExampleData(TokenizerCodec):
    """Padded example rows [n, seq_len + 1], their targets, and how many are held out."""

    rows: torch.Tensor
    labels: torch.Tensor
    """The row's token where the loss counts it as a target, else ``IGNORED``."""
    lengths: torch.Tensor
    held_out: int
    tokenizer: Any = field(repr=False)

    @classmethod
    def from_file(
        cls, data: DataFile, tokenizer: Any, seq_len: int, train_on_prompt: bool
    ) -> ExampleData:
        """Tokenize and mask every example of ``data``, pad each to ``seq_len + 1``.

        Raises:
            ValueError: one line naming the example's line: the template cannot
                render it, or it is longer than ``seq_len + 1`` tokens.
        """
        pad = tokenizer.pad_token_id
        pad = tokenizer.eos_token_id if pad is None else pad
        rows = torch.full((len(data.examples), seq_len + 1), pad, dtype=torch.long)
        labels = torch.full_like(rows, IGNORED)
        lengths = torch.zeros(len(data.examples), dtype=torch.long)
        for index, example in enumerate(data.examples):
            tokens, mask = answer_mask(tokenizer, example)
            if len(tokens) > seq_len + 1:
                raise ValueError(
                    f"{example.where}: the example is {len(tokens)} tokens, longer than "
                    f"--seq-len {seq_len} allows ({seq_len + 1}); raise --seq-len or shorten it"
                )
            ids = torch.tensor(tokens, dtype=torch.long)
            counted = torch.ones(len(ids), dtype=torch.bool)
            if not train_on_prompt:
                counted = torch.tensor(mask, dtype=torch.bool)
            rows[index, : len(ids)] = ids
            labels[index, : len(ids)] = torch.where(counted, ids, IGNORED)
            lengths[index] = len(ids)
        held_out = max(1, int(len(rows) * _VALIDATION_FRACTION))
        return cls(rows, labels, lengths, held_out, tokenizer)

    @property
    def train(self) -> torch.Tensor:
        """The training examples' tokens, padding left out, one after the other."""
        return self._tokens(slice(0, len(self.rows) - self.held_out))

    @property
    def validation(self) -> torch.Tensor:
        """The held-out examples' tokens, padding left out, one after the other."""
        return self._tokens(slice(len(self.rows) - self.held_out, len(self.rows)))

    def _tokens(self, split: slice) -> torch.Tensor:
        rows, lengths = self.rows[split], self.lengths[split].tolist()
        return torch.cat([row[:length] for row, length in zip(rows, lengths, strict=True)])

    def counted_tokens(self) -> int:
        """The training examples' tokens the loss counts (as targets)."""
        return int((self.labels[: len(self.rows) - self.held_out, 1:] != IGNORED).sum())

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
        """This rank's (inputs, targets), each [micro_batch, seq_len], for ``step``.

        Targets the loss does not count are ``IGNORED``.
        """
        trained = len(self.rows) - self.held_out
        first, count = (trained, self.held_out) if split == "validation" else (0, trained)
        places = sequence_indices(split, step, seed, rank, world_size, micro_batch, count)
        indices = [first + place for place in places]
        return self.rows[indices, :-1], self.labels[indices, 1:]
