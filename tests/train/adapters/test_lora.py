"""``mf-train --model PATH --lora-rank R``: peft's LoRA adapters trained under mf's sharding.

A tiny Llama folder (``mf.train.exports.example_folder``) is fine-tuned with rank-4
adapters on every attention and MLP projection, at world 2 (ZeRO-3) and on one
process, fp32: the losses and the adapters' gradient norms (clipped at 0.3) agree
to 1e-5 over 6 steps (the two ranks reduce their
gradients in another order than one backward; a wrong row, a missing adapter
or a base that moves shifts them at O(1e-3) or more). The final checkpoint's
bases equal the folder's files bitwise and every adapter moved. The exported
``<out-dir>/adapter`` loads with ``PeftModel.from_pretrained`` onto the
transformers model, and ``--merge``'s folder with ``from_pretrained``: both give
mf's logits (the sharded model from its checkpoint) to 1e-5. The frozen bases
have no gradient buffer and no optimizer state.
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
from tests.train.exports.chat_data import fixed_answer_chats

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers", "peft")

STEPS = 6
RTOL = 1e-5
_COMMON = ["--device", "cpu", "--precision", "fp32", "--seq-len", "32", "--micro-batch", "2"]
_COMMON += ["--steps", str(STEPS), "--eval-every", "3", "--sample-tokens", "0", "--no-plot"]
_COMMON += ["--lr", "2e-2", "--lora-rank", "4", "--save-every", "0"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_folder(tmp_path_factory.mktemp("folders") / "llama")


def _losses(out_dir: Path, metric: str = "loss") -> list[float]:
    """A metric of every step of the run in ``out_dir`` (its loss by default)."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)[metric] for line in lines]


def _rank_train(rank: int, world: int, argv: list[str], logits_file: str | None) -> None:
    """Train; then (``logits_file``) the logits of mf's model from the last checkpoint."""
    import torch.distributed as dist

    from mf.train.rank.setup import build, setup
    from mf.train.rank.worker import train
    from mf_fsdp import checkpoint as fsdp_checkpoint

    options = parse_options(argv)
    train(options)
    if logits_file is None:
        return
    device, mesh = setup(options)
    model, optimizers = build(options, mesh, device)
    fsdp_checkpoint.load_checkpoint(
        fsdp_checkpoint.latest_checkpoint(options.ckpt_dir), model, optimizers
    )
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(tokens)
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, logits_file)


def _check_checkpoint(llama: Path, checkpoint: Path) -> None:
    """The bases equal the folder's files bitwise; every adapter moved from its start."""
    from safetensors.torch import load_file

    from mf.train.adapters.lora import ADAPTER_MARK, base_file_name
    from mf.train.sources.model_folder import PREFIX
    from mf_fsdp import checkpoint as fsdp_checkpoint

    files = load_file(llama / "model.safetensors")
    state = fsdp_checkpoint.checkpoint_to_full_state_dict(checkpoint)
    adapters = [k for k in state if ADAPTER_MARK in k]
    assert len(adapters) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for key, value in state.items():
        if ADAPTER_MARK in key:
            assert value.abs().max() > 0, key  # lora_B starts at zero, lora_A is drawn
            continue
        name = base_file_name(key.removeprefix(PREFIX))
        assert torch.equal(value, files[str(name)]), f"{key} changed"
    b = [k for k in adapters if ".lora_B." in k]
    assert all(state[k].abs().max() > 1e-4 for k in b)


