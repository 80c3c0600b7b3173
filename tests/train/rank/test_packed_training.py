"""mf-train on packed chat data: it learns, resumes exactly, and ``--no-pack`` still trains.

One process on a tiny ChatML folder: 6 AdamW steps on packed conversations
(a checkpoint at step 3), the last checkpoint removed as if the run had stopped
there, and a ``--resume`` that must give steps 4-6's losses and the final
validation loss of the unbroken run exactly (the rows are a pure function of the
data; their order of the seed and step). The same data under ``--no-pack``
trains too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mf.train.run.options import parse_options
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.train.data.chat_folders import random_conversations

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers")


def _losses(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _rank_packed(rank: int, world: int, argv: list[str], root: str) -> None:
    from mf.train.rank.worker import train

    tmp = Path(root)
    common = [*argv, "--ckpt-dir", str(tmp / "ckpt")]
    train(parse_options([*common, "--save-every", "3", "--out-dir", str(tmp / "a")]))
    shutil.rmtree(tmp / "ckpt" / "step_0000006")  # as if the run stopped at step 3
    train(parse_options([*common, "--resume", "--out-dir", str(tmp / "b")]))
    padded = ["--no-pack", "--save-every", "0", "--ckpt-dir", str(tmp / "padded-ckpt")]
    train(parse_options([*argv, *padded, "--out-dir", str(tmp / "padded")]))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_packed_chat_trains_and_resumes_exactly(chatml: Path, tmp_path: Path) -> None:
    data = random_conversations(tmp_path / "chat.jsonl", 40)
    argv = ["--model", str(chatml), "--data", str(data), "--device", "cpu", "--nproc", "1"]
    argv += ["--precision", "fp32", "--seq-len", "127", "--micro-batch", "2", "--steps", "6"]
    argv += ["--lr", "1e-2", "--eval-every", "3", "--sample-tokens", "0", "--no-plot"]
    run_on_ranks(_rank_packed, 1, argv, str(tmp_path), timeout=100)
    first, second = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert first[-1]["loss"] < 0.8 * first[0]["loss"]
    assert [r["step"] for r in second] == [4, 5, 6]
    assert [r["loss"] for r in second] == [r["loss"] for r in first[3:]]
    assert second[-1]["validation_loss"] == first[-1]["validation_loss"]
    padded = _losses(tmp_path / "padded")
    assert padded[-1]["loss"] < 0.8 * padded[0]["loss"]
