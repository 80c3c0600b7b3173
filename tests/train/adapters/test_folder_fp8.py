"""``mf-train --model PATH --precision fp8``: a transformers folder's decoder layers in float8.

- the conversion takes exactly the decoder layers' projections (q/k/v/o,
  gate/up/down of the tiny Llama), never the LM head or the embedding, and makes
  their weights torchao's FP8-gathering subclass under ZeRO-3 only;
- at world 2 (ZeRO-3, FP8 weight gathering) the folder learns as its bf16 run
  does while computing something else (so the float8 matmuls ran), its weights
  move, it resumes with the unbroken run's losses, and its export loads with
  ``from_pretrained`` and holds the trained weights; at ZeRO-2, with
  ``--dp-outer 2`` and with ``--cp 2`` it ends as near bf16;
- what fp8 cannot serve on a folder is one line naming the model and the option.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mf.train.exports.example_folder import make_llama_folder
from mf.train.run import options as options_module
from mf.train.run.options import parse_options
from tests._float8 import needs_cpu_float8
from tests._multiprocess import preload_in_ranks, run_on_ranks

preload_in_ranks("transformers", "transformers.models.llama.modeling_llama", "tokenizers")

STEPS = 12
LOSS_RTOL = 0.03
"""How far fp8's final validation loss may be from bf16's (relative), as for the presets."""
LEARNED = 0.5
"""How far both runs' validation loss must fall below the untrained model's (5.6 at the start)."""
_COMMON = ["--device", "cpu", "--seq-len", "32", "--micro-batch", "2", "--lr", "1e-2"]
_COMMON += ["--steps", str(STEPS), "--eval-every", "6", "--sample-tokens", "0", "--no-plot"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_folder(tmp_path_factory.mktemp("folders") / "llama", corpus_chars=20_000)


def _records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@needs_cpu_float8
@pytest.mark.parametrize("zero", [2, 3])
def test_fp8_converts_the_decoder_layers_projections(llama: Path, zero: int) -> None:
    """Planted: taking every fit linear (the model-wide GPT rule without the layers'
    restriction) converts the LM head too (320 x 64 divides by 16) and fails."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from mf.train.adapters.run_module import folder_module
    from mf.train.sources.model_folder import folder_of

    options = parse_options(["--model", str(llama), *_COMMON, "--precision", "fp8"])
    options = dataclasses.replace(options, zero=zero)
    module, _ = folder_module(options, folder_of(options.model), torch.device("cpu"))
    converted = {n for n, m in module.named_modules() if isinstance(m, Float8Linear)}
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layer = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    layer |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    expected = {f"lm.model.layers.{i}.{layer[p]}.{p}" for i in range(2) for p in projections}
    assert converted == expected
    assert type(module.lm.lm_head) is torch.nn.Linear
    gathering = {
        n for n, p in module.named_parameters() if isinstance(p, WeightWithDynamicFloat8CastTensor)
    }
    assert gathering == ({f"{n}.weight" for n in expected} if zero == 3 else set())


def _rank_fp8_like_bf16(rank: int, world: int, argv: list[str], tmp: str) -> None:
    from mf.train.rank.worker import train

    for precision in ("bf16", "fp8"):
        out = f"{tmp}/{precision}"
        run = [*argv, "--precision", precision, "--out-dir", out, "--ckpt-dir", out + "-ckpt"]
        train(parse_options(run))
    if rank == 0:  # the fp8 run as if it had stopped at its step-6 checkpoint
        Path(tmp, "fp8-ckpt", f"step_{STEPS:07d}").rename(Path(tmp, "fp8-unbroken"))
    dist.barrier()
    resumed = [*argv, "--precision", "fp8", "--out-dir", f"{tmp}/resumed"]
    train(parse_options([*resumed, "--ckpt-dir", f"{tmp}/fp8-ckpt", "--resume"]))
    for name, extra in _FP8_VARIANTS.items():
        folders = ["--out-dir", f"{tmp}/{name}", "--ckpt-dir", f"{tmp}/{name}-ckpt"]
        train(parse_options([*argv, "--precision", "fp8", *extra, *folders, "--save-every", "0"]))


_FP8_VARIANTS = {
    "zero2": ["--zero", "2"],  # float8 in the matmuls only: whole compute weights, no FP8 gather
    "hsdp": ["--dp-outer", "2"],  # FP8 gathering over a replicated outer dim
    "cp2": ["--cp", "2", "--micro-batch", "4"],  # each sequence over both ranks
}


