"""Which global sequence positions each rank of a context-parallel group holds.

Responsibility: pure index math for :func:`mf_tp.context_parallel`. A
sequence of ``S`` positions over ``N`` ranks is cut into equal chunks:

- balanced (``S`` divisible by ``2N``): ``2N`` chunks of ``S / 2N``; rank
  ``r`` holds chunk ``r`` and chunk ``2N - 1 - r`` (the "head-tail" or
  2N-chunk round-robin split). Under a causal mask the work of a query chunk
  grows with its index, so pairing an early chunk with its mirror gives every
  rank the same number of attended (query, key) pairs::

      S = 8, N = 2, chunks of 2:  rank 0 holds chunks 0 and 3 -> positions 0 1 6 7
                                  rank 1 holds chunks 1 and 2 -> positions 2 3 4 5

- contiguous (``S`` divisible by ``N`` only): ``N`` chunks, rank ``r`` holds
  chunk ``r``. Fine without a mask; causal attention refuses it (rank ``N-1``
  would do ``2N - 1`` times the work of rank 0).

The choice depends on ``S`` and ``N`` alone, so the buffers sharded on entry
and the attention call that later sees ``S / N`` local positions agree on it
without being told.

It must not: communicate, or hold state beyond its three numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SequenceLayout"]


@dataclass(frozen=True, slots=True)
class SequenceLayout:
    """The chunks of a ``seq_len`` sequence over a ``world_size`` context-parallel group.

    Attributes:
        seq_len: the global sequence length ``S``.
        world_size: the context-parallel size ``N``.
        balanced: ``2N`` head-tail chunks (True) or ``N`` contiguous chunks.
    """

    seq_len: int
    world_size: int
    balanced: bool

    @classmethod
    def of(cls, seq_len: int, world_size: int, *, where: str) -> SequenceLayout:
        """The layout of ``seq_len`` positions over ``world_size`` ranks (balanced when it can).

        Raises:
            ValueError: if ``seq_len`` is not a positive multiple of ``world_size``.
        """
        if seq_len < 1 or seq_len % world_size != 0:
            raise ValueError(
                f"{where}: a sequence length of {seq_len} cannot be split over a "
                f"context-parallel group of {world_size}; expected a positive multiple of "
                f"{world_size} (of {2 * world_size} for load-balanced causal attention)"
            )
        return cls(seq_len, world_size, balanced=seq_len % (2 * world_size) == 0)

    @property
    def chunks_per_rank(self) -> int:
        """How many chunks each rank holds: 2 balanced, 1 contiguous."""
        return 2 if self.balanced else 1

    @property
    def num_chunks(self) -> int:
        """How many chunks the sequence is cut into."""
        return self.world_size * self.chunks_per_rank

    @property
    def chunk_len(self) -> int:
        """Positions per chunk."""
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        """Positions per rank, ``S / N``."""
        return self.seq_len // self.world_size

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices rank ``rank`` holds, in its local order."""
        if self.balanced:
            return (rank, self.num_chunks - 1 - rank)
        return (rank,)

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions rank ``rank`` holds, in its local order: int64 ``[S / N]``."""
        size = self.chunk_len
        return torch.cat(
            [torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks(rank)]
        )

    def gathered_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of the ranks' shards laid end to end in rank order: ``[S]``."""
        return torch.cat([self.positions(rank, device) for rank in range(self.world_size)])
