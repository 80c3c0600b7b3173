"""``mf-train --precision fp8``: float8 linears (torchao) on 2 gloo CPU ranks.

- the ``tiny`` preset learns as its bf16 run does (a short run here; the ``small``
  preset's 600-step gap is measured in docs/low-precision.md) while computing
  something else, so the float8 matmuls really ran. ``tiny``, because some CPUs run
  ``torch._scaled_mm`` hundreds of times slower than a bf16 matmul (a 256-cube: 0.6 s
  against 3 ms on a Xeon with AMX, torch 2.11 and 2.15), where the ``small`` preset
  takes 30 s a step;
- it resumes exactly, and its export loads into the plain GPT (``strict=True``);
- what it cannot run is refused in one line before any worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mf.models import GPT
from mf.train.exports.export import load_model
from mf.train.rank.worker import train
from mf.train.run import options as options_module
from mf.train.run.options import parse_options
from mf_fsdp import checkpoint_to_full_state_dict, latest_checkpoint
from tests._float8 import needs_cpu_float8
from tests._multiprocess import run_on_ranks
from tests.train.rank.test_worker import _rank_train_then_resume

_TINY = ["--device", "cpu", "--model", "tiny", "--seq-len", "64", "--micro-batch", "2"]
_TINY += ["--steps", "40", "--eval-every", "20", "--eval-batches", "8"]
_TINY += ["--sample-tokens", "0", "--save-every", "0"]
LOSS_RTOL = 0.03
"""How far fp8's final validation loss may be from bf16's (relative)."""


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _rank_fp8_like_bf16(rank: int, world_size: int, tmp: str) -> None:
    for precision in ("bf16", "fp8"):
        out = f"{tmp}/{precision}"
        argv = [*_TINY, "--precision", precision, "--out-dir", out, "--ckpt-dir", out + "/c"]
        train(parse_options(argv))
    if rank == 0:
        bf16, fp8 = _records(Path(tmp, "bf16")), _records(Path(tmp, "fp8"))
        losses = [[r["loss"] for r in run] for run in (bf16, fp8)]
        assert losses[1] != losses[0]  # the float8 matmuls ran: they round otherwise than bf16
        assert losses[1][-1] < losses[1][0] - 1.5  # it learns (5.5 at the start)
        end_bf16, end_fp8 = bf16[-1]["validation_loss"], fp8[-1]["validation_loss"]
        assert abs(end_fp8 - end_bf16) <= LOSS_RTOL * end_bf16, (end_fp8, end_bf16)
    dist.barrier()


@needs_cpu_float8
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fp8_trains_the_tiny_preset_like_bf16(tmp_path: Path) -> None:
    run_on_ranks(_rank_fp8_like_bf16, 2, str(tmp_path), timeout=280)


def _rank_resume_and_export(rank: int, world_size: int, tmp: str) -> None:
    _rank_train_then_resume(rank, world_size, tmp, "3", "--precision", "fp8")
    if rank == 0:
        model = load_model(tmp + "/b")  # the export of the resumed run, strict=True
        assert type(model) is GPT
        assert not any("Float8" in type(m).__name__ for m in model.modules())
        saved = checkpoint_to_full_state_dict(latest_checkpoint(Path(tmp, "ckpt")))
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), name
    dist.barrier()


@needs_cpu_float8
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_fp8_resumes_exactly_and_exports_the_plain_gpt(tmp_path: Path) -> None:
    run_on_ranks(_rank_resume_and_export, 2, str(tmp_path), timeout=130)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tp", "2"],
            "--precision fp8 with --tp 2: torchao's float8 converts nn.Linear layers, and the "
            "tensor-parallel GPT's are mf-tp's column and row layers; use --tp 1 (FSDP over "
            "every rank), or --precision bf16 with --tp",
        ),
        (
            ["--model", "moe-tiny"],
            "--precision fp8 is for the dense GPT presets; --model 'moe-tiny' is a mixture "
            "of experts",
        ),
    ],
)
def test_what_fp8_cannot_run_is_one_line(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="^--precision fp8") as caught:
        parse_options(["--device", "cpu", "--precision", "fp8", *extra])
    assert str(caught.value) == message


def test_a_device_without_fp8_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def no_fp8(device: torch.device) -> str:
        seen.append(device)
        return "the GPU X (sm_80) has no FP8 matmul"

    monkeypatch.setattr(options_module, "float8_unavailable", no_fp8)
    with pytest.raises(ValueError, match=r"^--precision fp8: the GPU X \(sm_80\) has no FP8"):
        parse_options(["--device", "cpu", "--precision", "fp8"])
    assert seen == [torch.device("cpu")]
