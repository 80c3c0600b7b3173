"""What a ``mf-train`` user sees and keeps: progress bar, metrics file, loss curve, sample.

Only rank 0 reports; on other ranks every method is a no-op.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from mf.train.options import TrainOptions

__all__ = ["Reporter"]


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
        self.bar = None
        if not active:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.history = self._earlier_records(start_step)
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        from tqdm import tqdm

        print(
            f"mf-train: {options.model} GPT ({parameters / 1e6:.1f}M parameters), "
            f"{options.nproc} processes (tp={options.tp}, "
            f"dp_outer={options.dp_outer}, ZeRO-{options.zero}, {options.precision}), "
            f"corpus {corpus}: {train_tokens:,} train / {validation_tokens:,} validation tokens",
            flush=True,
        )
        if start_step:
            print(f"mf-train: resumed from {options.ckpt_dir} at step {start_step}", flush=True)
        self.bar = tqdm(total=options.steps, initial=start_step, desc="train", unit="step")

    def _earlier_records(self, start_step: int) -> list[dict[str, Any]]:
        """The metrics of the steps a resumed run keeps (up to ``start_step``)."""
        if start_step == 0 or not self.metrics_path.is_file():
            return []
        records = (json.loads(line) for line in self.metrics_path.read_text().splitlines() if line)
        return [record for record in records if record["step"] <= start_step]

    def step(
        self,
        step: int,
        loss: float,
        validation: float | None,
        tokens_per_s: float,
        device: torch.device,
    ) -> None:
        """Record one optimizer step."""
        if not self.active:
            return
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "time": time.time()}
        if validation is not None:
            record["validation_loss"] = validation
            self.bar.write(f"step {step}: train loss {loss:.4f}, validation loss {validation:.4f}")
        self.history.append(record)
        with open(self.metrics_path, "a") as out:
            out.write(json.dumps(record) + "\n")
        self.bar.set_postfix(
            loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", mem=f"{_memory_mib(device):.0f}MiB"
        )
        self.bar.update(1)

    def saved(self, path: Path) -> None:
        """Note a checkpoint."""
        if self.active:
            self.bar.write(f"checkpoint saved: {path}")

    def interrupted(self, step: int) -> None:
        """Note an interrupted run."""
        if self.active:
            self.bar.write(f"interrupted at step {step}: checkpoint saved, resume with --resume")

    def finish(self, sample: str | None, checkpoint: Path | None) -> dict[str, Any]:
        """Close the bar, write the sample and plot; return the run summary."""
        if not self.active:
            return {}
        self.bar.close()
        seconds = time.perf_counter() - self.started
        last = self.history[-1] if self.history else {}
        validations = [r["validation_loss"] for r in self.history if "validation_loss" in r]
        rates = [r["tokens_per_s"] for r in self.history[1:]] or [last.get("tokens_per_s", 0.0)]
        summary: dict[str, Any] = {
            "steps": last.get("step", 0),
            "final_train_loss": last.get("loss"),
            "final_validation_loss": validations[-1] if validations else None,
            "seconds": round(seconds, 1),
            "tokens_per_s": round(sum(rates) / len(rates), 1),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "metrics": str(self.metrics_path),
            "loss_curve": self._plot(),
        }
        if sample is not None:
            sample_path = self.out_dir / "sample.txt"
            sample_path.write_text(sample)
            summary["sample"] = sample
        return summary

    def _plot(self) -> str:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return "skipped: matplotlib is not installed (pip install matplotlib for a PNG)"
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot(
            [r["step"] for r in self.history], [r["loss"] for r in self.history], label="train"
        )
        points = [(r["step"], r["validation_loss"]) for r in self.history if "validation_loss" in r]
        if points:
            axes.plot(*zip(*points, strict=True), "o-", label="validation")
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats/byte)")
        axes.legend()
        path = self.out_dir / "loss.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        return str(path)