def _check_exports(llama: Path, out_dir: Path, logits_file: Path) -> None:
    """peft loads the adapter onto transformers' model; the merged folder loads; mf's logits."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = torch.load(logits_file)
    adapter = out_dir / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {
        p.name for p in adapter.iterdir()
    }
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter)
    written = load_file(adapter / "adapter_model.safetensors")
    assert set(written) == set(get_peft_model_state_dict(peft_model))  # peft's own keys
    merged = AutoModelForCausalLM.from_pretrained(out_dir / "model", local_files_only=True)
    with torch.no_grad():
        for model in (peft_model, merged):
            logits = model(input_ids=saved["tokens"]).logits
            torch.testing.assert_close(logits, saved["logits"], rtol=RTOL, atol=RTOL)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_lora_at_world_2_equals_one_process_and_exports(llama: Path, tmp_path: Path) -> None:
    """World 2 (ZeRO-3) equals one process to 1e-5; bases unchanged; peft loads the export.

    Planted: adapters drawn from a generator seeded by the rank (``init_adapters``)
    fail the losses from step 2 (rel 2e-3); the adapter saved under mf's keys
    (``.default.`` kept, which peft still loads) fails the key check;
    ``base_file_name`` leaving ``.base_layer.`` in stops the load in one line.
    """
    argv = [*_COMMON, "--model", str(llama), "--merge", "--max-grad-norm", "0.3"]
    two = tmp_path / "two"
    run_argv = [*argv, "--nproc", "2", "--out-dir", str(two), "--ckpt-dir", str(tmp_path / "ckpt2")]
    run_on_ranks(_rank_train, 2, run_argv, str(tmp_path / "logits.pt"), timeout=200)
    one = tmp_path / "one"
    one_argv = [*argv, "--nproc", "1", "--micro-batch", "4", "--out-dir", str(one)]
    one_argv += ["--ckpt-dir", str(tmp_path / "ckpt1")]
    run_on_ranks(_rank_train, 1, one_argv, None, timeout=200)
    losses = _losses(two)
    assert len(losses) == STEPS
    assert losses == pytest.approx(_losses(one), rel=RTOL)
    assert losses[-1] < losses[0]
    # The adapters' norm over both ranks, clipped alike (--max-grad-norm 0.3 is reached).
    norms = _losses(two, "grad_norm")
    assert norms == pytest.approx(_losses(one, "grad_norm"), rel=RTOL)
    assert max(norms) > 0.3
    _check_checkpoint(llama, tmp_path / "ckpt2" / f"step_{STEPS:07d}")
    _check_exports(llama, two, tmp_path / "logits.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_lora_on_chat_data_exports_what_peft_loads(chatml: Path, tmp_path: Path) -> None:
    """LoRA takes conversations as full tuning does (the loss on the answers); at world 2
    the adapter loads onto the folder's model with peft and gives mf's logits, and the
    merged folder keeps the chat template and stops at its end-of-turn token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = fixed_answer_chats(tmp_path / "chat.jsonl", 24)
    argv = [*_COMMON, "--model", str(chatml), "--data", str(data), "--seq-len", "64"]
    argv += ["--merge", "--nproc", "2", "--out-dir", str(tmp_path / "out")]
    argv += ["--ckpt-dir", str(tmp_path / "ckpt")]
    run_on_ranks(_rank_train, 2, argv, str(tmp_path / "logits.pt"), timeout=200)
    losses = _losses(tmp_path / "out")
    assert losses[-1] < losses[0]
    _check_exports(chatml, tmp_path / "out", tmp_path / "logits.pt")
    merged = tmp_path / "out" / "model"
    tokenizer = AutoTokenizer.from_pretrained(merged, local_files_only=True)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(chatml).chat_template
    stops = AutoModelForCausalLM.from_pretrained(merged).generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops


def _rank_frozen(rank: int, world: int, argv: list[str]) -> None:
    """After a step: frozen groups hold no grad buffer; the optimizer holds the adapters only."""
    from mf.train.adapters.lora import ADAPTER_MARK
    from mf.train.rank.setup import build, setup
    from mf_fsdp.engine.megatron_fsdp import owner_of

    options = parse_options(argv)
    device, mesh = setup(options)
    model, optimizers = build(options, mesh, device)
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    for optimizer in optimizers:
        optimizer.step()
    engine = owner_of(next(model.parameters()))
    assert engine is not None
    frozen = [g for g in engine.groups if not g.requires_grad]
    trained = [g for g in engine.groups if g.requires_grad]
    assert frozen
    assert trained
    assert all(g.buffers is None and g.owned_bytes()["grads"] == 0 for g in frozen)
    names = {id(p): n for n, p in model.named_parameters()}
    (optimizer,) = optimizers
    assert optimizer.state
    assert all(ADAPTER_MARK in names[id(p)] for p in optimizer.state)
    adapter_elements = sum(p.numel() for n, p in model.named_parameters() if ADAPTER_MARK in n)
    footprint = engine.memory_footprint(optimizer)
    # This rank's grads and AdamW's two moments: half the adapters' fp32 bytes each (ZeRO-3
    # at world 2; 1 KiB for padding and the step counts); the bases' grads would add 190 KiB.
    share = 4 * adapter_elements // world
    assert footprint["grads"] <= share + 1024, (footprint, adapter_elements)
    assert footprint["optimizer_state"] <= 2 * share + 1024, footprint
    if rank == 0:
        print("footprint", footprint, "adapter elements", adapter_elements)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_frozen_bases_have_no_grad_buffer_and_no_optimizer_state(
    llama: Path, tmp_path: Path
) -> None:
    """Planted: the bases left trainable (``add_adapters`` not freezing them) gives every
    group a grad buffer and fails at ``assert frozen``. (An AdamW over every parameter
    passes: the frozen bases get no gradient, so it keeps no state for them.)"""
    argv = [*_COMMON, "--model", str(llama), "--nproc", "2"]
    argv += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    run_on_ranks(_rank_frozen, 2, argv, timeout=100)


