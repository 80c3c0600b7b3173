"""Micro-benchmark: ColumnParallelLinear -> GeLU -> RowParallelLinear at TP=2 vs no TP.

Times forward + backward of the tensor-parallel MLP on 2 spawned gloo ranks
(one thread each), with and without sequence parallelism, against the same
math in one process with plain torch (``F.linear``; one thread, and as many
threads as TP ranks), and counts the bytes every collective was handed
against the theoretical amount.

Bytes: "payload" is the full logical tensor of a collective (the all-reduced
tensor, the all-gather output, the reduce-scatter input). The theoretical
payload per step is one ``[S, B, H]`` activation for each all-reduce,
all-gather or reduce-scatter the Megatron scheme needs: without sequence
parallelism one all-reduce forward (row output) and one backward (column input
gradient); with it one all-gather + one reduce-scatter each way, plus the
all-gather that recomputes the column input in backward. A ring moves
``2 (t-1)/t`` of the payload per rank for an all-reduce and ``(t-1)/t`` for an
all-gather or reduce-scatter ("wire/rank").

Run: ``.venv/bin/python benchmarks/tp_linear.py [--seq 128 --batch 4 --hidden 512 --iters 20]``
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import mf_tp

TP = 2
_COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _install_counter(counts: collections.Counter) -> None:
    """Wrap the collectives mf_tp calls so each records its full logical payload."""

    def wrap(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if name == "all_reduce":
                full = args[0]
            elif name == "all_gather_into_tensor":
                full = args[0]  # the output holds every rank's piece
            else:
                full = args[1]  # reduce-scatter: the full input
            nbytes = full.numel() * full.element_size()
            counts[(name, "calls")] += 1
            counts[(name, "bytes")] += nbytes
            return original(*args, **kwargs)

        return counted

    for name in _COUNTED:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _step_time(fn: Callable[[], None], iters: int, warmup: int, sync: bool) -> float:
    for _ in range(warmup):
        fn()
    if sync:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync:
        dist.barrier()
    return (time.perf_counter() - start) / iters


def _rank(rank: int, init_file: str, args: argparse.Namespace, results: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    mf_tp.initialize_model_parallel(TP)
    counts: collections.Counter = collections.Counter()
    _install_counter(counts)
    S, B, H = args.seq, args.batch, args.hidden
    for sequence_parallel in (False, True):
        config = mf_tp.ModelParallelConfig(
            tensor_model_parallel_size=TP,
            sequence_parallel=sequence_parallel,
            use_cpu_initialization=True,
        )
        torch.manual_seed(0)
        fc1 = mf_tp.ColumnParallelLinear(H, 4 * H, config=config, init_method=torch.nn.init.normal_)
        fc2 = mf_tp.RowParallelLinear(
            4 * H,
            H,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        rows = S // TP if sequence_parallel else S
        x = torch.randn(rows, B, H, requires_grad=True)

        def step(fc1=fc1, fc2=fc2, x=x) -> None:
            out, _ = fc2(F.gelu(fc1(x)[0]))
            out.sum().backward()

        seconds = _step_time(step, args.iters, args.warmup, sync=True)
        counts.clear()
        step()  # one counted step
        if rank == 0:
            results[sequence_parallel] = (seconds, dict(counts))
    mf_tp.destroy_model_parallel()
    dist.destroy_process_group()


def _baseline(args: argparse.Namespace, threads: int) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    S, B, H = args.seq, args.batch, args.hidden
    w1 = torch.randn(4 * H, H, requires_grad=True)
    b1 = torch.zeros(4 * H, requires_grad=True)
    w2 = torch.randn(H, 4 * H, requires_grad=True)
    b2 = torch.zeros(H, requires_grad=True)
    x = torch.randn(S, B, H, requires_grad=True)

    def step() -> None:
        F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2).sum().backward()

    return _step_time(step, args.iters, args.warmup, sync=False)


def _theory(sequence_parallel: bool) -> dict[str, tuple[int, float]]:
    """Collective -> (calls per step, wire bytes per rank per call factor)."""
    ring = (TP - 1) / TP
    if not sequence_parallel:
        return {"all_reduce": (2, 2 * ring)}
    return {"all_gather_into_tensor": (3, ring), "reduce_scatter_tensor": (2, ring)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    S, B, H = args.seq, args.batch, args.hidden
    activation_bytes = S * B * H * 4

    manager = mp.Manager()
    results = manager.dict()
    with tempfile.TemporaryDirectory(prefix="mf-tp-bench-") as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "rdzv"), args, results), nprocs=TP, join=True)
    base_1 = _baseline(args, 1)
    base_t = _baseline(args, TP)

    print(
        f"Column({H}->{4 * H}) -> GeLU -> Row({4 * H}->{H}), x=[S={S}, B={B}, H={H}] fp32, "
        f"gloo, TP={TP}, {args.iters} iters"
    )
    print(f"no TP, 1 thread      : {base_1 * 1e3:8.2f} ms/step")
    print(f"no TP, {TP} threads     : {base_t * 1e3:8.2f} ms/step")
    for sequence_parallel in (False, True):
        seconds, counts = results[sequence_parallel]
        label = "TP=2 + SP" if sequence_parallel else "TP=2     "
        print(
            f"{label}, 1 thr/rank : {seconds * 1e3:8.2f} ms/step   "
            f"ratio vs 1 thread {seconds / base_1:5.2f}x, vs {TP} threads {seconds / base_t:5.2f}x"
        )
        for name, (calls, wire) in _theory(sequence_parallel).items():
            got_calls = counts.get((name, "calls"), 0)
            got_bytes = counts.get((name, "bytes"), 0)
            print(
                f"    {name:24s} calls {got_calls} (theory {calls})  payload "
                f"{got_bytes / 2**20:6.2f} MiB (theory {calls * activation_bytes / 2**20:6.2f} MiB)"
                f"  wire/rank {got_bytes * wire / 2**20:6.2f} MiB"
            )
        extra = set(n for n, _ in counts) - set(_theory(sequence_parallel))
        for name in sorted(extra):
            print(f"    unexpected collective {name}: {counts[(name, 'calls')]} calls")


if __name__ == "__main__":
    main()
