"""Instruction data for a model folder: packed examples, the loss on their answers.

Each example of a messages or prompt-completion file (``mf.train.data.formats``)
becomes its tokens and answer mask (``mf.train.data.answer_masks``). Its targets
are the next tokens where they are answers (every real token under
``--train-on-prompt``) and ``-100``, which the loss ignores, elsewhere: padding,
and an example's first token, which nothing of the example predicts. An example
longer than ``--seq-len + 1`` tokens is refused before the run starts, naming its line.

By default the examples are packed (``mf.train.data.packing``): a row of
``--seq-len + 1`` tokens holds several, each row's positions restart at every
example, and the batches carry those positions so the model keeps the examples
apart (no token attends to another example's). ``--no-pack`` pads each example on
the right to a row of its own, as before; the causal attention of a real token
never sees the padding after it. Either way the same tokens are counted.

The last 10% of the examples (at least one) are held out for validation, packed
apart; the order of the training rows is ``mf.train.data.tokenized``'s, a pure
function of (seed, step, rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mf.train.data.answer_masks import answer_mask
from mf.train.data.formats import Conversation, DataFile, PromptCompletion
from mf.train.data.packing import pack_rows, row_positions
from mf.train.data.tokenized import TokenizerCodec, sequence_indices

__all__ = ["IGNORED", "ExampleData"]

IGNORED = -100
"""The target of a token the loss does not count (``F.cross_entropy``'s ``ignore_index``)."""

_VALIDATION_FRACTION = 0.1


@dataclass(frozen=True)
class ExampleData(TokenizerCodec):
    """Example rows [n, seq_len + 1], their targets and positions, and how many are held out."""

    rows: torch.Tensor
    labels: torch.Tensor
    """The row's token where the loss counts it as a target, else ``IGNORED``."""
    lengths: torch.Tensor
    """Each row's real tokens: its examples', at its head; padding after them."""
    held_out: int
    """The last rows, the held-out examples'."""
    tokenizer: Any = field(repr=False)
    positions: torch.Tensor | None = None
    """Packed rows' positions, restarting at each example; None when each row holds one."""

    @classmethod
    def from_file(
        cls, data: DataFile, tokenizer: Any, seq_len: int, train_on_prompt: bool, pack: bool = True
    ) -> ExampleData:
        """Tokenize and mask every example of ``data``; pack them into rows (or pad each).

        Raises:
            ValueError: one line naming the example's line: the template cannot
                render it, or it is longer than ``seq_len + 1`` tokens.
        """
        examples = [_encode(tokenizer, e, seq_len, train_on_prompt) for e in data.examples]
        held_out = max(1, int(len(examples) * _VALIDATION_FRACTION))
        split = len(examples) - held_out
        lengths = [len(ids) for ids, _ in examples]
        layout = [[index] for index in range(len(examples))]
        if pack:  # training and held-out examples never share a row
            layout = pack_rows(lengths[:split], seq_len + 1)
            layout += [[split + i for i in row] for row in pack_rows(lengths[split:], seq_len + 1)]
        pad = tokenizer.pad_token_id
        pad = tokenizer.eos_token_id if pad is None else pad
        rows = torch.full((len(layout), seq_len + 1), pad, dtype=torch.long)
        labels = torch.full_like(rows, IGNORED)
        for row, members in enumerate(layout):
            ids = torch.cat([examples[i][0] for i in members])
            rows[row, : len(ids)] = ids
            labels[row, : len(ids)] = torch.cat([examples[i][1] for i in members])
        filled = torch.tensor([sum(lengths[i] for i in row) for row in layout], dtype=torch.long)
        positions = None
        if pack:
            positions = torch.stack(
                [row_positions([lengths[i] for i in row], seq_len + 1) for row in layout]
            )
        validation_rows = sum(1 for row in layout if row[0] >= split)
        return cls(rows, labels, filled, validation_rows, tokenizer, positions)

    def real_fraction(self) -> float:
        """The share of the training rows' tokens that are examples', not padding."""
        trained = len(self.rows) - self.held_out
        return float(self.lengths[:trained].sum()) / (trained * self.rows.shape[1])

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
    ) -> tuple[torch.Tensor, ...]:
        """This rank's (inputs, targets), each [micro_batch, seq_len], for ``step``.

        Targets the loss does not count are ``IGNORED``. Packed rows add their
        inputs' positions [micro_batch, seq_len], restarting at each example.
        """
        trained = len(self.rows) - self.held_out
        first, count = (trained, self.held_out) if split == "validation" else (0, trained)
        places = sequence_indices(split, step, seed, rank, world_size, micro_batch, count)
        indices = [first + place for place in places]
        inputs, targets = self.rows[indices, :-1], self.labels[indices, 1:]
        if self.positions is None:
            return inputs, targets
        return inputs, targets, self.positions[indices, :-1]


def _encode(
    tokenizer: Any, example: Conversation | PromptCompletion, seq_len: int, train_on_prompt: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """An example's tokens and labels (``IGNORED`` where not counted, and at its first token).

    Raises:
        ValueError: the example is longer than ``seq_len + 1`` tokens (one line, its line).
    """
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
    labels = torch.where(counted, ids, IGNORED)
    labels[0] = IGNORED  # packed, the token before it is another example's
    return ids, labels