def _cli(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli_main(argv)
    return code, err.getvalue().strip().splitlines()


def test_bad_lora_options_are_one_line_and_exit_code_2(llama: Path, tmp_path: Path) -> None:
    base = ["--device", "cpu", "--seq-len", "16", "--model", str(llama)]
    base += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    cases = {
        "rank 0": (["--lora-rank", "0"], "--lora-rank must be a positive integer, got 0"),
        "rank -2": (["--lora-rank", "-2"], "--lora-rank must be a positive integer, got -2"),
        "nf4 alone": (["--base-dtype", "nf4"], "--base-dtype nf4 needs --lora-rank"),
        "merge alone": (["--merge"], "--merge needs --lora-rank"),
        "nf4 blocks": (  # the 64-wide test folder: see test_qlora.py
            ["--lora-rank", "4", "--base-dtype", "nf4"],
            "--base-dtype nf4 for the llama model",
        ),
        "target": (
            ["--lora-rank", "4", "--lora-targets", "q_proj,qkv"],
            "has no module named 'qkv'",
        ),
        "preset": (
            ["--lora-rank", "4", "--model", "small"],
            "--lora-rank 4 does not apply to the preset 'small'",
        ),
    }
    for name, (argv, expected) in cases.items():
        code, lines = _cli([*base, *argv])
        assert code == 2, name
        assert len(lines) == 1, (name, lines)
        assert expected in lines[0], (name, lines[0])
    assert not (tmp_path / "out").exists()  # nothing started


def test_resume_refuses_other_adapters_and_changed_alpha(llama: Path, tmp_path: Path) -> None:
    """A LoRA checkpoint holds adapters of one rank on one set of projections: a resume
    with another ``--lora-rank`` or ``--lora-targets`` is refused, and another
    ``--lora-alpha`` (it scales every update) needs ``--allow-changed-settings``."""
    from mf.train.run.options import RESULT_SETTINGS
    from mf_fsdp import RECORD_FILE

    argv = ["--device", "cpu", "--seq-len", "16", "--model", str(llama), "--lora-rank", "4"]
    argv += ["--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    options = parse_options(argv)
    saved = tmp_path / "ckpt" / "step_0000002"
    saved.mkdir(parents=True)
    extra = {name: getattr(options, name) for name in RESULT_SETTINGS}
    extra |= {"model": options.model, "lora_rank": 4, "lora_targets": options.lora_targets}
    (saved / RECORD_FILE).write_text(json.dumps({"step": 2, "extra": extra}))
    resume = [*argv, "--resume"]
    assert parse_options(resume).resume  # the same adapters and alpha
    with pytest.raises(ValueError, match="saved with --lora-rank 4, this run has --lora-rank 8"):
        parse_options([*resume, "--lora-rank", "8"])
    with pytest.raises(ValueError, match="expected the same --lora-targets"):
        parse_options([*resume, "--lora-targets", "q_proj,v_proj"])
    with pytest.raises(ValueError, match=r"--lora-alpha None \(now 16\)"):  # None: 2 x rank
        parse_options([*resume, "--lora-alpha", "16"])
    assert parse_options([*resume, "--lora-alpha", "16", "--allow-changed-settings"]).resume
