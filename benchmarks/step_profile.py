"""Where one engine's training step spends the host's time: a profile of a few steps, world 1.

``host_cost.py`` says how much a step costs the host against plain PyTorch;
this says where, on the CPU or a GPU. It builds ``mf-bench``'s engine on a
one-rank group (NCCL on CUDA, gloo on the CPU), warms up, then prints:

- the wall ms of a step (synchronised) and, on CUDA, the ms the GPU was busy
  with kernels in it: a step whose GPU is busy much less than its wall time
  is bounded by the host;
- the Python functions with the most time of their own (``cProfile``);
- the aten ops and kernels with the most host time of their own (torch's
  profiler).

Run: ``python benchmarks/step_profile.py --engine mf-zero3 --preset 150m --device cuda
--precision bf16 --micro-batch 4 --seq-len 512``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from mf.bench.engines import AUTOCAST, ENGINES, OPTIMIZERS, build_engine
from mf.bench.worker import train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(args: argparse.Namespace, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from mf.models import GPT, PRESETS

    torch.manual_seed(0)
    config = PRESETS[args.preset]
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    bf16 = args.precision == "bf16"
    model = GPT(config).to(device)
    model, optimizers = build_engine(args.engine, model, mesh, 1e-4, args.optimizer, bf16)
    autocast = bf16 and args.engine in AUTOCAST
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1))
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))

    def step() -> None:
        train_step(model, optimizers, batch, autocast, device)

    for _ in range(args.warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps

    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(args.steps):
        step()
    _sync(device)
    profiler.disable()

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        _sync(device)

    print(f"== {args.engine} {args.preset} {args.precision} on {device}: {wall_ms:.2f} ms/step")
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.device_time for e in kernels) / 1e3 / args.steps
        print(f"GPU busy {busy_ms:.2f} ms/step in {len(kernels) // args.steps} kernels")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue().split("\n", 4)[-1])  # drop the header about the profiler itself
    sort = "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))


def main(argv: Sequence[str] | None = None) -> int:
    """Profile ``--engine`` on one rank and print where its steps' host time goes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="mf-zero3", choices=sorted(ENGINES))
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    args = parser.parse_args(argv)
    with socket.socket() as probe:  # a free port for the one-rank rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        _profile(args, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
