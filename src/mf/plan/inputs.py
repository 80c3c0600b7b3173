"""The command line of ``mf-plan`` and its checks: one line per mistake, before any build.

The memory-shaping options are named as mf-train names them (``--zero``,
``--dp-outer``, ``--tp``, ``--cp``, ``--precision``, ``--micro-batch``,
``--seq-len``), so a plan reads as the ``mf-train`` run it describes;
``--activation-checkpointing`` has no mf-train twin yet. The checks here need no process group; what
needs the model (a folder's config, a preset's heads) is checked as the model is
described (``mf.plan.meta_model``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from mf.models import PRESETS
from mf.plan.devices import DEVICES, Device, custom_device
from mf.train.run.options import CUDA_MICRO_BATCH

__all__ = ["PlanInputs", "parse_inputs"]


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What one plan is asked: the model, the cluster and mf-train's sharding settings.

    Attributes:
        model: a preset name or a model folder's path.
        gpus: ranks of the run (one per GPU).
        device: the GPU each rank has.
        zero: ``--zero``; tp, cp, dp_outer: ``--tp``, ``--cp``, ``--dp-outer``.
        precision: ``--precision`` (compute dtype; main weights stay fp32).
        micro_batch: ``--micro-batch``, sequences per rank per micro-batch.
        seq_len: ``--seq-len``, tokens per sequence (None: the model's positions).
        activation_checkpointing: each layer recomputes its activations in the backward.
        rank: the rank whose bytes are planned.
        json: print JSON instead of the table.
        search: rank the configurations that fit instead of planning one.
        global_batch: sequences per optimizer step over all ranks (None: one micro-batch each).
        gpus_per_node: GPUs a node joins by NVLink (the step-time estimate's links).
    """

    model: str
    gpus: int
    device: Device
    zero: int
    tp: int
    cp: int
    dp_outer: int
    precision: str
    micro_batch: int
    seq_len: int | None
    activation_checkpointing: bool
    rank: int
    json: bool
    search: bool = False
    global_batch: int | None = None
    gpus_per_node: int = 8

    @property
    def dp_shard(self) -> int:
        """Ranks each replica shards the model over (per cp and tp rank)."""
        return self.gpus // (self.tp * self.cp * self.dp_outer)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one-line ValueErrors (exit 2 in the CLI)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mf-plan",
        description="Will a model fit on N GPUs with these sharding settings? Bytes per rank, "
        "read from mf's engine built for the run on meta tensors (no GPU, no weights).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--model",
        required=True,
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a transformers causal-LM folder "
        "(only its config.json is read)",
    )
    add("--gpus", type=int, required=True, help="GPUs of the run, one rank each")
    add(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs of a node, joined by NVLink (nodes are joined by the network)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", choices=sorted(DEVICES), default="h100", help="the GPU, by name")
    where.add_argument(
        "--gpu-memory", type=float, default=None, metavar="GiB", help="a GPU known by its memory"
    )
    add("--zero", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO strategy (mf-train's)")
    add("--tp", type=int, default=1, help="tensor-parallel size")
    add("--cp", type=int, default=1, help="context-parallel size")
    add("--dp-outer", type=int, default=1, help="HSDP replicas (outer data-parallel size)")
    add(
        "--precision",
        choices=("fp32", "bf16"),
        default="bf16",
        help="compute precision; the main weights stay fp32",
    )
    add(
        "--micro-batch",
        type=int,
        default=CUDA_MICRO_BATCH,
        help="sequences per rank per micro-batch (mf-train's default on a GPU)",
    )
    add(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the model's positions, as mf-train on a GPU)",
    )
    add(
        "--activation-checkpointing",
        action="store_true",
        help="each layer saves only its input and recomputes the rest in the backward",
    )
    add(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per optimizer step over all ranks; --search makes it up with "
        "--grad-accum (default: one micro-batch per data-parallel rank)",
    )
    add(
        "--search",
        action="store_true",
        help="rank the mf-train configurations that fit (--zero, --dp-outer, --cp, "
        "--micro-batch up to the one given) and print the best as mf-train command lines",
    )
    add("--rank", type=int, default=0, help="the rank whose bytes are planned")
    add("--json", action="store_true", help="print the plan as JSON")
    return parser


def parse_inputs(argv: Sequence[str]) -> PlanInputs:
    """Parse and check ``mf-plan``'s command line.

    Raises:
        ValueError: one line naming the option, the value and what is expected.
    """
    args = _parser().parse_args(argv)
    for name in ("gpus", "gpus_per_node", "tp", "cp", "dp_outer", "micro_batch", "global_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value}")
    model_parallel = args.tp * args.cp
    if args.gpus % model_parallel or (args.gpus // model_parallel) % args.dp_outer:
        raise ValueError(
            f"--gpus {args.gpus}: no mesh of --tp {args.tp} x --cp {args.cp} x --dp-outer "
            f"{args.dp_outer} x dp divides it; choose a GPU count that is a multiple of "
            f"{model_parallel * args.dp_outer}"
        )
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise ValueError(
            f"--gpus {args.gpus}: not whole nodes of --gpus-per-node {args.gpus_per_node}; "
            f"choose a multiple of {args.gpus_per_node}, or at most {args.gpus_per_node}"
        )
    if args.search and (args.cp > 1 or args.activation_checkpointing):
        given = f"--cp {args.cp}" if args.cp > 1 else "--activation-checkpointing"
        raise ValueError(
            f"--search with {given}: the search keeps --cp 1 (ring attention's activations "
            "are not planned) and mf-train has no activation checkpointing; drop it"
        )
    if args.tp > 1:
        # mf-tp's layers are made on their group's device, not on the meta device, and a
        # fake group has none: a 70B model's slices would be real host memory.
        raise ValueError(
            f"--tp {args.tp}: mf-plan does not plan tensor parallelism yet; plan with --tp 1"
        )
    if not 0 <= args.rank < args.gpus:
        raise ValueError(
            f"--rank must be in [0, {args.gpus}) (--gpus {args.gpus}), got {args.rank}"
        )
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        raise ValueError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory}")
    device = DEVICES[args.device] if args.gpu_memory is None else custom_device(args.gpu_memory)
    return PlanInputs(
        model=args.model,
        gpus=args.gpus,
        device=device,
        zero=args.zero,
        tp=args.tp,
        cp=args.cp,
        dp_outer=args.dp_outer,
        precision=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
        rank=args.rank,
        json=args.json,
        search=args.search,
        global_batch=args.global_batch,
        gpus_per_node=args.gpus_per_node,
    )
