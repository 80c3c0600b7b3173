"""What trusting a checkpoint costs: save, verified load and unverified load, side by side.

One run on ``--world`` local gloo processes trains a GPT preset (ZeRO-3, Adam)
for one step, then times, on every rank (the slowest rank is reported):

- ``save``: ``mf_fsdp.save_checkpoint`` (DCP's write, then every data file
  hashed with SHA-256, the ranks sharing the files, and the record written);
- ``hash``: the hashing alone, as a save and a verified load run it;
- ``load verified`` / ``load unverified``: ``load_checkpoint`` with
  ``verify=True`` (the default: every file hashed again and compared) and with
  ``verify=False``;
- ``async blocked`` / ``async total``: ``save_checkpoint(..., async_save=True)``
  until it returns (the state copied into host memory: what training waits
  for) and until its future is done (the checkpoint published).

The checkpoint's size is every data file's bytes (fp32 weights and the two Adam
moments). Loads follow saves immediately, so the files are in the page cache:
the hashing cost measured is the CPU's, not the disk's.

Run: ``uv run --no-sync python benchmarks/checkpoint_cost.py --preset 150m``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["main", "measure"]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(action: Callable[[], Any], repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's time for ``action``."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        action()
        times.append(_slowest(time.perf_counter() - start))
    return statistics.median(times)


def _timed_async(save: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Medians of the slowest rank's time until ``save`` returns, and until it is done."""
    blocked, total = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        future = save()
        returned = time.perf_counter()
        future.result()
        blocked.append(_slowest(returned - start))
        total.append(_slowest(time.perf_counter() - start))
    return statistics.median(blocked), statistics.median(total)


def measure(preset: str, folder: str, repeats: int) -> dict[str, float]:
    """Time save, hashing and both loads on this rank's process group (collective)."""
    import mf_fsdp
    from mf.models import GPT, PRESETS, Block
    from mf_fsdp.checkpoint.integrity import data_files, digest_folder

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    torch.manual_seed(0)
    module = GPT(PRESETS[preset])
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    model, optimizer = mf_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block])
    tokens = torch.randint(0, PRESETS[preset].vocab_size, (1, 33))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    root = Path(folder)
    save = _timed(lambda: mf_fsdp.save_checkpoint(root, model, optimizer, step=1), repeats)
    blocked, total = _timed_async(
        lambda: mf_fsdp.save_checkpoint(root, model, optimizer, step=2, async_save=True), repeats
    )
    path = mf_fsdp.latest_checkpoint(root)
    assert path is not None
    names = data_files(path, mf_fsdp.RECORD_FILE)
    digest = _timed(lambda: digest_folder(path, names), repeats)
    verified = _timed(lambda: mf_fsdp.load_checkpoint(path, model, optimizer), repeats)
    unverified = _timed(
        lambda: mf_fsdp.load_checkpoint(path, model, optimizer, verify=False), repeats
    )
    size = sum((path / name).stat().st_size for name in names)
    return {
        "bytes": float(size),
        "save": save,
        "hash": digest,
        "load verified": verified,
        "load unverified": unverified,
        "async blocked": blocked,
        "async total": total,
    }


def _worker(preset: str, folder: str, repeats: int) -> dict[str, float]:
    dist.init_process_group("gloo")
    try:
        return measure(preset, folder, repeats)
    finally:
        dist.destroy_process_group()


def _launch(preset: str, world: int, repeats: int) -> dict[str, float]:
    from torch.distributed.launcher.api import elastic_launch

    from mf.launch import local_launch_config, new_run_id

    config = local_launch_config(world, new_run_id("checkpoint-cost"))
    with tempfile.TemporaryDirectory() as folder:
        return elastic_launch(config, _worker)(preset, folder, repeats)[0]


def report(preset: str, world: int, result: dict[str, float]) -> list[str]:
    """The printed table: each phase's median seconds, and hashing's share of a verified load."""
    mib = result["bytes"] / 2**20
    lines = [f"== preset {preset}, world {world}: checkpoint {mib:.1f} MiB =="]
    for phase in (
        "save",
        "hash",
        "load verified",
        "load unverified",
        "async blocked",
        "async total",
    ):
        rate = mib / result[phase] if result[phase] else float("inf")
        lines.append(f"{phase:<16} {result[phase] * 1e3:9.1f} ms  {rate:9.1f} MiB/s")
    extra = result["load verified"] - result["load unverified"]
    lines.append(
        f"verification adds {extra * 1e3:.1f} ms to a load "
        f"({100 * extra / result['load unverified']:.0f}%)"
    )
    lines.append(
        f"an asynchronous save blocks training for {result['async blocked'] * 1e3:.1f} ms "
        f"({100 * result['async blocked'] / result['save']:.0f}% of a synchronous save)"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurement and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="150m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = _launch(args.preset, args.world, args.repeats)
    print("\n".join(report(args.preset, args.world, result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
