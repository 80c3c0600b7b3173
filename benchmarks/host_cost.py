"""The host's cost per training step: mf, FSDP2 and DDP against plain PyTorch, interleaved.

On a GPU a small model's step is bounded by what the host does (Python, op
dispatch, kernel launches), not by the kernels. With the tiny preset on the
CPU the compute is nearly nothing, so a step's CPU time is that host cost.

Every engine is built in one process per rank (gloo, one intra-op thread) on
the same model, and the engines take turns step by step, in an order drawn
afresh every step (the same on every rank), so the machine's drift
(frequency, caches, neighbours) and what one engine leaves in the caches for
the next fall on all of them alike: separate processes per engine
(``mf-bench``) differ by 10-20% on a shared machine.
Printed per engine (rank 0's): the median CPU ms of the main thread in the
forward, the backward and the optimizer's ``step()`` + ``zero_grad()``, their
total against plain PyTorch's, and the aten ops one step dispatches (torch's
profiler). With ``--world 2`` each rank trains on its own batch of the same
size, and ``plain`` is the bare model on that batch: what a step costs the host
beyond it is the engine's and its communication's.

``comm-floor`` is a cost reference, not an engine: ``plain`` plus the bare
collectives a ZeRO-3 step makes at least, one all-gather of the model's
weights before the forward and one reduce-scatter of its grads after the
backward, each a single ``torch.distributed`` call on a flat buffer of the
model's size, waited on at once (nothing at world 1, where a sharded engine
needs none). What an engine's step costs above it is the engine's own:
its bookkeeping, and the copies in and out of its buffers.

``--layers N`` gives the preset N blocks, so N FSDP units: what one unit costs
the host is the difference between two such runs over the blocks added.
``--d-model N`` narrows every block (the tiny preset's 64 to 16, say): the
tensors shrink until copying them costs nothing, and what is left is the
Python and dispatch that a GPU's host pays whatever the tensors' size.

Run: ``uv run --no-sync python benchmarks/host_cost.py --steps 200 [--world 2] [--layers 16]
[--d-model 16]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.profiler import ProfilerActivity, profile

from mf.bench.engines import AUTOCAST, build_engine
from mf.models import PRESETS, GPTConfig

__all__ = ["ENGINES", "EngineCost", "config_of", "main", "measure"]

COMM_FLOOR = "comm-floor"
"""The cost reference of the module doc: ``plain`` plus a ZeRO-3 step's bare collectives."""
ENGINES = ("plain", COMM_FLOOR, "ddp", "fsdp2", "mf-zero3", "mf-fsdp2", "mf-zero0")
PHASES = ("forward", "backward", "optimizer")


@dataclass
class EngineCost:
    """One engine's CPU time per phase (seconds, one list entry per step) and ops per step."""

    name: str
    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    ops: int = 0

    def median(self, phase: str) -> float:
        """Median seconds of ``phase``."""
        return statistics.median(self.seconds[phase])

    @property
    def total(self) -> float:
        """The median phases summed: one step."""
        return sum(self.median(p) for p in PHASES)


