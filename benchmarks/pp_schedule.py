"""One pipeline schedule on mf and on torch's FSDP2, side by side: bytes held, moved, host ops.

torchtitan's ``pipeline_llm`` splits its Llama 3 debugmodel (``--layers`` blocks,
SDPA attention, vocab 2048, width 256) into two stages, ``parallelize_llama``
shards each stage's part over two dp ranks (``fully_shard`` being torch's, then
mf's ``mf_fsdp.fsdp2.fully_shard``) and torch's ``Schedule1F1B`` runs
``--microbatches`` micro-batches of one sequence per step: PP 2 x FSDP 2, world
4 on gloo, one intra-op thread per rank. Both engines are built in the same
ranks, from torchtitan's own initialisation, and step with AdamW. Under PP
torchtitan keeps each unit gathered after its forward (``reshard_after_forward``
False), and torch's stages turn gradient sync off for every micro-batch's
backward and finalize once a step.

Measured on each rank, after ``--warmup`` steps (torch's shape inference, the
builds, the optimizer state):

- ``held``: the bytes of every tensor storage alive after each micro-batch's
  forward and backward (the largest over a step) and after the step. A
  ``TorchDispatchMode`` entered before the models are built keeps a weak
  reference to every storage an op makes; a storage's bytes are its size now
  (mf resizes its released buffers to zero). This covers the weights (sharded
  and gathered), the gradients, the optimizer state, the engines' buffers and
  the activations the schedule keeps for its backwards (the same under both
  engines); it misses what gloo allocates in C++. ``of it pool``: mf's idle
  pooled temporaries after the step (on the CPU mf pools its large
  whole-bucket buffers; on a GPU the caching allocator keeps such bytes
  reserved, not allocated).
- ``moved``: the bytes this rank sends per step over the data-parallel group
  (``mf.bench.CommCounter``: all-gather, reduce-scatter, all-reduce in the
  ring model, gloo's point-to-point batches exactly), against the ZeRO-3
  minimum with ``reshard_after_forward=False``: one all-gather of the stage's
  weights and one reduce-scatter of its gradients a step, each sending
  ``(dp - 1) / dp`` of the stage's fp32 bytes. The activations sent between
  the stages (the pp group) are the schedule's, the same under both engines,
  and printed apart.
- ``ops``: the aten ops one step dispatches (torch's profiler, as
  ``benchmarks/host_cost.py``), over the micro-batches.

Rank 0 prints one row per stage (its first dp rank) and engine, and mf's
ratio to torch's FSDP2.

Run: ``uv run --no-sync python -m benchmarks.pp_schedule [--layers 4 --microbatches 4
--seq 16 --steps 2]`` (from the repository root: it imports the torchtitan model
of ``tests/integration/_torchtitan_llama_parts.py``)
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from mf.bench import CommCounter
from mf.bench.comm_counter import group_key
from mf_fsdp import fsdp2
from mf_fsdp.fsdp2.records import RECORD_ATTR

__all__ = ["ENGINES", "StageCost", "main", "measure", "report"]

ENGINES: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("fsdp2", torch_fully_shard),
    ("mf", fsdp2.fully_shard),
)
"""The engines compared, torch's first: every ratio is mf's over it."""
VOCAB = 2048
GPU_COST = (
    "what each costs a GPU: held bytes are HBM the step cannot give to activations or a "
    "larger micro-batch; moved bytes take bytes / link bandwidth of the dp collectives "
    "(about 1 ms per 100 MB at NVLink's 100 GB/s a direction, 10x that over a 100 Gb/s "
    "NIC), hidden only where the schedule overlaps them; every aten op costs the host "
    "a few microseconds of dispatch and launch, which a small micro-batch does not hide"
)


class LiveStorages(TorchDispatchMode):
    """Weak references to every storage an op makes while active; their bytes now.

    A tensor subclass (DTensor) is opened to the plain tensors inside it. The
    storages of ``holders()`` (the parameters, their grads, the optimizer's
    state) count too, wherever they were made.
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.holders: Callable[[], list[Any]] = list

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _plain_tensors(out):
            storage = tensor.untyped_storage()
            self._storages.setdefault(storage._cdata, weakref.ref(storage))
        return out

    def live_bytes(self) -> int:
        """The bytes of the recorded storages still alive (forgetting the dead ones)."""
        gc.collect()  # what only a reference cycle keeps is not held
        for tensor in _plain_tensors(self.holders()):
            storage = tensor.untyped_storage()
            self._storages.setdefault(storage._cdata, weakref.ref(storage))
        total = 0
        for key, ref in list(self._storages.items()):
            storage = ref()
            if storage is None:
                del self._storages[key]
            else:
                total += storage.nbytes()
        return total


