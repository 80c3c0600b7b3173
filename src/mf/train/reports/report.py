"""What a ``mf-train`` user sees and keeps: progress, metrics file, loss curve, sample.

Only rank 0 reports; on other ranks every method is a no-op.

``metrics.jsonl`` is strict JSON, one object per step: a value that is not a
finite number (a NaN or infinite loss) is written as ``null``.
``last_checkpoint.json`` names the checkpoint this run saved last, with the
launcher's run id, so that ``mf-train`` never reports another run's checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mf.mfu import dense_flops_per_token, flops_per_token, peak_flops
from mf.models import MODEL_PRESETS, MoEGPTConfig
from mf.train.reports.progress import progress_bar
from mf.train.reports.tensorboard import TensorBoardWriter
from mf.train.settings import TrainOptions
from mf.train.sources.model_folder import folder_of

__all__ = ["LAST_CHECKPOINT_FILE", "Reporter", "host_bound_hint", "last_saved_checkpoint"]

LAST_CHECKPOINT_FILE = "last_checkpoint.json"
# Set by torch's elastic agent (``mf-train``'s launcher and torchrun) in every worker.
_RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"


def _json_line(record: dict[str, Any]) -> str:
    """One metrics line; NaN and infinities become null (``json.dumps`` writes bare ``NaN``)."""
    finite = {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in record.items()
    }
    return json.dumps(finite, allow_nan=False) + "\n"


def last_saved_checkpoint(out_dir: Path, run_id: str | None) -> Path | None:
    """The complete checkpoint the run ``run_id`` saved last, or None.

    Reads ``out_dir/last_checkpoint.json`` (written by rank 0 after each save);
    a file of another run, or a checkpoint removed since, gives None.
    """
    from mf_fsdp import checkpoint as fsdp_checkpoint

    try:
        record = json.loads((out_dir / LAST_CHECKPOINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("run_id") != run_id:
        return None
    path = record.get("path")
    if not isinstance(path, str) or not (Path(path) / fsdp_checkpoint.RECORD_FILE).is_file():
        return None
    return Path(path)


def _memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


HOST_BOUND_SHARE = 0.9
"""A GPU step the host takes this share of to issue (or more) has the GPU waiting on it."""
HOST_BOUND_STEPS = 5
"""Steps (after the first) whose median decides whether to print the host-bound hint."""


def host_bound_hint(host_shares: list[float], micro_batch: int) -> str | None:
    """The one-line hint for a GPU that waits on the host, or None when it does not.

    ``host_shares``: per step, the share of its wall time the host took to issue
    the step's work (the rest it waits for the device). When issuing takes nearly
    all of a step, the GPU idles for part of it: more tokens per step cost the
    host nothing more.
    """
    if len(host_shares) < HOST_BOUND_STEPS:
        return None
    share = sorted(host_shares)[len(host_shares) // 2]
    if share < HOST_BOUND_SHARE:
        return None
    return (
        f"mf-train: hint: the host is busy {share:.0%} of each step, so the GPU waits on it; "
        f"a larger --micro-batch (e.g. {4 * micro_batch}) or --seq-len gives it more work per step"
    )


def _flops_and_name(options: TrainOptions) -> tuple[float | None, str]:
    """Training FLOPs per token of ``--model`` (None for a mixture of experts), and its name.

    Dense models only: a mixture of experts computes with a fraction of its parameters.
    """
    folder = folder_of(options.model)
    if folder is not None:
        flops = dense_flops_per_token(
            folder.parameters, folder.layers, folder.width, options.seq_len
        )
        return flops, folder.name
    preset = MODEL_PRESETS[options.model]
    name = f"{options.model} GPT"
    if isinstance(preset, MoEGPTConfig):
        return None, name
    return flops_per_token(preset, options.seq_len), name


class Reporter:
    """Progress bar, JSON-lines metrics and the end-of-run summary (rank 0 only)."""

    def __init__(
        self,
        options: TrainOptions,
        active: bool,
        start_step: int,
        corpus: str,
        train_tokens: int,
        validation_tokens: int,
        parameters: int,
    ) -> None:
        self.options = options
        self.active = active
        self.out_dir = Path(options.out_dir)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        # progress_bar's (tqdm's bar or a LineProgress) from here on when active; None otherwise,
        # and then never read (every use is behind ``active``).
        self.bar: Any = None
        self._host_shares: list[float] = []
        self._hinted = False
        self.tensorboard: TensorBoardWriter | None = None
        self._flops_per_token, model_name = _flops_and_name(options)
        if not active:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.history = self._earlier_records(start_step)
        self.metrics_path.write_text("".join(_json_line(r) for r in self.history))
        experts = f"ep={options.ep}, " if options.ep > 1 else ""
        context = f"cp={options.cp}, " if options.cp > 1 else ""
        print(
            f"mf-train: {model_name} ({parameters / 1e6:.1f}M parameters), "
            f"{options.nproc} processes (tp={options.tp}, {context}{experts}"
            f"dp_outer={options.dp_outer}, ZeRO-{options.zero}, {options.precision}), "
            f"corpus {corpus}: {train_tokens:,} train / {validation_tokens:,} validation tokens",
            flush=True,
        )
        if start_step:
            print(f"mf-train: resumed from {options.ckpt_dir} at step {start_step}", flush=True)
        self.bar = progress_bar(options.steps, start_step)
        if options.tensorboard:
            self.tensorboard = TensorBoardWriter(self.out_dir, start_step)

    def _earlier_records(self, start_step: int) -> list[dict[str, Any]]:
        """The metrics of the steps a resumed run keeps (up to ``start_step``).

        A null value (a non-finite number when it was written) is read back as NaN.
        """
        if start_step == 0 or not self.metrics_path.is_file():
            return []
        records = (json.loads(line) for line in self.metrics_path.read_text().splitlines() if line)
        return [
            {key: math.nan if value is None else value for key, value in record.items()}
            for record in records
            if record["step"] <= start_step
        ]

    def mfu(self, tokens_per_s: float, device: torch.device) -> float | None:
        """Model FLOPs utilisation of all ranks (``mf.mfu``), or None where no peak is known."""
        # fp8 against the bf16 peak, as torchtitan reports it: the same work, done faster.
        dtype = torch.float32 if self.options.precision == "fp32" else torch.bfloat16
        peak = peak_flops(device, dtype)
        if self.options.peak_tflops is not None:
            peak = (self.options.peak_tflops * 1e12, "--peak-tflops")
        if peak is None or self._flops_per_token is None:
            return None
        return self._flops_per_token * tokens_per_s / (peak[0] * self.options.nproc)

    def step(
        self,
        step: int,
        loss: float,
        validation: float | None,
        tokens_per_s: float,
        device: torch.device,
        extra: dict[str, Any] | None = None,
        host_share: float | None = None,
    ) -> None:
        """Record one optimizer step (``extra``: more metrics, e.g. a MoE model's routing).

        ``host_share``: the share of the step the host took to issue its work; on
        a GPU, a share near one after the first steps prints a one-line hint.
        """
        if not self.active:
            return
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "time": time.time()}
        mfu = self.mfu(tokens_per_s, device)
        if mfu is not None:
            record["mfu"] = mfu
        record["memory_mib"] = _memory_mib(device)
        record.update(extra or {})
        self._note_host_share(step, host_share, device)
        if validation is not None:
            record["validation_loss"] = validation
            self.bar.write(f"step {step}: train loss {loss:.4f}, validation loss {validation:.4f}")
        self.history.append(record)
        with open(self.metrics_path, "a") as out:
            out.write(_json_line(record))
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        postfix = {"loss": f"{loss:.3f}", "tok_s": f"{tokens_per_s:,.0f}"}
        if mfu is not None:
            postfix["mfu"] = f"{mfu:.2f}"
        postfix["mem"] = f"{record['memory_mib']:.0f}MiB"
        self.bar.set_postfix(postfix)
        self.bar.update(1)

    def _note_host_share(self, step: int, share: float | None, device: torch.device) -> None:
        """Collect the host's share of the first GPU steps; print the hint once if it is high."""
        if device.type != "cuda" or share is None or self._hinted or step <= 1:
            return  # the first step compiles and warms up
        self._host_shares.append(share)
        hint = host_bound_hint(self._host_shares, self.options.micro_batch)
        if hint is not None or len(self._host_shares) >= HOST_BOUND_STEPS:
            self._hinted = True
        if hint is not None:
            self.bar.write(hint)

    def saved(self, path: Path, step: int) -> None:
        """Note a checkpoint, and name it in ``last_checkpoint.json`` with this run's id."""
        if not self.active:
            return
        self.bar.write(f"checkpoint saved: {path}")
        record = {"run_id": os.environ.get(_RUN_ID_VARIABLE), "step": step, "path": str(path)}
        target = self.out_dir / LAST_CHECKPOINT_FILE
        partial = target.with_name(target.name + ".tmp")
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, target)  # the launcher never reads half a file

    def save_failed(self, step: int, cause: str) -> None:
        """Warn that the periodic checkpoint of ``step`` was not saved (training goes on)."""
        if self.active:
            self.bar.write(
                f"mf-train: warning: the checkpoint of step {step} was not saved ({cause}); "
                "training goes on and the next save retries",
                file=sys.stderr,
            )

    @contextlib.contextmanager
    def bar_closed_on_error(self) -> Iterator[None]:
        """Close the progress bar when the block raises, so the error starts its own line."""
        try:
            yield
        except BaseException:
            if self.bar is not None:
                self.bar.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            raise

    def stopped(self, message: str) -> None:
        """Close the bar and print why the run stops, as the one line ``mf-train: ...``."""
        if self.active:
            self.bar.close()
            print(f"mf-train: {message}", file=sys.stderr, flush=True)

    def interrupted(self, step: int) -> None:
        """Note an interrupted run."""
        if self.active:
            self.bar.write(f"interrupted at step {step}: checkpoint saved, resume with --resume")

    def finish(
        self, sample: str | None, checkpoint: Path | None, exported: Path | None = None
    ) -> dict[str, Any]:
        """Close the bar, write the sample and plot; return the run summary."""
        if not self.active:
            return {}
        self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        seconds = time.perf_counter() - self.started
        last = self.history[-1] if self.history else {}
        validations = [r["validation_loss"] for r in self.history if "validation_loss" in r]
        rates = [r["tokens_per_s"] for r in self.history[1:]] or [last.get("tokens_per_s", 0.0)]
        utilisations = [r["mfu"] for r in self.history[1:] if "mfu" in r]
        summary: dict[str, Any] = {
            "steps": last.get("step", 0),
            "final_train_loss": last.get("loss"),
            "final_validation_loss": validations[-1] if validations else None,
            "seconds": round(seconds, 1),
            "tokens_per_s": round(sum(rates) / len(rates), 1),
            "mfu": round(sum(utilisations) / len(utilisations), 4) if utilisations else None,
            "checkpoint": str(checkpoint) if checkpoint else None,
            "export": str(exported) if exported else None,
            "out_dir": str(self.out_dir),
            "metrics": str(self.metrics_path),
            "loss_curve": self._plot(),
        }
        if sample is not None:
            sample_path = self.out_dir / "sample.txt"
            sample_path.write_text(sample)
            summary["sample"] = sample
        return summary

    def _plot(self) -> str:
        """Draw the loss curves and the throughput into ``loss.png`` (unless --no-plot)."""
        if not self.options.plot:
            return "skipped (--no-plot)"
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history]
        figure, (losses, speed) = plt.subplots(
            2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1)
        )
        losses.plot(steps, [r["loss"] for r in self.history], label="train")
        points = [(r["step"], r["validation_loss"]) for r in self.history if "validation_loss" in r]
        if points:
            losses.plot(*zip(*points, strict=True), "o-", label="validation")
        losses.set_ylabel("loss (nats/byte)")
        losses.legend()
        speed.plot(steps, [r["tokens_per_s"] for r in self.history], color="gray")
        speed.set_ylabel("tokens/s")
        speed.set_xlabel("step")
        path = self.out_dir / "loss.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        return str(path)