class _BareCollectives(nn.Module):
    """``model`` plus the bare collectives of a ZeRO-3 step (``comm-floor``, see the module doc).

    The gathered and reduced values are thrown away: ``model`` trains as ``plain``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        world = dist.get_world_size()
        numel = sum(p.numel() for p in model.parameters())
        shard = -(-numel // world)
        self._shard = torch.zeros(shard)
        self._gathered = torch.empty(shard * world)
        self._grads = torch.zeros(shard * world)
        self._reduced = torch.empty(shard)
        self._communicates = world > 1

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self._communicates:
            dist.all_gather_into_tensor(self._gathered, self._shard)
        loss = self.model(*args)
        if self._communicates and loss.requires_grad:
            loss.register_hook(self._queue_reduction)
        return loss

    def _queue_reduction(self, grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        dist.reduce_scatter_tensor(self._reduced, self._grads, op=dist.ReduceOp.AVG)


def _build(name: str, config: GPTConfig, bf16: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``mf-bench``'s engine ``name`` on a fresh model, over a "dp" mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from mf.models import GPT

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    floor = name == COMM_FLOOR
    model, optimizers = build_engine(
        "plain" if floor else name, GPT(config), mesh, 1e-3, "adam", bf16
    )
    if floor:
        model = _BareCollectives(model)
    optimizer = optimizers[0]
    # What torch picks on a GPU (and mf everywhere): the multi-tensor kernels. On the
    # CPU torch's default is the per-parameter loop, which would charge the baselines
    # a GPU user never pays.
    for group in optimizer.param_groups:
        group["foreach"] = True
    return model, optimizer


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, batch, autocast: bool, cost: EngineCost | None
) -> None:
    start = time.thread_time()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(*batch)
    forward = time.thread_time()
    loss.backward()
    backward = time.thread_time()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cost is not None:
        for phase, seconds in zip(
            PHASES,
            (forward - start, backward - forward, time.thread_time() - backward),
            strict=True,
        ):
            cost.seconds[phase].append(seconds)


def measure(
    engines: Sequence[str],
    preset: str = "tiny",
    steps: int = 200,
    warmup: int = 20,
    bf16: bool = False,
    layers: int | None = None,
    d_model: int | None = None,
) -> list[EngineCost]:
    """Interleave ``steps`` training steps of every engine; return this rank's costs.

    Needs an initialised gloo process group (every rank calls this); each rank
    trains on its own batch. ``layers``: the preset with that many blocks (more
    blocks, more FSDP units: what one unit costs the host shows in the difference);
    ``d_model``: that wide (narrower tensors, nothing but the host's own work).
    """
    config = config_of(preset, layers, d_model)
    built = {name: _build(name, config, bf16) for name in engines}
    seed = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), generator=seed)
    batch = (tokens[:, :-1], tokens[:, 1:])
    costs = {name: EngineCost(name) for name in engines}
    autocast = {name: bf16 and (name in AUTOCAST or name == COMM_FLOOR) for name in engines}
    _interleave(built, batch, autocast, costs, warmup, steps)
    for name, (model, opt) in built.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, opt, batch, autocast[name], None)
        costs[name].ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    return list(costs.values())


def config_of(preset: str, layers: int | None = None, d_model: int | None = None) -> GPTConfig:
    """``preset``'s model with ``layers`` blocks and ``d_model`` width, where given."""
    config = PRESETS[preset]
    if layers is not None:
        config = dataclasses.replace(config, n_layers=layers)
    if d_model is not None:
        config = dataclasses.replace(config, d_model=d_model)
    return config


def _interleave(
    built: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast: dict[str, bool],
    costs: dict[str, EngineCost],
    warmup: int,
    steps: int,
) -> None:
    """Train every engine ``warmup + steps`` steps, taking turns; record after warm-up.

    A step pays for what the step before it left in the caches, so each engine
    must follow each other one about equally often: the order is drawn afresh
    every step, from one seed on every rank (their collectives must match).
    Turning one order instead keeps every engine's neighbours: with FSDP2 before
    mf ZeRO-3 in it, ZeRO-3 came after FSDP2's step, the heaviest, every time
    (1.38x plain's step at world 2, against 1.32x for the same engine listed
    after it).
    """
    draw = random.Random(0)
    names = list(built)
    for step in range(warmup + steps):
        for name in draw.sample(names, len(names)):
            model, opt = built[name]
            _step(model, opt, batch, autocast[name], costs[name] if step >= warmup else None)


def report(costs: list[EngineCost]) -> list[str]:
    """One line per engine: CPU ms per phase, the step against the first engine's, ops."""
    base = costs[0]
    lines = [
        f"{'engine':<10} {'fwd ms':>7} {'bwd ms':>7} {'opt ms':>7} {'step ms':>8} "
        f"{'x ' + base.name:>8} {'ops/step':>9} {'x ' + base.name:>8}"
    ]
    for cost in costs:
        lines.append(
            f"{cost.name:<10} {cost.median('forward') * 1e3:7.3f} "
            f"{cost.median('backward') * 1e3:7.3f} {cost.median('optimizer') * 1e3:7.3f} "
            f"{cost.total * 1e3:8.3f} {cost.total / base.total:8.2f} {cost.ops:9d} "
            f"{cost.ops / base.ops:8.2f}"
        )
    return lines


def _rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """One rank: join the group, measure, and (rank 0) print the table."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engines = args.engines.split(",")
        costs = measure(
            engines,
            args.preset,
            args.steps,
            args.warmup,
            args.precision == "bf16",
            args.layers,
            args.d_model,
        )
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(
            f"host cost per step: torch {torch.__version__}, preset {args.preset}"
            f"{'' if args.layers is None else f' with {args.layers} blocks'}"
            f"{'' if args.d_model is None else f' of width {args.d_model}'}, world "
            f"{world}, {args.precision}, {args.steps} steps interleaved, CPU ms of rank 0's "
            "main thread"
        )
        print("\n".join(report(costs)), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every engine interleaved on ``--world`` ranks and print rank 0's table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--world", type=int, default=1, help="gloo ranks on this machine")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    parser.add_argument("--d-model", type=int, default=None, help="width (default: the preset's)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    if args.world < 1:
        parser.error(f"--world: expected a positive number of ranks, got {args.world}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers: expected a positive number of blocks, got {args.layers}")
    heads = PRESETS[args.preset].n_heads
    if args.d_model is not None and (args.d_model < 1 or args.d_model % heads):
        parser.error(
            f"--d-model: expected a positive multiple of the preset's {heads} heads, "
            f"got {args.d_model}"
        )
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if args.world == 1:
        _rank(0, 1, args, port)
    else:
        torch.multiprocessing.spawn(_rank, args=(args.world, args, port), nprocs=args.world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
