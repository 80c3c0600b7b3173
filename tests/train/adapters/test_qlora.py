"""``mf-train --lora-rank R --base-dtype nf4``: QLoRA on a model folder, each rank its rows.

One launch at world 2 (ZeRO-3) on a tiny Llama folder whose projections split
into whole NF4 scaler blocks (hidden 256), fp32 compute, on conversations rendered
by ``--chat-template`` (the data full tuning and LoRA take, loss on the answers):

- every rank's NF4 shard of every base equals the matching piece of torchao's
  ``to_nf4`` of the whole (bf16) weight, bitwise, scaler mean included; so does
  ``quantize_rows`` for a weight split unevenly (2 rows and 1 row of 16384);
- the loss falls over 6 steps; a run resumed from step 3 gives the unbroken
  run's losses of steps 4-6;
- a no-grad forward gathers the bases in at most 0.3x the bytes of bf16,
  counted at the collective (``mf.bench.CommCounter``, ring model), against
  the same forward with bf16 bases;
- the frozen NF4 bases have no grad buffer and no optimizer state;
- the adapter loads with peft onto the transformers model of the folder's
  original weights (peft's own keys); ``--merge``'s folder (merged into the
  dequantized bases) gives mf's logits to 2e-3.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from mf.train.exports.example_folder import make_llama_folder
from mf.train.run.cli import main as cli_main
from mf.train.run.options import parse_options
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.train.data.chat_folders import CHATML
from tests.train.exports.chat_data import fixed_answer_chats

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers", "peft")
pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

STEPS = 6
_COMMON = ["--device", "cpu", "--precision", "fp32", "--seq-len", "32", "--micro-batch", "2"]
_COMMON += ["--steps", str(STEPS), "--eval-every", "3", "--sample-tokens", "0", "--no-plot"]
_COMMON += ["--lr", "2e-2", "--lora-rank", "4", "--base-dtype", "nf4", "--nproc", "2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("folders") / "llama"
    return make_llama_folder(folder, hidden=256, intermediate=512, heads=4, kv_heads=2)


def _losses(out_dir: Path) -> list[float]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def _check_bitwise(model: torch.nn.Module, folder: Path, rank: int) -> int:
    """Every NF4 shard is its piece of ``to_nf4(whole bf16 weight)``; returns how many."""
    from safetensors.torch import load_file
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from mf.train.adapters.lora import base_file_name
    from mf.train.sources.model_folder import PREFIX
    from mf.train.sources.nf4_bases import nf4_parameters

    files = load_file(folder / "model.safetensors")
    checked = 0
    for key, param in nf4_parameters(model):
        whole = to_nf4(files[str(base_file_name(key.removeprefix(PREFIX)))].to(torch.bfloat16))
        local = param._local_tensor
        for name in ("quantized_data", "quantized_scalers", "quantization_factor"):
            mine, full = getattr(local, name), getattr(whole, name)
            piece = full[rank * mine.numel() : (rank + 1) * mine.numel()]
            assert torch.equal(mine, piece), f"{key}.{name} is not to_nf4's on rank {rank}"
        assert torch.equal(local.scaler_mean, whole.scaler_mean), f"{key}: another scaler mean"
        checked += 1
    return checked


def _check_uneven_rows(rank: int) -> None:
    """``quantize_rows`` of a 3 x 16384 weight split 2 + 1 rows is ``to_nf4``'s, bitwise."""
    import torch.distributed as dist
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from mf.train.sources.nf4_bases import NF4_SPAN, quantize_rows

    whole = torch.randn(3, NF4_SPAN, generator=torch.Generator().manual_seed(3))
    whole[2] *= 5  # rank 1's rows: another mean than rank 0's
    whole = whole.to(torch.bfloat16)
    first, count = (0, 2) if rank == 0 else (2, 1)
    mine = quantize_rows(whole[first : first + count], first, 3, dist.group.WORLD)
    reference = to_nf4(whole)
    for name, value in mine.items():
        full = getattr(reference, name)
        if name == "scaler_mean":
            assert torch.equal(value, full), name
            continue
        per_row = full.numel() // 3
        assert torch.equal(value, full[first * per_row : (first + count) * per_row]), name


