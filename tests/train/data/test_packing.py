"""Packed instruction data: several examples a row, apart, counting what padding counts.

``pack_rows`` puts each example in the fullest row that still fits it, in file
order. Through ``training_data``, conversations of random lengths packed by
default must hold exactly the examples ``--no-pack`` pads, each whole in one row,
its positions restarting at 0; the target before each example's first token is
``IGNORED`` (the last token of one example never learns to predict the next
one's first), so the counted targets are the same tokens, packed or padded, with
or without ``--train-on-prompt``. Held-out examples never share a row with
training ones.

Planted: an example's first label left counted (``examples._encode``) fails the
boundary and count checks under ``--train-on-prompt``.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from mf.train.data.examples import IGNORED, ExampleData
from mf.train.data.packing import pack_rows
from mf.train.data.run_data import training_data
from mf.train.run.options import parse_options
from tests.train.data.chat_folders import random_conversations

_SEQ_LEN = 127


def test_best_fit_in_file_order() -> None:
    assert pack_rows([5, 3, 7, 2, 4], 8) == [[0, 1], [2], [3, 4]]
    draw = random.Random(0)
    lengths = [draw.randint(1, 50) for _ in range(300)]
    rows = pack_rows(lengths, 50)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert all(sum(lengths[i] for i in row) <= 50 and row == sorted(row) for row in rows)
    assert rows == pack_rows(lengths, 50)  # a pure function of the lengths


def _data(folder: Path, path: Path, *extra: str) -> tuple[ExampleData, str]:
    argv = ["--model", str(folder), "--data", str(path), "--device", "cpu"]
    data, name = training_data(parse_options([*argv, "--seq-len", str(_SEQ_LEN), *extra]))
    assert isinstance(data, ExampleData)
    return data, name


def _examples(data: ExampleData, split: str) -> list[tuple[int, ...]]:
    """The examples of the training or held-out rows, in row order."""
    trained = len(data.rows) - data.held_out
    indices = range(trained) if split == "train" else range(trained, len(data.rows))
    found = []
    for index in indices:
        tokens, length = data.rows[index].tolist(), int(data.lengths[index])
        if data.positions is None:
            found.append(tuple(tokens[:length]))
            continue
        starts = (data.positions[index, :length] == 0).nonzero().flatten().tolist()
        for start, end in zip(starts, [*starts[1:], length], strict=True):
            assert data.positions[index, start:end].tolist() == list(range(end - start))
            found.append(tuple(tokens[start:end]))
    return found


def _counted(data: ExampleData) -> Counter:
    targets = data.labels[:, 1:]
    return Counter(targets[targets != IGNORED].tolist())


@pytest.mark.parametrize("extra", [[], ["--train-on-prompt"]])
def test_packed_rows_hold_the_padded_examples_apart(
    chatml: Path, tmp_path: Path, extra: list[str]
) -> None:
    path = random_conversations(tmp_path / "chat.jsonl", 40)
    packed, name = _data(chatml, path, *extra)
    padded, padded_name = _data(chatml, path, "--no-pack", *extra)
    for split in ("train", "validation"):
        assert Counter(_examples(packed, split)) == Counter(_examples(padded, split)), split
    assert len(packed.rows) < 0.6 * len(padded.rows)
    assert _counted(packed) == _counted(padded)  # the same targets, token for token
    assert packed.counted_tokens() == padded.counted_tokens()
    assert packed.positions is not None
    starts = packed.positions[:, 1:] == 0  # an example starts here, not at the row's head
    assert (packed.labels[:, 1:][starts] == IGNORED).all()
    assert packed.real_fraction() > 1.5 * padded.real_fraction()
    trained = len(packed.rows) - packed.held_out
    assert f"40 examples packed into {trained} sequences, " in name
    assert f"{packed.real_fraction():.1%} real tokens" in name
    assert f"{padded.real_fraction():.1%} real tokens" in padded_name

    inputs, targets, positions = packed.batch("train", 0, 0, 0, 1, 2, _SEQ_LEN)
    assert inputs.shape == targets.shape == positions.shape == (2, _SEQ_LEN)
    assert len(padded.batch("train", 0, 0, 0, 1, 2, _SEQ_LEN)) == 2  # no positions
