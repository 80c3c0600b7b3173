"""Micro-benchmark: a MoE layer's experts as grouped weights against the per-expert loop.

Runs forward + backward of ``E`` experts (``out(gelu(fc(x)))``) over the same routed rows
three ways, side by side in one process on one device:

- ``loop``: one ``mf_tp.ExpertMLP`` per expert and ``torch.cat``, as ``MoELayer`` ran them
  before mf-tp 0.3 (two ``nn.Linear`` per expert);
- ``grouped-loop``: ``mf_tp.GroupedExperts`` on its exact per-expert fallback;
- ``grouped``: ``mf_tp.GroupedExperts`` on ``torch._grouped_mm`` (where torch has it).

Rows are spread over the experts as a top-k router spreads them (a multinomial draw).
Printed: median ms per forward + backward, tokens/s, ratio to ``loop``, the peak memory
on CUDA (``torch.cuda.max_memory_allocated``), and the kernels launched per step on CUDA.

Run: ``uv run --no-sync python benchmarks/moe_experts.py [--experts 16,64 --hidden 256
--ffn 512 --tokens 4096 --top-k 2 --device cpu --dtype float32]``
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from unittest import mock

import torch

import mf_tp
from mf_tp import grouped_experts


def _rows(experts: int, tokens: int, top_k: int, device: torch.device) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    choice = torch.multinomial(torch.ones(experts), tokens * top_k, replacement=True, generator=gen)
    return torch.bincount(choice, minlength=experts).tolist()


def _loop_step(singles: list[mf_tp.ExpertMLP], x: torch.Tensor, *, rows: list[int]) -> torch.Tensor:
    return torch.cat([s(b) for s, b in zip(singles, x.split(rows), strict=True)])


def _time(fn, x: torch.Tensor, iters: int, device: torch.device) -> tuple[float, float, int]:
    """Median ms of forward + backward, peak MiB (CUDA), kernels per step (CUDA)."""
    for _ in range(3):
        fn(x).sum().backward()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        start = time.perf_counter()
        fn(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    kernels = 0
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(x).sum().backward()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return 1000 * statistics.median(times), peak, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="16,64")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, {device}, {args.dtype}, H {args.hidden}, F {args.ffn}, "
        f"{args.tokens} tokens, top-{args.top_k}, {torch.get_num_threads()} threads"
    )
    header = f"{'experts':>7} {'way':<20} {'ms':>8} {'tokens/s':>10} {'x loop':>7}"
    print(f"{header} {'peak MiB':>9} kernels")
    for experts in (int(e) for e in args.experts.split(",")):
        torch.manual_seed(0)
        singles = [mf_tp.ExpertMLP(args.hidden, args.ffn).to(device, dtype) for _ in range(experts)]
        grouped = mf_tp.GroupedExperts(experts, args.hidden, args.ffn, device=device, dtype=dtype)
        grouped.load_initial_weights([dict(s.named_parameters()) for s in singles])
        rows = _rows(experts, args.tokens, args.top_k, device)
        x = torch.randn(sum(rows), args.hidden, device=device, dtype=dtype)
        x.requires_grad_(True)
        path = grouped_experts.grouped_mm_path(x, grouped.fc_weight)
        grouped_step = functools.partial(grouped, rows_per_expert=rows)
        ways = {
            "loop": functools.partial(_loop_step, singles, rows=rows),
            "grouped-loop": grouped_step,
            "grouped": grouped_step,
        }
        base = None
        for name, fn in ways.items():
            forced = "loop" if name == "grouped-loop" else path
            with mock.patch.object(grouped_experts, "grouped_mm_path", return_value=forced):
                ms, peak, kernels = _time(fn, x, args.iters, device)
            base = base or ms
            label = name if name != "grouped" else f"grouped ({path})"
            print(
                f"{experts:>7} {label:<20} {ms:8.2f} {args.tokens / ms * 1000:10.0f} "
                f"{base / ms:7.2f} {peak:9.1f} {kernels}"
            )


if __name__ == "__main__":
    main()