def _gathered_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """Bytes this rank sends during a no-grad forward (after a first one), ring model.

    The first forward also checks the NF4 hooks' sizes across ranks (one object
    gather); the second is all-gathers of weights only.
    """
    from mf.bench import CommCounter

    counter = CommCounter()
    with counter.installed(), torch.no_grad():
        model(tokens)
        counter.enabled = True
        model(tokens)
    # mf's gloo gathers: native all-gathers, or point-to-point batches for small buckets.
    assert set(counter.calls) <= {"all_gather_single", "batch_isend_irecv"}, counter.calls
    return counter.bytes_sent


def _rank_qlora(rank: int, world: int, folder: str, tmp: str) -> None:
    import torch.distributed as dist

    from mf.train.adapters.lora import ADAPTER_MARK
    from mf.train.rank.setup import build, setup
    from mf.train.rank.worker import train
    from mf.train.sources.nf4_bases import nf4_parameters
    from mf_fsdp import checkpoint as fsdp_checkpoint
    from mf_fsdp.engine.megatron_fsdp import owner_of

    _check_uneven_rows(rank)
    base = [*_COMMON, "--model", folder, "--data", f"{tmp}/chat.jsonl", "--seq-len", "128"]
    base += ["--chat-template", f"{tmp}/chatml.jinja"]
    argv = [*base, "--out-dir", f"{tmp}/run", "--ckpt-dir", f"{tmp}/ckpt"]
    options = parse_options([*argv, "--save-every", "3", "--merge"])
    train(options)
    resumed = [*base, "--out-dir", f"{tmp}/resumed", "--ckpt-dir", f"{tmp}/ckpt-resumed"]
    resumed += ["--save-every", "0", "--resume-from", f"{tmp}/ckpt/step_0000003"]
    train(parse_options(resumed))

    device, mesh = setup(options)
    model, optimizers = build(options, mesh, device)
    assert _check_bitwise(model, Path(folder), rank) == 2 * 7
    fsdp_checkpoint.load_checkpoint(
        fsdp_checkpoint.latest_checkpoint(options.ckpt_dir), model, optimizers
    )
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(tokens)
    if rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, f"{tmp}/logits.pt")

    # Frozen NF4 bases: no grad buffer, no optimizer state, after a step.
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    for optimizer in optimizers:
        optimizer.step()
    engine = owner_of(next(model.parameters()))
    assert engine is not None
    bases = {id(p) for _, p in nf4_parameters(model)}
    frozen = [g for g in engine.groups if g.extension]
    assert len(frozen) == len(bases) == 2 * 7
    assert all(not g.requires_grad and g.buffers is None for g in frozen)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(ADAPTER_MARK in names[id(p)] for o in optimizers for p in o.state)

    # Gathered bytes: NF4 bases against bf16 ones, the same forward in bf16 compute.
    counted = {}
    for dtype in ("nf4", "fp32"):
        bf16 = parse_options([*argv, "--precision", "bf16", "--base-dtype", dtype])
        counted[dtype] = _gathered_bytes(build(bf16, mesh, device)[0], tokens)
    base_elements = sum(p.numel() for _, p in nf4_parameters(model))
    bf16_bases = 2 * base_elements * (world - 1) / world  # ring model, bytes sent
    others = counted["fp32"] - bf16_bases  # everything but the bases, the same in both
    ratio = (counted["nf4"] - others) / bf16_bases
    assert others > 0, counted
    assert ratio <= 0.3, (ratio, counted)
    if rank == 0:
        print(f"NF4 bases gather {ratio:.3f}x the bytes of bf16 ({counted})")
    dist.barrier()


