"""The loss on answers is the mean over the answer tokens of the whole global batch.

Conversations whose prompts and answers have random lengths, packed several to a
row (the default), so every rank and micro-batch holds another count of answer
tokens, train on a tiny ChatML folder
with plain SGD (its steps follow the gradient's scale and weighting, where Adam's
first steps would hide them) at world 2 under ZeRO-3 with ``--grad-accum 2``,
ZeRO-0 with ``--grad-accum 2``, ZeRO-1, ZeRO-2 with ``--grad-accum 2``, and HSDP
(``--dp-outer 2``). Each must equal one
process running transformers' own model on the global batch of four sequences,
its loss the mean over all their answer tokens: the losses of 4 steps to 1e-5
and the exported weights to 1e-5. The reference gives transformers the rows'
restarted positions only, and transformers keeps the packed examples apart itself
(``find_packed_sequence_indices``; only without a cache: ``use_cache=False``),
independently of mf's mask. The gradients are clipped (``--max-grad-norm``, below
every step's norm, so each step is clipped): the logged ``grad_norm`` equals the
reference's total norm before clipping to 1e-5, and the clipped updates are in
the weights.

Planted: each micro-batch's own mean divided by ``--grad-accum`` (the loss
before global normalisation) misses the first loss by 2e-3 and the fourth by 12%.
Each rank clipping by its own shard's norm (no reduction over the ranks) misses
the logged norms and the second loss.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mf.train.run.options import parse_options
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.train.data.chat_folders import random_conversations

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers")

STEPS = 4
TOLERANCE = 1e-5
_COMMON = ["--device", "cpu", "--precision", "fp32", "--seq-len", "96", "--lr", "0.5"]
_COMMON += ["--steps", str(STEPS), "--eval-every", "2", "--sample-tokens", "0", "--no-plot"]
_COMMON += ["--max-grad-norm", "0.5"]
_VARIANTS = {
    "accum2": ["--zero", "3", "--grad-accum", "2", "--micro-batch", "1"],
    "zero0": ["--zero", "0", "--grad-accum", "2", "--micro-batch", "1"],
    "zero1": ["--zero", "1", "--micro-batch", "2"],
    "zero2": ["--zero", "2", "--grad-accum", "2", "--micro-batch", "1"],
    "hsdp": ["--zero", "3", "--dp-outer", "2", "--micro-batch", "2"],
}


def _sgd(recipe: str, module: torch.nn.Module, lr: float, weight_decay: float) -> list:
    return [torch.optim.SGD(module.parameters(), lr=lr)]


def _rank_variants(rank: int, world: int, argv: list[str], root: str) -> None:
    from mf.train.adapters import run_module
    from mf.train.rank.worker import train

    run_module.build_optimizers = _sgd  # plain SGD in place of the adamw recipe
    for name, extra in _VARIANTS.items():
        folders = ["--out-dir", f"{root}/{name}", "--ckpt-dir", f"{root}/{name}-ckpt"]
        train(parse_options([*argv, *folders, *extra]))


def _reference(
    folder: Path, argv: list[str]
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """transformers' model on one process, SGD on the mean over the global batch's answers.

    Its gradients clipped by torch's ``clip_grad_norm_``; returns the losses, the
    norms before clipping and the weights.
    """
    from transformers import AutoModelForCausalLM

    from mf.train.data.run_data import training_data
    from mf.train.rank.step import _learning_rate

    options = parse_options([*argv, "--nproc", "1", "--micro-batch", "4"])
    data, _ = training_data(options)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=options.lr)
    losses, norms, counts = [], [], set()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(options, step)
        batch = data.batch("train", step, options.seed, 0, 1, 4, options.seq_len)
        inputs, targets, positions = batch  # packed rows
        counts.add(tuple((targets != -100).sum(1).tolist()))
        logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # ignores -100
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), options.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    assert all(len(set(rows)) > 1 for rows in counts)  # unequal answer counts per row
    assert min(norms) > options.max_grad_norm  # every step clipped
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_world_2_and_grad_accum_equal_one_process_on_the_global_batch(
    chatml: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    data = random_conversations(tmp_path / "chat.jsonl", 20)
    argv = [*_COMMON, "--model", str(chatml), "--data", str(data), "--save-every", "0"]
    run_on_ranks(_rank_variants, 2, [*argv, "--nproc", "2"], str(tmp_path), timeout=280)
    losses, norms, weights = _reference(chatml, argv)
    assert min(losses[1:]) < losses[0]  # it learns (each step sees other rows)
    for name in _VARIANTS:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        got = [json.loads(line)["loss"] for line in lines]
        assert got == pytest.approx(losses, rel=TOLERANCE), name
        logged = [json.loads(line)["grad_norm"] for line in lines]
        assert logged == pytest.approx(norms, rel=TOLERANCE), name
        exported = load_file(tmp_path / name / "model" / "model.safetensors")
        for key, value in weights.items():
            if key in exported:
                torch.testing.assert_close(
                    exported[key], value, rtol=TOLERANCE, atol=TOLERANCE, msg=f"{name} {key}"
                )


def _rank_learn(rank: int, world: int, argv: list[str], root: str) -> None:
    from mf.train.rank.worker import train

    for name, extra in {"answers": [], "everything": ["--train-on-prompt"]}.items():
        folders = ["--out-dir", f"{root}/{name}", "--ckpt-dir", f"{root}/{name}-ckpt"]
        train(parse_options([*argv, *folders, *extra]))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_answer_only_training_learns_the_answer(chatml: Path, tmp_path: Path) -> None:
    """Random-letter prompts, one fixed answer: its loss falls far below the whole text's.

    The answer is learnable, the prompts are not: with the loss on the answers it
    falls near zero (5.69 to 0.03 in 40 steps when written); counting the prompts
    too, it stays near the letters' entropy (5.76 to 1.81).
    """
    draw = random.Random(0)
    lines = []
    for _ in range(64):
        prompt = "".join(draw.choice("abcdefghijklmnop") for _ in range(16))
        lines.append(json.dumps({"prompt": prompt + " =", "completion": " the same answer"}))
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    argv = ["--device", "cpu", "--precision", "fp32", "--seq-len", "48", "--micro-batch", "8"]
    argv += ["--steps", "40", "--lr", "1e-2", "--eval-every", "40", "--sample-tokens", "0"]
    argv += ["--no-plot", "--save-every", "0", "--nproc", "1", "--model", str(chatml)]
    argv += ["--data", str(data)]
    run_on_ranks(_rank_learn, 1, argv, str(tmp_path), timeout=280)
    runs = {}
    for name in ("answers", "everything"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    answers, everything = runs["answers"], runs["everything"]
    assert answers[-1]["loss"] < 0.05 * answers[0]["loss"]
    assert answers[-1]["validation_loss"] < 0.05 * answers[0]["loss"]
    assert answers[-1]["loss"] < 0.1 * everything[-1]["loss"]
