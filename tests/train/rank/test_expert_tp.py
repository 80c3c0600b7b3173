"""``mf-train --ep 2 --etp 2``: the MoE GPT with experts split over (ep, etp) on 4 gloo ranks.

It trains like ``--ep 1 --etp 1`` (the same model and batches: the losses agree to
fp32 rounding), resumes exactly from its own checkpoint, and its safetensors export
holds every whole expert, which the plain one-process ``MoEGPT`` loads with
``strict=True``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from mf.models import MODEL_PRESETS
from mf.models.moe_gpt import MoEGPT
from mf.train.exports.export import EXPORT_FILE, load_model
from mf.train.rank.worker import train
from mf.train.run.options import parse_options
from tests._multiprocess import run_on_ranks
from tests.train.rank.test_worker import _metrics

_ARGV = ["--device", "cpu", "--model", "moe-tiny", "--seq-len", "32", "--micro-batch", "2"]
_ARGV += ["--nproc", "4", "--eval-every", "4", "--sample-tokens", "0", "--steps", "4"]


def _losses(out: Path) -> list[float]:
    return [record["loss"] for record in _metrics(out)]


def _rank_train_resume(rank: int, world: int, tmp: str) -> None:
    root = Path(tmp)
    etp = [*_ARGV, "--ep", "2", "--etp", "2", "--ckpt-dir", tmp + "/ckpt"]
    train(parse_options([*etp, "--save-every", "2", "--out-dir", tmp + "/a"]))
    train(parse_options([*_ARGV, "--ckpt-dir", tmp + "/plain_ckpt", "--out-dir", tmp + "/p"]))
    if rank == 0:
        shutil.rmtree(root / "ckpt" / "step_0000004")  # as if the run stopped at step 2
    dist.barrier()
    train(parse_options([*etp, "--resume", "--out-dir", tmp + "/b"]))
    if rank == 0:
        full, plain, resumed = _losses(root / "a"), _losses(root / "p"), _losses(root / "b")
        assert full[-1] < full[0]  # it learns
        assert full == pytest.approx(plain, abs=2e-5)  # the same model as whole experts
        assert [r["step"] for r in _metrics(root / "b")] == [3, 4]
        assert resumed == full[2:]  # exactly
        model = load_model(root / "a")
        assert type(model).__name__ == "MoEGPT"
        experts = model.blocks[0].moe.experts
        config = MODEL_PRESETS["moe-tiny"]
        assert experts.out_weight.shape == (config.num_experts, config.d_model, 128)
        MoEGPT(config).load_state_dict(load_file(root / "a" / EXPORT_FILE), strict=True)
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ep2_etp2_trains_like_ep1_resumes_exactly_and_exports_the_plain_model(
    tmp_path: Path,
) -> None:
    run_on_ranks(_rank_train_resume, 4, str(tmp_path), timeout=220)
