"""``mf-bench --moe``: mf-tp's grouped experts against the per-expert loop, and EP dispatch bytes.

- :func:`expert_rows`: forward + backward of ``E`` experts over the same routed
  rows (a top-k router's spread, a multinomial draw), two ways: ``loop``, one
  ``mf_tp.ExpertMLP`` per expert and a ``torch.cat`` (how ``MoELayer`` ran its
  experts before mf-tp 0.3), and ``grouped``, ``mf_tp.GroupedExperts`` on the
  path ``grouped_experts.grouped_mm_path`` picks (``torch._grouped_mm`` where
  torch has it), on one intra-op thread. Each way runs in a fresh process, so
  its peak memory is its own: CUDA's ``max_memory_allocated``, else the resident high-water mark
  (``VmHWM``) above what the process held before its first step.
- :func:`dispatch_rows`: ``mf_tp.MoELayer`` with its experts over an EP group
  of ``world`` ranks, one forward + backward: the bytes each rank's
  all-to-alls send (``CommCounter``: dispatch, combine and both backwards,
  the split-size exchanges included) against the least the routed tokens
  need: each token once to every other EP rank holding one of its top-k
  experts, there in the dispatch and back in the combine, and again both ways
  in the backward; a rank sends its own tokens' rows and the rows of the
  tokens others sent it (``2 x (pairs out + pairs in) x H x itemsize``). mf-tp
  sends one row per (token, receiving rank) and, beside it, the row's local
  experts and router weights (``k`` each); the per-choice column counts what one
  row per (token, expert) choice sent (mf-tp before 0.5: a token whose two
  experts share a rank went twice).

It must not: change what MoELayer or GroupedExperts compute (it only calls them).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import mf_tp
from mf.bench.comm_counter import CommCounter
from mf_tp import grouped_experts

__all__ = ["DispatchBytes", "ExpertsRun", "dispatch_rows", "expert_rows", "moe_tables"]

WAYS = ("loop", "grouped")


@dataclass(frozen=True)
class ExpertsRun:
    """One way of running the experts: its median step, tokens/s and peak memory."""

    way: str
    path: str
    ms: float
    tokens_per_s: float
    peak_bytes: int


@dataclass(frozen=True)
class DispatchBytes:
    """One rank's all-to-all bytes for a step, and the least the routed tokens need."""

    sent: float
    least: float
    per_choice: float
    calls: dict[str, int]