def _plain_tensors(tree: Any) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(tree):
        if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            yield from _plain_tensors([getattr(leaf, name) for name in names])
        else:
            yield leaf


@dataclass
class StageCost:
    """One rank's measurements for one engine: the most over the measured steps, or the mean."""

    engine: str
    pp_rank: int
    stage_bytes: int = 0  # the stage's fp32 weights, whole
    dp: int = 1
    held_max: int = 0  # the most bytes alive after a micro-batch's forward or backward
    held_after: int = 0  # alive after the step (weights, optimizer state, what stays)
    pool_after: int = 0  # of which mf's idle pooled temporaries (the module doc)
    moved_dp: float = 0.0  # sent over the data-parallel group
    moved_pp: float = 0.0  # sent between the stages
    ops: int = 0
    microbatches: int = 1
    samples: list[int] = field(default_factory=list)

    @property
    def moved_min(self) -> float:
        """ZeRO-3 kept gathered: one all-gather and one reduce-scatter of the stage a step."""
        return 2 * self.stage_bytes * (self.dp - 1) / self.dp


def _sampled(stage: Any, tracker: LiveStorages, samples: list[int]) -> None:
    """Record the live bytes after each of ``stage``'s micro-batch forwards and backwards."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        original = getattr(stage, name)

        def after(*args: Any, _original=original, **kwargs: Any) -> Any:
            out = _original(*args, **kwargs)
            samples.append(tracker.live_bytes())
            return out

        setattr(stage, name, after)


def _pool_bytes(part: torch.nn.Module) -> int:
    """mf's idle pooled temporaries and receive buffers for ``part`` (none under FSDP2)."""
    record = part.__dict__.get(RECORD_ATTR)
    return 0 if record is None else record.engine.memory_footprint()["pool"]


def _step(schedule: Any, tokens: torch.Tensor, first: bool, last: bool, opt: Any) -> None:
    schedule.step(
        tokens[:, :-1] if first else None,
        target=tokens[:, 1:] if last else None,
        losses=[] if last else None,
    )
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(
    layers: int = 4, microbatches: int = 4, seq: int = 16, steps: int = 2, warmup: int = 2
) -> list[StageCost]:
    """This rank's costs under each engine (collective: every rank of a world-4 gloo group)."""
    from tests.integration._torchtitan_llama_parts import PipelineCase

    case = PipelineCase(2, 2, 1, "1F1B", layers=layers, local_batch=microbatches, seq=seq)
    costs = []
    for name, shard in ENGINES:
        costs.append(_measure_engine(name, shard, case, steps, warmup))
        dist.barrier()
    return costs


