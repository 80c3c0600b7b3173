"""mf-train's launcher-side checks and its data pipeline (no processes started)."""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path

import pytest
import torch

from mf.models import GPT, PRESETS
from mf.models.gpt import layer_drop
from mf.train.data.text import TextData, decode, encode, load_corpus
from mf.train.rank.step import seed_layer_drop
from mf.train.rank.worker import main as worker_main
from mf.train.reports.report import Reporter, host_bound_hint, last_saved_checkpoint
from mf.train.run.cli import _interrupted, check_local_processes, main
from mf.train.run.options import RESULT_SETTINGS, parse_options


# [Note: simulated GPUs] Every test of this module runs three times, as on a machine with
# no GPU, one and four (torch.cuda's answers are simulated; nothing here starts a process
# or touches a device). mf-train's defaults follow the hardware, so a test that means the
# CPU must say so (--device cpu, --nproc), and a test of the defaults states what it
# expects for each machine: none may pass only because this machine has no GPU.
@pytest.fixture(autouse=True, params=[0, 1, 4], ids=["no-gpu", "1-gpu", "4-gpus"])
def gpus(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    count = request.param
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return count


_CPU = ["--device", "cpu"]


def test_defaults_follow_the_hardware(gpus: int) -> None:
    """No GPU: 2 CPU processes (gloo). GPUs: CUDA with one process per GPU (NCCL)."""
    options = parse_options([])
    assert (options.nproc, options.zero, options.tp) == (gpus or 2, 3, 1)
    assert options.dp_size == (gpus or 2)
    assert options.use_cuda == (gpus > 0)
    cpu = parse_options(_CPU)
    assert (cpu.nproc, cpu.use_cuda) == (2, False)
    if gpus:
        cuda = parse_options(["--device", "cuda"])
        assert (cuda.nproc, cuda.use_cuda) == (gpus, True)
        assert parse_options(["--nproc", "1"]).use_cuda


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "--tp 3 does not divide the 2 processes"),
        (["--nproc", "4", "--tp", "2", "--dp-outer", "3"], "--dp-outer 3 does not divide"),
        (["--seq-len", "100000"], "--seq-len 100000 exceeds the 'small' model's 256 positions"),
        (["--micro-batch", "0"], "--micro-batch must be at least 1, got 0"),
        (["--resume", "--ckpt-dir", "/nonexistent/mf"], "--resume: no complete checkpoint"),
        (["--model", "huge"], "--model 'huge': is neither a preset"),
        (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--lr", "0"], "--lr must be a positive number, got 0.0"),
        (["--lr", "inf"], "argument --lr: expected a finite number, got 'inf'"),
        (["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
        (["--lr=-inf"], "argument --lr: expected a finite number, got '-inf'"),
        (["--lr", "1e999"], "argument --lr: expected a finite number, got '1e999'"),
        (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
        (["--max-grad-norm", "-1"], r"--max-grad-norm must be 0 \(no clipping\) or a positive"),
        (["--max-grad-norm", "big"], "argument --max-grad-norm: expected a number, got 'big'"),
        (["--max-grad-norm", "inf"], "argument --max-grad-norm: expected a finite number"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
        (["--timeout", "inf"], "argument --timeout: expected a finite number, got 'inf'"),
        (["--zero", "4"], "argument --zero: invalid choice: 4"),
        (["--nproc", "8", "--tp", "8"], "--tp 8 does not divide the 4 attention heads"),
        (["--sample-tokens", "-1"], "--sample-tokens must be 0 or more, got -1"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--layer-drop", "1"], r"--layer-drop must be a probability in \[0, 1\), got 1.0"),
        (["--layer-drop", "-0.1"], r"--layer-drop must be a probability in \[0, 1\), got -0.1"),
        (["--model", "moe-tiny", "--layer-drop", "0.1"], "--layer-drop 0.1 is for dense models"),
        (["--ep", "2"], r"--ep 2 needs a mixture-of-experts --model \(one of \['moe-small'"),
        (["--model", "moe-tiny", "--ep", "0"], "--ep must be at least 1, got 0"),
        (
            ["--model", "moe-tiny", "--ep", "3", "--nproc", "3"],
            "--ep 3 does not divide the 4 experts of the 'moe-tiny' model",
        ),
        (
            ["--model", "moe-tiny", "--ep", "4", "--nproc", "4", "--tp", "2"],
            r"--ep 4 does not divide the 2 sharded data-parallel ranks \(--nproc 4 / --tp 2",
        ),
        (["--etp", "2"], r"--etp 2 needs a mixture-of-experts --model \(one of \['moe-small'"),
        (["--model", "moe-tiny", "--etp", "0"], "--etp must be at least 1, got 0"),
        (
            ["--model", "moe-tiny", "--ep", "2", "--etp", "2", "--nproc", "2"],
            r"--etp 2 x --ep 2 does not divide the 2 sharded data-parallel ranks",
        ),
        (
            ["--model", "moe-tiny", "--etp", "3", "--nproc", "3"],
            "--etp 3 does not divide the experts' FFN width 128 of the 'moe-tiny' model",
        ),
        (
            ["--model", "moe-tiny", "--etp", "4", "--nproc", "4", "--tp", "2"],
            r"--etp 4 x --ep 1 does not divide the 2 sharded data-parallel ranks \(--nproc 4",
        ),
    ],
)
def test_option_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options([*_CPU, *argv])


def test_layer_drop_differs_between_ranks_and_repeats() -> None:
    """``--layer-drop``: each data-parallel rank draws its own blocks to skip, the same for
    the same (seed, micro-batch, rank), and evaluation runs every block."""
    options = parse_options([*_CPU, "--model", "tiny", "--layer-drop", "0.5"])
    model = types.SimpleNamespace(module=GPT(PRESETS["tiny"]))

    def kept(micro_batch: int, dp_rank: int) -> list[int]:
        seed_layer_drop(model, options, micro_batch, dp_rank)
        module = model.module
        blocks = layer_drop(module.blocks, module.layer_drop, module.layer_drop_generator)
        return [next(i for i, b in enumerate(module.blocks) if b is block) for block in blocks]

    draws = [(kept(m, 0), kept(m, 1)) for m in range(6)]
    assert draws == [(kept(m, 0), kept(m, 1)) for m in range(6)]
    assert any(mine != theirs for mine, theirs in draws), draws
    assert any(len(mine) < 2 for mine, _ in draws), draws
    model.module.eval()
    tokens = torch.zeros(1, 4, dtype=torch.long)
    calls = []
    for block in model.module.blocks:
        block.register_forward_hook(lambda *_: calls.append(1))
    model.module(tokens)
    assert len(calls) == len(model.module.blocks)


def test_data_errors_are_one_line(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    cases = [
        (["--data", str(tmp_path / "missing.txt")], "does not exist or is not a file"),
        (["--data", str(empty)], "is empty"),
        (["--data", str(binary)], "is not UTF-8 text"),
        (["--data", str(short)], "--seq-len 128 is too long for the corpus"),
        (["--tp", "3"], "--tp 3 does not divide"),
        (["--nproc", "4", "--dp-outer", "3"], "--dp-outer 3 does not divide"),
        (["--model", "huge"], "--model 'huge': is neither a preset"),
        (["--steps", "-5"], "--steps must be at least 1, got -5"),
        (["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
        (["--resume", "--ckpt-dir", str(tmp_path / "none")], "--resume: no complete checkpoint"),
    ]
    for argv, message in cases:
        assert main([*_CPU, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mf-train: error: ")
        assert message in err
        assert err.count("\n") == 1
        assert "Traceback" not in err


def test_resume_refuses_another_model(tmp_path) -> None:
    from mf_fsdp import RECORD_FILE

    saved = tmp_path / "step_0000005"
    saved.mkdir()
    (saved / RECORD_FILE).write_text(json.dumps({"step": 5, "extra": {"model": "small", "tp": 1}}))
    common = [*_CPU, "--resume", "--ckpt-dir", str(tmp_path)]
    assert parse_options([*common, "--zero", "1", "--nproc", "4"]).resume  # ZeRO/world may change
    assert parse_options([*common, "--nproc", "4", "--tp", "2"]).resume  # and the tp size
    with pytest.raises(ValueError, match="was saved with --model small, this run has --model tiny"):
        parse_options([*common, "--model", "tiny", "--seq-len", "32"])
    with pytest.raises(ValueError, match="is at step 5 and --steps is 5; expected --steps above 5"):
        parse_options([*common, "--steps", "5"])  # nothing left to train


def test_resume_refuses_changed_results_unless_allowed(tmp_path) -> None:
    from mf_fsdp import RECORD_FILE

    saved = tmp_path / "step_0000005"
    saved.mkdir()
    common = [*_CPU, "--resume", "--ckpt-dir", str(tmp_path), "--seq-len", "32"]
    options = parse_options([*_CPU, "--seq-len", "32"])
    extra = {"model": options.model, **{n: getattr(options, n) for n in RESULT_SETTINGS}}
    (saved / RECORD_FILE).write_text(json.dumps({"step": 5, "extra": extra}))
    assert parse_options(common).resume  # the same settings
    assert parse_options([*common, "--zero", "1"]).resume  # the layout may change
    changed = r"was saved with --seed 0 \(now 7\), --lr 0.001 \(now 0.002\): the run would go"
    with pytest.raises(ValueError, match=changed):
        parse_options([*common, "--seed", "7", "--lr", "0.002"])
    with pytest.raises(ValueError, match=r"--seq-len 32 \(now 16\)"):
        parse_options([*_CPU, "--resume", "--ckpt-dir", str(tmp_path), "--seq-len", "16"])
    with pytest.raises(ValueError, match=r"--data None \(now .*corpus.txt\)"):
        parse_options([*common, "--data", str(tmp_path / "corpus.txt")])
    allowed = parse_options([*common, "--seed", "7", "--allow-changed-settings"])
    assert allowed.seed == 7


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xca\xfe{", r"mf_checkpoint.json' is damaged: not JSON \('utf-8' codec"),
        (b"{not json", r"mf_checkpoint.json' is damaged: not JSON"),
        (b"[1, 2]", r"mf_checkpoint.json' is damaged: expected a JSON object"),
        (b'{"step": 5, "extra": [1]}', r"mf_checkpoint.json' is damaged: expected a JSON object"),
    ],
)
def test_resume_names_a_damaged_record(tmp_path, capsys, content: bytes, message: str) -> None:
    from mf_fsdp import RECORD_FILE

    saved = tmp_path / "step_0000005"
    saved.mkdir()
    (saved / RECORD_FILE).write_bytes(content)
    assert main([*_CPU, "--resume", "--ckpt-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.search(rf"^mf-train: error: --resume: '.*{message}", err), err


def test_cuda_without_gpus(gpus: int, capsys) -> None:
    if gpus:
        assert parse_options(["--device", "cuda"]).nproc == gpus
        return
    assert main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "mf-train: error: --device cuda: torch sees no CUDA device on this machine\n"
    )


def test_nproc_above_the_gpus_is_an_error(gpus: int, monkeypatch, capsys) -> None:
    """CUDA runs: one process per GPU, so more processes than GPUs is refused up front."""
    if not gpus:
        pytest.skip("the rule of a machine with GPUs (this simulated one has none)")
    check_local_processes(parse_options(["--nproc", str(gpus)]))
    assert main(["--nproc", str(gpus + 1)]) == 2
    assert capsys.readouterr().err == (
        f"mf-train: error: --nproc {gpus + 1} is more than the CUDA GPUs of this machine "
        f"({gpus}); one process per GPU: use --nproc {gpus} or fewer, or --device cpu\n"
    )
    monkeypatch.setattr("mf.train.run.cli.local_cpu_cores", lambda: 8)
    check_local_processes(parse_options(["--nproc", "5", "--device", "cpu"]))  # the CPU rule
    assert capsys.readouterr().err == ""


def test_nproc_above_the_cpu_cores_warns(monkeypatch, capsys) -> None:
    """CPU runs: more processes than cores only slow down, so it is a warning, not an error."""
    monkeypatch.setattr("mf.train.run.cli.local_cpu_cores", lambda: 2)
    check_local_processes(parse_options(["--device", "cpu", "--nproc", "2"]))
    assert capsys.readouterr().err == ""
    check_local_processes(parse_options(["--device", "cpu", "--nproc", "4"]))
    assert capsys.readouterr().err == (
        "mf-train: warning: --nproc 4 is more than the CPU cores this process may use (2); "
        "the ranks will share them and every step will be slower\n"
    )


def strict_json(line: str) -> dict:
    """``json.loads`` that refuses the NaN / Infinity extensions of Python's json module."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant} in {line!r}")

    return json.loads(line, parse_constant=refuse)


def _reporter(tmp_path: Path, start_step: int = 0) -> Reporter:
    argv = [*_CPU, "--model", "tiny", "--seq-len", "32", "--out-dir", str(tmp_path)]
    return Reporter(parse_options(argv), True, start_step, "corpus", 100, 10, 1000)


def test_metrics_stay_strict_json_with_non_finite_values(tmp_path) -> None:
    """NaN and infinities are written as null; a resumed run reads them back as NaN."""
    reporter = _reporter(tmp_path)
    cpu = torch.device("cpu")
    reporter.step(1, 5.5, 5.6, 100.0, cpu)
    reporter.step(2, math.nan, math.inf, math.inf, cpu)
    reporter.step(3, -math.inf, None, 100.0, cpu)
    reporter.bar.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [strict_json(line) for line in lines]
    assert records[0] == {**records[0], "loss": 5.5, "validation_loss": 5.6}
    assert (records[1]["loss"], records[1]["validation_loss"], records[1]["tokens_per_s"]) == (
        None,
        None,
        None,
    )
    assert records[2]["loss"] is None
    resumed = _reporter(tmp_path, start_step=2)
    resumed.bar.close()
    assert math.isnan(resumed.history[1]["loss"])
    assert math.isnan(resumed.history[1]["validation_loss"])
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert kept == lines[:2]  # rewritten for the resumed run, still strict JSON


def test_interrupted_names_only_a_checkpoint_of_this_run(tmp_path, capsys, monkeypatch) -> None:
    """After Ctrl-C the launcher reads last_checkpoint.json (rank 0 writes it after each save
    with the launcher's run id): another run's checkpoint is never reported as this run's."""
    from mf_fsdp import RECORD_FILE

    ckpt = tmp_path / "ckpt"
    for step in (3, 9):  # step 9: another run's, newer
        (ckpt / f"step_000000{step}").mkdir(parents=True)
        (ckpt / f"step_000000{step}" / RECORD_FILE).write_text("{}")
    options = parse_options([*_CPU, "--ckpt-dir", str(ckpt), "--out-dir", str(tmp_path / "out")])

    def message(run_id: str) -> str:
        capsys.readouterr()  # not the progress bar's output
        assert _interrupted(options, run_id) == 130
        return capsys.readouterr().err

    assert message("run-a") == "mf-train: interrupted; this run saved no checkpoint\n"
    reporter = _reporter(tmp_path / "out")
    reporter.bar.close()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")
    reporter.saved(ckpt / "step_0000009", 9)
    assert last_saved_checkpoint(tmp_path / "out", "run-b") == ckpt / "step_0000009"
    assert message("run-a") == "mf-train: interrupted; this run saved no checkpoint\n"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    reporter.saved(ckpt / "step_0000003", 3)
    assert message("run-a") == (
        f"mf-train: interrupted; checkpoint {ckpt / 'step_0000003'}; --resume would continue "
        f"from the newer {ckpt / 'step_0000009'}\n"
    )
    (ckpt / "step_0000009" / RECORD_FILE).unlink()
    assert message("run-a") == (
        f"mf-train: interrupted; checkpoint {ckpt / 'step_0000003'} (continue with --resume)\n"
    )
    (ckpt / "step_0000003" / RECORD_FILE).unlink()  # removed since: not reported
    assert message("run-a") == "mf-train: interrupted; this run saved no checkpoint\n"
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_seq_len_longer_than_either_split(tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("x" * 400)  # 360 train and 40 validation tokens
    TextData.from_text(text.read_text(), 39)  # fits
    with pytest.raises(ValueError, match="validation split of 40; use --seq-len below 40"):
        TextData.from_text(text.read_text(), 40)
    assert main([*_CPU, "--model", "tiny", "--data", str(text), "--seq-len", "64"]) == 2
    assert "--seq-len 64 is too long for the corpus" in capsys.readouterr().err


def test_worker_entry_reports_user_errors_in_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert worker_main(["--", *_CPU, "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "mf-train: error: --tp 3 does not divide the 2 processes (--nproc); " + (
        "choose a tensor-parallel size that divides it\n"
    )


def test_builtin_corpus_and_byte_tokens() -> None:
    text, name = load_corpus(None)
    assert len(text) > 400_000
    assert "Python Language Reference" in name
    assert decode(encode("héllo")) == "héllo"


def test_batches_are_deterministic_and_rank_disjoint() -> None:
    data = TextData.from_text("abcdefghijklmnopqrstuvwxyz" * 200, seq_len=16)
    a0 = data.batch("train", 3, 0, 0, 2, 4, 16)
    again = data.batch("train", 3, 0, 0, 2, 4, 16)
    a1 = data.batch("train", 3, 0, 1, 2, 4, 16)
    whole = data.batch("train", 3, 0, 0, 1, 8, 16)
    assert torch.equal(a0[0], again[0])
    assert torch.equal(torch.cat([a0[0], a1[0]]), whole[0])  # ranks split one global batch
    assert torch.equal(a0[0][:, 1:], a0[1][:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(data.batch("validation", 3, 0, 0, 2, 4, 16)[0], a0[0])
    with pytest.raises(ValueError, match="split must be 'train' or 'validation'"):
        data.batch("test", 0, 0, 0, 1, 1, 16)


def test_seq_len_defaults_to_what_the_model_supports() -> None:
    assert parse_options(["--model", "tiny", *_CPU]).seq_len == 64  # its positions
    assert parse_options(["--model", "small", *_CPU]).seq_len == 128
    assert parse_options(["--model", "tiny", "--seq-len", "16"]).seq_len == 16


def test_a_gpu_gets_bf16_whole_sequences_and_a_larger_batch(gpus: int) -> None:
    """On a GPU a small step leaves it waiting on the host: the defaults give it more work."""
    options = parse_options(["--model", "small"])
    if gpus:
        assert (options.precision, options.seq_len, options.micro_batch) == ("bf16", 256, 16)
    else:
        assert (options.precision, options.seq_len, options.micro_batch) == ("fp32", 128, 4)
    cpu = parse_options(["--model", "small", *_CPU])
    assert (cpu.precision, cpu.seq_len, cpu.micro_batch) == ("fp32", 128, 4)
    chosen = ["--precision", "fp32", "--seq-len", "64", "--micro-batch", "2"]
    options = parse_options(["--model", "small", *chosen])
    assert (options.precision, options.seq_len, options.micro_batch) == ("fp32", 64, 2)


def test_host_bound_hint() -> None:
    assert host_bound_hint([0.95] * 4, 16) is None  # too few steps to judge
    hint = host_bound_hint([0.97, 0.95, 0.99, 0.5, 0.96], 16)
    assert hint is not None
    assert "the host is busy 96% of each step" in hint
    assert "--micro-batch (e.g. 64)" in hint
    assert host_bound_hint([0.3, 0.95, 0.4, 0.5, 0.2], 16) is None  # the GPU is the limit
    assert parse_options(["--no-plot"]).plot is False
    assert parse_options([]).plot is True
