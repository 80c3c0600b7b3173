"""``mf-plan`` as a user meets it: the table, the JSON, and one line per mistake (exit 2).

Everything runs in this process: ``main`` makes its fake process group and
destroys it before returning. The folders are config.json files written here
(no weights): a Llama of two tiny layers, and the 8B and 70B Llama-3 shapes for
the scale check at 1024 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, ViTConfig

from mf.plan.cli import main

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
_TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320}
# Llama-3's shapes (8B and 70B): what the scale check plans.
_LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
_LLAMA_8B |= {"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
_LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
_LLAMA_70B |= {"num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}


def _llama_config(folder: Path, shape: dict[str, int]) -> Path:
    """A folder holding only the config.json of a Llama of ``shape``."""
    LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained(
        folder
    )
    return folder


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_names_the_settings_and_the_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny", "--gpus", "8", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "on 8 GPUs, h100 (74.5 GiB" in out
    assert "dp_outer 1 x dp 8 x cp 1 x tp 1; ZeRO 3" in out
    for row in ("main weights (fp32)", "optimizer state (AdamW)", "+ largest unit gathered"):
        assert row in out
    for row in ("activations, forward", "forward peak", "backward peak", "optimizer step"):
        assert row in out
    assert "peak fits" in out
    assert "not predicted yet: the engine's pooled reduction buffers" in out


def test_phases_add_up_and_checkpointing_lowers_the_peak(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ("--model", "small", "--gpus", "2", "--micro-batch", "4", "--seq-len", "128")
    saved = _plan(capsys, *argv)
    recomputed = _plan(capsys, *argv, "--activation-checkpointing")
    state, phases = saved["model_state"], saved["phases"]
    assert phases["after_wrap"] == state["held"] - state["grads"]
    assert phases["forward"] - phases["after_wrap"] == (
        saved["activations"]["forward_peak"] + state["gathered_root"] + state["gathered_unit"]
    )
    assert phases["peak"] == max(v for k, v in phases.items() if k != "peak")
    assert saved["activations"]["seq_len"] == 128
    assert recomputed["activations"]["checkpointing"] is True
    assert recomputed["phases"]["peak"] < phases["peak"]
    # The forward saves only each layer's input: a [4, 128, 256] bf16 tensor.
    assert recomputed["activations"]["per_layer"] == 4 * 128 * 256 * 2


def test_json_adds_up_and_sharding_divides_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    two = _plan(capsys, "--model", "small", "--gpus", "2", "--zero", "3")["model_state"]
    eight = _plan(capsys, "--model", "small", "--gpus", "8", "--zero", "3")["model_state"]
    for state in (two, eight):
        kinds = ("params", "main_params", "grads", "optimizer_state")
        assert state["held"] == sum(state[k] for k in kinds)
    # Four times the ranks: each holds about a quarter (whole rows, so not exactly).
    assert eight["held"] < two["held"] / 3.5
    replicated = _plan(capsys, "--model", "small", "--gpus", "8", "--zero", "1")["model_state"]
    assert replicated["params"] > 0
    assert replicated["gathered_unit"] == 0


def test_gpu_memory_decides_whether_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(capsys, "--model", "150m", "--gpus", "2", "--gpu-memory", "0.5")
    assert plan["device"]["name"] == "custom"
    assert plan["model_state_fits"] is False
    assert plan["fits"] is False
    assert main(["--model", "150m", "--gpus", "2", "--gpu-memory", "0.5"]) == 0
    assert "peak does NOT fit" in capsys.readouterr().out
    # The model state fits in 3 GiB; 16 sequences of 512 tokens' activations do not.
    roomy = _plan(capsys, "--model", "150m", "--gpus", "2", "--gpu-memory", "3")
    assert roomy["model_state_fits"] is True
    assert roomy["fits"] is False


def _folders(tmp_path: Path) -> dict[str, Path]:
    vision = tmp_path / "vision"
    ViTConfig(hidden_size=32, num_hidden_layers=1).save_pretrained(vision)
    empty = tmp_path / "empty"
    empty.mkdir()
    return {"vision": vision, "empty": empty}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "6", "--cp", "4"], "--gpus 6: no mesh of --tp 1 x --cp 4 x --dp-outer 1"),
        (["--gpus", "8", "--dp-outer", "3"], "choose a GPU count that is a multiple of 3"),
        (["--gpus", "0"], "--gpus must be a positive int, got 0"),
        (["--gpus", "8", "--model", "nope"], "'nope' is neither a preset"),
        (["--gpus", "8", "--model", "moe-tiny"], "is a mixture of experts"),
        (["--gpus", "8", "--tp", "2"], "does not plan tensor parallelism yet"),
        (["--gpus", "8", "--rank", "8"], "--rank must be in [0, 8)"),
        (["--gpus", "8", "--gpu-memory", "-1"], "--gpu-memory must be a positive number"),
        (["--gpus", "8", "--micro-batch", "0"], "--micro-batch must be a positive int, got 0"),
        (["--gpus", "8", "--seq-len", "65"], "--seq-len must be in [1, 64]"),
        (["--gpus", "12"], "--gpus 12: not whole nodes of --gpus-per-node 8"),
        (["--gpus", "8", "--gpus-per-node", "0"], "--gpus-per-node must be a positive int"),
        (["--gpus", "8", "--global-batch", "100"], "--global-batch 100: not a multiple of"),
        (["--gpus", "8", "--search", "--global-batch", "4"], "--global-batch 4: no micro-batch"),
        (["--gpus", "8", "--search", "--cp", "2"], "--search with --cp 2: the search keeps"),
        (["--gpus", "8", "--gpu-memory", "8", "--device", "h200"], "not allowed with"),
        (["--model", "tiny"], "the following arguments are required: --gpus"),
        (["--gpus", "8", "--model", "{vision}"], "not a causal language model"),
        (["--gpus", "8", "--model", "{empty}"], "holds no config.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folders = _folders(tmp_path)
    argv = [a.format(**folders) for a in argv]
    if "--model" not in argv:
        argv = [*argv, "--model", "tiny"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("mf-plan: error: ")
    assert message in lines[0]


def test_a_folder_is_planned_from_its_config_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _llama_config(tmp_path / "llama", _TINY)
    assert list(folder.iterdir()) == [folder / "config.json"]
    plan = _plan(capsys, "--model", str(folder), "--gpus", "4")
    assert plan["model"]["layers"] == 2
    assert plan["model_state"]["gathered_unit"] > 0
    assert plan["phases"] is None
    assert plan["not_predicted"][0].startswith("activations of a folder's model")


@pytest.mark.parametrize("shape", [_LLAMA_8B, _LLAMA_70B], ids=["8b", "70b"])
def test_llama_shapes_plan_at_1024_ranks(
    shape: dict[str, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _llama_config(tmp_path / "llama", shape)
    plan = _plan(capsys, "--model", str(folder), "--gpus", "1024")
    total = plan["model"]["parameters"]
    state = plan["model_state"]
    # 16 bytes per element (fp32 main weight and grad, two AdamW moments) over 1024 ranks,
    # plus whole-row padding and one fp32 step counter per parameter tensor.
    ideal = 16 * total / 1024
    assert ideal <= state["held"] < 1.01 * ideal + 4 * 1000
