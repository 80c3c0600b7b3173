"""Packing instruction examples into sequences: which examples share a row, their positions.

``--seq-len`` rows of ``seq_len + 1`` tokens each hold several examples, placed
whole at the row's head one after the other, padding after them. Each example is
put in the row with the least room that still fits it, in file order (best fit;
a new row when none fits), so the layout is a pure function of the examples'
lengths: the run's seed, rank and step only order the rows
(``mf.train.data.tokenized.sequence_indices``), and a resumed run sees the same rows.

Each token's position counts from 0 at its example's first token; the padding
after the examples restarts at 0 too, a segment of its own. A position of 0 thus
marks where an example starts, which is all the model needs to keep the
examples apart (``mf.train.sources.example_mask``).
"""

from __future__ import annotations

import bisect

import torch

__all__ = ["pack_rows", "row_positions"]


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """The examples (indices into ``lengths``) of each row of ``capacity`` tokens, best fit.

    Every length must be between 1 and ``capacity``. Rows come in the order they
    were opened; the examples of a row in file order.
    """
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted: the first fit is the best
    for index, length in enumerate(lengths):
        place = bisect.bisect_left(rooms, (length, -1))
        if place == len(rooms):
            rows.append([index])
            room, row = capacity, len(rows) - 1
        else:
            room, row = rooms.pop(place)
            rows[row].append(index)
        if room > length:
            bisect.insort(rooms, (room - length, row))
    return rows


def row_positions(lengths: list[int], capacity: int) -> torch.Tensor:
    """A row's positions [capacity]: 0, 1, ... within each example, then within the padding."""
    parts = [torch.arange(length) for length in lengths]
    parts.append(torch.arange(capacity - sum(lengths)))
    return torch.cat(parts)