def _rows_per_expert(experts: int, tokens: int, top_k: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    picks = torch.multinomial(
        torch.ones(experts), tokens * top_k, replacement=True, generator=generator
    )
    return torch.bincount(picks, minlength=experts).tolist()


def _resident(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _experts_way(
    way: str, experts: int, hidden: int, ffn: int, tokens: int, top_k: int, iters: int, device: str
) -> ExpertsRun:
    """Time one way in this (fresh) process; see the module docstring."""
    target = torch.device(device)
    torch.set_num_threads(1)  # one intra-op thread: a shared machine's cores do not drift it
    torch.manual_seed(0)
    rows = _rows_per_expert(experts, tokens, top_k)
    x = torch.randn(sum(rows), hidden, device=target, requires_grad=True)
    grouped = mf_tp.GroupedExperts(experts, hidden, ffn, device=target)
    path = grouped_experts.grouped_mm_path(x, grouped.fc_weight)
    step: Callable[[torch.Tensor], torch.Tensor]
    if way == "loop":
        singles = [mf_tp.ExpertMLP(hidden, ffn).to(target) for _ in range(experts)]
        del grouped
        path = "per-expert modules"

        def step(inputs: torch.Tensor) -> torch.Tensor:
            pieces = inputs.split(rows)
            return torch.cat([single(piece) for single, piece in zip(singles, pieces, strict=True)])
    else:
        step = functools.partial(grouped, rows_per_expert=rows)
    if target.type == "cuda":
        torch.cuda.synchronize(target)
        torch.cuda.reset_peak_memory_stats(target)
        base = torch.cuda.memory_allocated(target)
    else:
        base = _resident("VmRSS")
    times = []
    for i in range(iters + 2):  # two unmeasured steps first
        start = time.perf_counter()
        step(x).sum().backward()
        if target.type == "cuda":
            torch.cuda.synchronize(target)
        if i >= 2:
            times.append(time.perf_counter() - start)
    if target.type == "cuda":
        peak = torch.cuda.max_memory_allocated(target) - base
    else:
        peak = _resident("VmHWM") - base
    ms = 1000 * statistics.median(times)
    return ExpertsRun(way, path, ms, tokens / ms * 1000, max(peak, 0))


def expert_rows(
    experts: int, hidden: int, ffn: int, tokens: int, top_k: int, iters: int, device: str
) -> list[ExpertsRun]:
    """Both ways, each in a fresh spawned process (see the module docstring)."""
    from torch.multiprocessing import get_context

    runs = []
    for way in WAYS:
        with get_context("spawn").Pool(1) as pool:
            args = (way, experts, hidden, ffn, tokens, top_k, iters, device)
            runs.append(pool.apply(_experts_way, args))
    return runs


def _dispatch_rank(
    experts: int, hidden: int, ffn: int, tokens: int, top_k: int, device: str
) -> DispatchBytes:
    """One rank of :func:`dispatch_rows` (started by torch's elastic launcher)."""
    target = torch.device(device)
    if target.type == "cuda":
        target = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(target)
    dist.init_process_group("nccl" if target.type == "cuda" else "gloo")
    try:
        group = dist.group.WORLD
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        layer = mf_tp.MoELayer(hidden, ffn, experts, top_k, ep_group=group, device=target)
        chosen: list[torch.Tensor] = []
        layer.router.register_forward_hook(
            lambda _module, _inputs, routing: chosen.append(routing.expert_indices)
        )
        generator = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(tokens, hidden, generator=generator).to(target)
        counter = CommCounter()
        with counter.installed():
            counter.enabled = True
            layer(x).sum().backward()
            counter.enabled = False
        owner = chosen[0] // layer.num_local_experts  # [T, k] EP rank of each choice
        # [sender, receiver]: rows one row per (token, receiving rank) needs, and per choice.
        rows = torch.zeros(2, world, world, dtype=torch.float64)
        for choices in owner.tolist():
            for receiver in set(choices):
                rows[0, rank, receiver] += 1
            for receiver in choices:
                rows[1, rank, receiver] += 1
        dist.all_reduce(rows)  # counted by no one: the counter is off
        rows.diagonal(dim1=1, dim2=2).zero_()  # what stays on its rank moves no bytes
        # Forward: my tokens out (dispatch), theirs back (combine); the backward: the reverse.
        moved = 2 * (rows[:, rank, :].sum(dim=1) + rows[:, :, rank].sum(dim=1))
        row_bytes = hidden * x.element_size()
        return DispatchBytes(
            sent=counter.bytes_sent,
            least=float(moved[0]) * row_bytes,
            per_choice=float(moved[1]) * row_bytes,
            calls=dict(counter.calls),
        )
    finally:
        dist.destroy_process_group()


def dispatch_rows(
    world: int, experts: int, hidden: int, ffn: int, tokens: int, top_k: int, device: str
) -> list[DispatchBytes]:
    """Every rank's bytes, from ``world`` fresh processes (EP over all of them)."""
    from torch.distributed.launcher.api import elastic_launch

    from mf.launch import local_launch_config, new_run_id

    config = local_launch_config(world, new_run_id("mf-bench-moe"))
    results: dict[int, Any] = elastic_launch(config, _dispatch_rank)(
        experts, hidden, ffn, tokens, top_k, device
    )
    return [results[rank] for rank in sorted(results)]


def moe_tables(
    world: int,
    experts: list[int],
    hidden: int,
    ffn: int,
    tokens: int,
    top_k: int,
    iters: int,
    device: str,
) -> list[str]:
    """The printed rows of ``mf-bench --moe``."""
    lines = [
        f"MoE experts: forward + backward, H {hidden}, F {ffn}, {tokens} tokens, top-{top_k}, "
        f"{device}",
        f"{'experts':>7} {'way':<9} {'path':<20} {'ms':>8} {'tokens/s':>10} {'x loop':>7} "
        f"{'peak MiB':>9} {'x loop':>7}",
    ]
    for count in experts:
        runs = expert_rows(count, hidden, ffn, tokens, top_k, iters, device)
        loop = runs[0]
        for run in runs:
            lines.append(
                f"{count:>7} {run.way:<9} {run.path:<20} {run.ms:8.2f} {run.tokens_per_s:10.0f} "
                f"{run.tokens_per_s / loop.tokens_per_s:7.2f} {run.peak_bytes / 2**20:9.1f} "
                f"{run.peak_bytes / max(loop.peak_bytes, 1):7.2f}"
            )
    lines += [
        "",
        f"MoE EP dispatch: MoELayer at ep {world}, {experts[-1]} experts, {tokens} tokens per "
        "rank, one forward + backward; all-to-all bytes each rank sends against the least the "
        "routed tokens need (each token once per other EP rank holding one of its experts, "
        "4 ways) and against one row per (token, expert) choice",
        f"{'rank':>4} {'sent KiB':>9} {'least KiB':>9} {'x least':>7} {'per-choice KiB':>14} "
        f"{'x per-choice':>12}",
    ]
    rows = dispatch_rows(world, experts[-1], hidden, ffn, tokens, top_k, device)
    for rank, row in enumerate(rows):
        lines.append(
            f"{rank:>4} {row.sent / 1024:9.1f} {row.least / 1024:9.1f} "
            f"{row.sent / max(row.least, 1):7.2f} {row.per_choice / 1024:14.1f} "
            f"{row.sent / max(row.per_choice, 1):12.2f}"
        )
    kinds = ", ".join(f"{count} {name}" for name, count in sorted(rows[0].calls.items()))
    lines.append(f"collectives per step and rank: {kinds or 'none'}")
    return lines