@needs_cpu_float8
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fp8_folder_learns_like_bf16_resumes_and_exports(llama: Path, tmp_path: Path) -> None:
    """Planted: the step never applied (the optimizers' step made a no-op in the fp8
    run) fails the weights-moved and the learning checks; the loss comparison alone
    would not catch it within 3% of an 8-step run whose loss barely moves."""
    argv = ["--model", str(llama), *_COMMON, "--zero", "3", "--save-every", "6"]
    run_on_ranks(_rank_fp8_like_bf16, 2, argv, str(tmp_path), timeout=380)
    bf16, fp8 = _records(tmp_path / "bf16"), _records(tmp_path / "fp8")
    losses = [[r["loss"] for r in run] for run in (bf16, fp8)]
    assert losses[1] != losses[0]  # the float8 matmuls ran: they round otherwise than bf16
    end_bf16, end_fp8 = bf16[-1]["validation_loss"], fp8[-1]["validation_loss"]
    assert end_bf16 < losses[0][0] - LEARNED  # both learn
    assert end_fp8 < losses[1][0] - LEARNED
    assert abs(end_fp8 - end_bf16) <= LOSS_RTOL * end_bf16, (end_fp8, end_bf16)
    for name in _FP8_VARIANTS:
        variant = _records(tmp_path / name)
        assert [r["loss"] for r in variant] != losses[0], name
        end = variant[-1]["validation_loss"]
        assert abs(end - end_bf16) <= LOSS_RTOL * end_bf16, (name, end, end_bf16)
    resumed = _records(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(7, STEPS + 1))
    assert [r["loss"] for r in resumed] == losses[1][6:]

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8" / "model")
    original = load_file(llama / "model.safetensors")
    for name, value in exported.state_dict().items():
        assert not torch.equal(value, original[name].to(value.dtype)), f"{name} did not train"


def _one_line(argv: list[str]) -> str:
    with pytest.raises(ValueError, match="^--precision fp8") as caught:
        parse_options(argv)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_fp8_with_lora_is_one_line(llama: Path) -> None:
    message = _one_line(["--model", str(llama), "--precision", "fp8", "--lora-rank", "4"])
    assert message.startswith(f"--precision fp8 does not apply to the llama model {str(llama)!r}")
    assert "with --lora-rank its bases are frozen" in message


def test_fp8_folder_without_fit_linears_is_one_line(tmp_path: Path) -> None:
    """A folder whose layers' widths do not divide by 16 has nothing float8 can take."""
    odd = make_llama_folder(
        tmp_path / "odd", hidden=24, heads=2, kv_heads=1, intermediate=40, corpus_chars=4000
    )
    message = _one_line(["--model", str(odd), "--device", "cpu", "--precision", "fp8"])
    assert message == (
        f"--precision fp8 does not apply to the llama model {str(odd)!r}: no linear of its "
        "decoder layers has both dimensions divisible by 16, which FP8 matmuls need"
    )


def test_fp8_folder_on_a_device_without_fp8_is_one_line(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(options_module, "float8_unavailable", lambda device: "no FP8 matmul")
    message = _one_line(["--model", str(llama), "--device", "cpu", "--precision", "fp8"])
    assert message == "--precision fp8: no FP8 matmul"


def _rank_loads_fp8_folder(rank: int, world: int, folder: str) -> None:
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from mf.train.rank.setup import build, setup
    from mf_fsdp.checkpoint import get_model_state_dict

    argv = ["--model", folder, "--device", "cpu", "--zero", "3", "--precision", "fp8"]
    options = parse_options([*argv, "--seq-len", "32", "--nproc", str(world)])
    device, mesh = setup(options)
    model, _ = build(options, mesh, device)
    files = load_file(f"{folder}/model.safetensors")
    float8 = 0
    for key, value in get_model_state_dict(model).items():
        if not isinstance(value, DTensor) or hasattr(value, "local_boxes"):
            continue  # the plain weights: sources/test_model_folder.py checks those
        float8 += 1
        local = value._local_tensor._tensor  # the padded torch.chunk piece, unwrapped
        pieces = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(pieces, local.contiguous())
        full = torch.cat(pieces)[: value.shape[0]]
        torch.testing.assert_close(full, files[key.removeprefix("lm.")], rtol=0, atol=0)
    assert float8 == 14


@needs_cpu_float8
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fp8_folder_weights_load_exactly(tmp_path: Path) -> None:
    """Each rank reads its torch.chunk piece of each float8 weight (FSDP2's layout, not
    mf's own) into the subclass's inner tensor; the rows of one weight differ, so a
    piece read at another offset is seen.

    Planted: every rank reading from row 0 (the piece's offset ignored) fails it.
    """
    folder = make_llama_folder(
        tmp_path / "llama", hidden=48, heads=3, kv_heads=1, intermediate=80, corpus_chars=4000
    )
    run_on_ranks(_rank_loads_fp8_folder, 2, str(folder), timeout=100)
