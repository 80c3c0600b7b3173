"""``mf-train --step-in-backward``: the optimizer stepped per bucket inside the backward.

At world 2 the ``tiny`` preset (ZeRO-2 and ZeRO-3, with and without
``--grad-accum 2``) and a tiny Llama folder (ZeRO-3, fully and with LoRA) give
the losses of the normal step, exactly: the engine steps each bucket with AdamW's own step on
those parameters, the arithmetic of one step of all. Each run with the option
is checked to have stepped inside the backward (mf-fsdp's per-bucket step was
called), so a run that ignored the option could not pass. A run resumed from
its step-3 checkpoint gives the unbroken run's losses. What the step in the
backward cannot serve is one line before any process starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from mf.train.exports.example_folder import make_llama_folder
from mf.train.run.options import parse_options
from tests._multiprocess import preload_in_ranks, run_on_ranks

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers")

STEPS = 6
_COMMON = ["--device", "cpu", "--seq-len", "32", "--micro-batch", "2", "--steps", str(STEPS)]
_COMMON += ["--eval-every", "3", "--sample-tokens", "0", "--no-plot", "--precision", "fp32"]
_COMMON += ["--lr", "1e-2", "--max-grad-norm", "0"]  # the step in the backward clips none


def _losses(out_dir: Path) -> list[float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _counting_bucket_steps() -> list[int]:
    """Count mf-fsdp's per-bucket steps (bound optimizers take it at binding)."""
    from mf_fsdp.optim import optimizer as optim_module

    calls = [0]
    step_some = optim_module.step_some

    def counted(*args, **kwargs):
        calls[0] += 1
        return step_some(*args, **kwargs)

    optim_module.step_some = counted
    return calls


def _rank_runs(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> None:
    from mf.train.rank.worker import train

    calls = _counting_bucket_steps()
    for name, argv in runs.items():
        before = calls[0]
        folders = ["--out-dir", f"{root}/{name}", "--ckpt-dir", f"{root}/{name}-ckpt"]
        train(parse_options([*argv, *folders]))
        stepped = calls[0] - before
        if "--step-in-backward" in argv:
            assert stepped >= STEPS, (name, stepped)  # at least one bucket per step
        else:
            assert stepped == 0, (name, stepped)
    dist.barrier()


def _pairs(base: list[str], variants: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each variant with the normal step and with the step in the backward."""
    runs = {}
    for name, extra in variants.items():
        runs[f"{name}-normal"] = [*base, *extra]
        runs[f"{name}-backward"] = [*base, *extra, "--step-in-backward"]
    return runs


_PRESET_VARIANTS = {
    "zero3": ["--zero", "3"],
    "zero2": ["--zero", "2"],
    "zero3-accum": ["--zero", "3", "--grad-accum", "2"],
}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_preset_step_in_backward_equals_the_normal_step(tmp_path: Path) -> None:
    """Planted: the learning rate set after the backward (the step inside it then
    takes the previous step's rate) fails at step 2; the option not passed to the
    engine fails the stepped-inside check."""
    base = [*_COMMON, "--model", "tiny", "--save-every", "0"]
    run_on_ranks(_rank_runs, 2, str(tmp_path), _pairs(base, _PRESET_VARIANTS), timeout=280)
    for name in _PRESET_VARIANTS:
        normal = _losses(tmp_path / f"{name}-normal")
        assert len(normal) == STEPS
        assert normal[-1] < normal[0]
        assert _losses(tmp_path / f"{name}-backward") == normal, name


_FOLDER_VARIANTS = {"folder": ["--zero", "3"], "lora": ["--zero", "3", "--lora-rank", "4"]}


def _rank_folder_and_resume(rank: int, world: int, root: str, base: list[str]) -> None:
    _rank_runs(rank, world, root, _pairs(base, _FOLDER_VARIANTS))
    if rank == 0:  # as if the run had stopped at its step-3 checkpoint
        shutil.rmtree(Path(root, "folder-backward-ckpt", f"step_{STEPS:07d}"))
    dist.barrier()
    from mf.train.rank.worker import train

    argv = [*base, "--zero", "3", "--step-in-backward", "--resume"]
    argv += ["--out-dir", f"{root}/resumed", "--ckpt-dir", f"{root}/folder-backward-ckpt"]
    train(parse_options(argv))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_folder_step_in_backward_equals_the_normal_step_and_resumes(tmp_path: Path) -> None:
    folder = make_llama_folder(tmp_path / "llama", corpus_chars=20_000)
    base = [*_COMMON, "--model", str(folder), "--save-every", "3"]
    run_on_ranks(_rank_folder_and_resume, 2, str(tmp_path), base, timeout=280)
    for name in _FOLDER_VARIANTS:
        normal = _losses(tmp_path / f"{name}-normal")
        assert len(normal) == STEPS
        assert _losses(tmp_path / f"{name}-backward") == normal, name
    normal = _losses(tmp_path / "folder-normal")
    assert normal[-1] < normal[0]
    assert _losses(tmp_path / "resumed") == normal[3:]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--zero", "1"],
            "--step-in-backward needs --zero 2 or 3, got --zero 1: each bucket is stepped on "
            "its reduced gradient shard, which ZeRO-0/1 do not keep",
        ),
        (
            ["--optimizer", "muon"],
            "--step-in-backward with --optimizer muon: each bucket is stepped on its own, which "
            "only an elementwise optimizer computes as one step of all; use --optimizer adamw",
        ),
        (
            [],
            "--step-in-backward with --max-grad-norm 1.0: each bucket is stepped inside the "
            "backward, before the gradients' total norm is known, so none can be clipped; pass "
            "--max-grad-norm 0 (clipping is on by default)",
        ),
    ],
)
def test_what_the_step_in_backward_cannot_serve_is_one_line(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="^--step-in-backward") as caught:
        parse_options(["--device", "cpu", "--model", "tiny", "--step-in-backward", *extra])
    assert str(caught.value) == message