def _check_exports(folder: Path, out_dir: Path, logits_file: Path) -> None:
    """peft loads the adapter onto the original weights; the merged folder gives mf's logits."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = torch.load(logits_file)
    adapter = out_dir / "adapter"
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter)
    written = load_file(adapter / "adapter_model.safetensors")
    assert set(written) == set(get_peft_model_state_dict(peft_model))
    merged = AutoModelForCausalLM.from_pretrained(out_dir / "model", local_files_only=True)
    with torch.no_grad():
        merged_logits = merged(input_ids=saved["tokens"]).logits
        original_logits = peft_model(input_ids=saved["tokens"]).logits
    torch.testing.assert_close(merged_logits, saved["logits"], rtol=2e-3, atol=2e-3)
    # On the original bases: mf's model up to NF4's rounding of the bases (no tight bound on
    # random weights: 0.7 at most of logits near 0.5 here).
    assert torch.isfinite(original_logits).all()
    print("adapter on the original bases: logits off mf's by at most", end=" ")
    print(f"{(original_logits - saved['logits']).abs().max().item():.3f}")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_qlora_at_world_2(llama: Path, tmp_path: Path) -> None:
    """Planted bugs, each failing this test: ``quantize_rows`` without its all-reduce
    (a rank's mean from its own absmaxes) fails the bitwise check of the model's
    shards and the uneven-rows check (``quantized_scalers`` differ on both ranks);
    ``make_bases_nf4`` skipped (fp32 bases) fails the count of NF4 shards (0, not
    14); ``--merge`` into the folder's original bases fails the 2e-3 logits check
    (0.69 off)."""
    fixed_answer_chats(tmp_path / "chat.jsonl", 24)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    run_on_ranks(_rank_qlora, 2, str(llama), str(tmp_path), timeout=280)
    losses = _losses(tmp_path / "run")
    assert len(losses) == STEPS
    assert losses[-1] < losses[0], losses
    resumed = _losses(tmp_path / "resumed")
    assert resumed == pytest.approx(losses[3:], rel=1e-5)
    _check_exports(llama, tmp_path / "run", tmp_path / "logits.pt")


def _cli(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return code, err.getvalue().strip().splitlines()


def test_bad_nf4_options_are_one_line_and_exit_code_2(tmp_path: Path) -> None:
    """Planted: the shape check removed, the 64-wide folder starts (and fails in the ranks)."""
    small = make_llama_folder(tmp_path / "small")  # hidden 64: 4096-element projections
    base = ["--device", "cpu", "--seq-len", "16", "--nproc", "2"]
    base += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    cases = {
        "no rank": (["--model", str(small), "--base-dtype", "nf4"], "needs --lora-rank"),
        "preset": (
            ["--model", "small", "--lora-rank", "4", "--base-dtype", "nf4"],
            "--base-dtype nf4 does not apply to the preset 'small'",
        ),
        "blocks": (
            ["--model", str(small), "--lora-rank", "4", "--base-dtype", "nf4"],
            "model.layers.0.self_attn.q_proj.weight of shape (64, 64) does not split into 2",
        ),
        "zero 1": (
            ["--model", str(small), "--lora-rank", "4", "--base-dtype", "nf4", "--zero", "1"],
            "--base-dtype nf4 with --zero 1",
        ),
    }
    for name, (argv, expected) in cases.items():
        code, lines = _cli([*base, *argv])
        assert code == 2, name
        assert len(lines) == 1, (name, lines)
        assert expected in lines[0], (name, lines[0])
    assert not (tmp_path / "out").exists()


def test_resume_refuses_another_base_dtype(llama: Path, tmp_path: Path) -> None:
    """An NF4 run's checkpoints hold no bases, a LoRA run's hold them: a resume keeps
    ``--base-dtype`` (planted: ``base_dtype`` out of ``_SAME_RUN_SETTINGS``, it resumes)."""
    from mf.train.run.options import RESULT_SETTINGS
    from mf_fsdp import RECORD_FILE

    argv = ["--device", "cpu", "--seq-len", "16", "--model", str(llama), "--lora-rank", "4"]
    argv += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    options = parse_options(argv)
    saved = tmp_path / "ckpt" / "step_0000002"
    saved.mkdir(parents=True)
    extra = {name: getattr(options, name) for name in RESULT_SETTINGS}
    extra |= {"model": options.model, "lora_rank": 4, "lora_targets": options.lora_targets}
    extra |= {"base_dtype": "nf4"}
    (saved / RECORD_FILE).write_text(json.dumps({"step": 2, "extra": extra}))
    assert parse_options([*argv, "--base-dtype", "nf4", "--resume"]).resume
    with pytest.raises(ValueError, match="saved with --base-dtype nf4, this run has --base-dtype"):
        parse_options([*argv, "--resume"])