def _measure_engine(name: str, shard: Any, case: Any, steps: int, warmup: int) -> StageCost:
    """Build ``case``'s pipeline with ``shard``, train ``warmup + steps`` steps, measure."""
    from tests.integration._torchtitan_llama_parts import pipelined

    tracker, counter = LiveStorages(), CommCounter()
    with tracker, counter.installed():  # the engine's build included
        dims, schedule, parts, first, last = pipelined(shard, case)
        params = [p for part in parts for p in part.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        tracker.holders = lambda: [params, [p.grad for p in params], list(opt.state.values())]
        cost = StageCost(name, dims.get_mesh("pp").get_local_rank(), dp=case.dp_shard)
        cost.stage_bytes = sum(p.numel() * p.element_size() for p in params)
        cost.microbatches = case.local_batch
        g = torch.Generator().manual_seed(dims.get_mesh("batch").get_local_rank())
        tokens = torch.randint(0, VOCAB, (case.local_batch, case.seq + 1), generator=g)
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            _sampled(stage, tracker, cost.samples)
        for step in range(warmup + steps):
            if step == warmup:
                cost.samples.clear()
                counter.enabled = True
            _step(schedule, tokens, first, last, opt)
        cost.samples = cost.samples[:]  # the measured steps' (the profiled one adds more)
        cost.held_max = max(cost.samples)
        cost.held_after = tracker.live_bytes()
        cost.pool_after = sum(_pool_bytes(part) for part in parts)
    sent = counter.bytes_by_group
    cost.moved_dp = sent.get(group_key(dims.get_mesh("fsdp").get_group()), 0.0) / steps
    cost.moved_pp = sent.get(group_key(dims.get_mesh("pp").get_group()), 0.0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(schedule, tokens, first, last, opt)
    cost.ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    return cost


def report(costs: list[StageCost]) -> list[str]:
    """One row per stage and engine (MB = 1e6 bytes), mf's against torch's FSDP2's."""
    mb = 1e6
    lines = [
        f"{'stage':<5} {'engine':<6} {'weights MB':>10} {'held max MB':>11} "
        f"{'held after MB':>13} {'of it pool':>10} {'dp sent MB':>10} {'x min':>6} "
        f"{'pp sent MB':>10} {'ops/mb':>7}"
    ]
    base = {c.pp_rank: c for c in costs if c.engine == ENGINES[0][0]}
    for cost in sorted(costs, key=lambda c: (c.pp_rank, c.engine != ENGINES[0][0])):
        lines.append(
            f"{cost.pp_rank:<5} {cost.engine:<6} {cost.stage_bytes / mb:10.2f} "
            f"{cost.held_max / mb:11.2f} {cost.held_after / mb:13.2f} {cost.pool_after / mb:10.2f} "
            f"{cost.moved_dp / mb:10.2f} {cost.moved_dp / cost.moved_min:6.2f} "
            f"{cost.moved_pp / mb:10.2f} {cost.ops / cost.microbatches:7.0f}"
        )
    for cost in costs:
        ref = base[cost.pp_rank]
        if cost is ref:
            continue
        lines.append(
            f"stage {cost.pp_rank}: {cost.engine} / {ref.engine}: held max "
            f"{cost.held_max / ref.held_max:.2f}, held after {cost.held_after / ref.held_after:.2f}"
            f", dp sent {cost.moved_dp / ref.moved_dp:.2f}, ops {cost.ops / ref.ops:.2f}"
        )
    return lines


def _rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """One rank: join the group, measure, and (rank 0) print every stage's rows."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        costs = measure(args.layers, args.microbatches, args.seq, args.steps, args.warmup)
        everyone: list[list[StageCost] | None] = [None] * world
        dist.all_gather_object(everyone, costs)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        firsts = [c for ranked in everyone[:: world // 2] for c in ranked or []]  # dp rank 0
        print(
            f"PP 2 x FSDP 2, Schedule1F1B, torch {torch.__version__}: debugmodel with "
            f"{args.layers} blocks, {args.microbatches} micro-batches of {args.seq} tokens, "
            f"fp32, AdamW, gloo; per rank, per step (mean of {args.steps})"
        )
        print("\n".join(report(firsts)))
        print(GPU_COST, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both engines on four gloo ranks and print rank 0's table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="blocks (two stages: at least 2)")
    parser.add_argument("--microbatches", type=int, default=4, help="per step (at least 2)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (<= 64)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error(f"--layers: two stages need at least 2 blocks, got {args.layers}")
    if args.microbatches < 2:
        parser.error(f"--microbatches: 1F1B on two stages needs 2, got {args.microbatches}")
    if not 1 <= args.seq <= 64:
        parser.error(f"--seq: expected 1 to 64 tokens (the model's rope table), got {args.seq}")
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(4, args, port), nprocs=4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
