"""One step of ``mf-train``: the micro-batches, the optimizer step, validation and samples.

Everything a step computes on every rank alike (the schedule, the batches of
this rank, the losses reduced over the data-parallel and context-parallel ranks).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mf.models.float8 import (
    refresh_float8_scales,
)
from mf.train.data.examples import IGNORED
from mf.train.data.run_data import RunData
from mf.train.data.sequence_shards import sequence_shards
from mf.train.exports.export import sample_text
from mf.train.rank.setup import dp_coordinates
from mf.train.run.options import TrainOptions

__all__ = [
    "StepResult",
    "routing_metrics",
    "sample_of",
    "seed_layer_drop",
    "train_step",
    "validate",
]


def _learning_rate(options: TrainOptions, step: int) -> float:
    warmup = max(1, options.steps // 20)
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _mean_over(value: torch.Tensor, mesh: DeviceMesh) -> float:
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _counted(targets: torch.Tensor) -> torch.Tensor:
    """How many of ``targets`` the loss counts (those not ``IGNORED``)."""
    return (targets != IGNORED).sum()


def _global_count(batches: list[tuple[torch.Tensor, ...]], options: TrainOptions) -> float:
    """The targets the loss counts in the step's global batch: all its micro-batches and ranks.

    A collective. Each data-parallel rank's batch is loaded by its ``--tp`` and
    ``--cp`` ranks alike, so the sum over all ranks counts it ``tp * cp`` times.
    """
    mine = torch.stack([_counted(batch[1]) for batch in batches]).sum().float().reshape(1)
    dist.all_reduce(mine)
    return mine.item() / (options.tp * options.cp)


class StepResult(NamedTuple):
    """What one optimizer step reports."""

    loss: float
    """The loss, averaged over the ranks."""
    issued: float
    """When (``time.perf_counter()``) the host had issued all of the step's work."""
    lr: float
    """The step's learning rate."""
    grad_norm: float | None
    """The gradients' total 2-norm over all ranks before clipping (None under
    ``--step-in-backward``, whose gradients are freed inside the backward)."""


def _clip_gradients(model, options: TrainOptions) -> torch.Tensor | None:
    """Clip the accumulated gradients to ``--max-grad-norm``; their norm before it.

    A collective: mf-fsdp's norm is the whole model's, each gradient shard (ZeRO,
    ``--tp``, ``--dp-outer`` replicas, experts) counted once; frozen parameters
    (LoRA's bases) hold no gradient. With ``--max-grad-norm 0`` the norm is still
    taken, for ``metrics.jsonl``. Under ``--step-in-backward`` (which the options
    allow with 0 only) the gradients are already stepped and freed: None. The norm
    stays on the device: the host reads it once the step's work is issued.
    """
    from mf_fsdp import clip_grad_norm_, get_grad_norm

    if options.step_in_backward:
        return None
    if options.max_grad_norm > 0:
        return clip_grad_norm_(model, options.max_grad_norm)
    return get_grad_norm(model)


def train_step(
    model,
    optimizers,
    data: RunData,
    options: TrainOptions,
    step: int,
    mesh: DeviceMesh,
    device,
) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches.

    The learning rate is set before the backward: under ``--step-in-backward``
    the last micro-batch's backward steps the parameters (``optimizer.step()``
    then finds no gradient left and does nothing).

    The issue moment is taken before the host waits for the loss. The
    micro-batches are copied to the device first: a copy from pageable memory
    waits for the device's earlier work, which would count as host time.
    """
    dp_rank, dp_size = dp_coordinates(mesh)
    lr = _learning_rate(options, step)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    batches = [
        tuple(
            t.to(device)
            for t in data.batch(
                "train",
                step * options.grad_accum + micro,
                options.seed,
                dp_rank,
                dp_size,
                options.micro_batch,
                options.seq_len,
            )
        )
        for micro in range(options.grad_accum)
    ]
    # The loss is the mean over the counted targets of the whole global batch (torchtitan's
    # global token normalisation): each rank's share is the sum of its token losses over the
    # global count, times the replicas the engine averages gradients over (data-parallel and
    # context-parallel ranks), so a micro-batch or rank with fewer answer tokens weighs less.
    total = max(_global_count(batches, options), 1.0)
    replicas = dist.get_world_size() // options.tp
    losses = []
    for micro, (inputs, targets, *packed) in enumerate(batches):  # packed: positions
        last = micro == options.grad_accum - 1
        if options.layer_drop:
            seed_layer_drop(model, options, step * options.grad_accum + micro, dp_rank)
        with (
            contextlib.nullcontext() if last else model.no_sync(),
            sequence_shards(mesh["cp"], inputs, targets, *packed) as positions,
        ):
            mean = model(inputs, targets, positions=positions)  # over this rank's counted targets
            loss = mean * (_counted(targets) * replicas / total)
            loss.backward()
        losses.append(loss.detach())
    grad_norm = _clip_gradients(model, options)
    for optimizer in optimizers:
        optimizer.step()
    if options.precision == "fp8":
        refresh_float8_scales(model)
    for optimizer in optimizers:
        optimizer.zero_grad()
    issued = time.perf_counter()
    norm = None if grad_norm is None else grad_norm.item()
    return StepResult(_mean_over(torch.stack(losses).sum(), mesh), issued, lr, norm)


def seed_layer_drop(model, options: TrainOptions, micro_batch: int, dp_rank: int) -> None:
    """Seed the model's LayerDrop draws for one micro-batch (``--layer-drop``).

    From the seed, the micro-batch's index and the data-parallel rank: ranks of one
    tensor-parallel group skip the same blocks (their blocks exchange activations),
    data-parallel ranks different ones, and a resumed run the same as an unbroken one.
    """
    module = model.module
    if module.layer_drop_generator is None:
        module.layer_drop = options.layer_drop
        module.layer_drop_generator = torch.Generator()
    module.layer_drop_generator.manual_seed(
        (options.seed * 1_000_003 + micro_batch) * 65_537 + dp_rank
    )


def routing_metrics(model, tp: int) -> dict[str, Any]:
    """A MoE model's routing in the step's last micro-batch, over all ranks (collective).

    ``load_balance_loss``: the blocks' summed balance losses, averaged over ranks;
    ``tokens_per_expert``: per block, the tokens each expert received from every
    data-parallel rank (the ``tp`` ranks of one route the same tokens). Empty for a
    dense model.
    """
    if not hasattr(model.module, "routing_stats"):
        return {}
    stats = model.module.routing_stats()
    balance = torch.tensor([stats.load_balance_loss], dtype=torch.float64)
    counts = stats.tokens_per_expert.to(torch.float64).cpu()
    device = model.device
    balance, counts = balance.to(device), counts.to(device)
    dist.all_reduce(balance)
    dist.all_reduce(counts)
    return {
        "load_balance_loss": balance.item() / dist.get_world_size(),
        "tokens_per_expert": (counts / tp).long().tolist(),
    }


@torch.no_grad()
def validate(
    model, data: RunData, options: TrainOptions, mesh: DeviceMesh, device: torch.device
) -> float:
    """The validation loss: the mean over the counted targets of ``--eval-batches`` global batches.

    A collective: every rank's sum of token losses and count are added up.
    """
    model.eval()
    dp_rank, dp_size = dp_coordinates(mesh)
    sums, counts = [], []
    for index in range(options.eval_batches):
        batch = data.batch(
            "validation",
            index,
            options.seed,
            dp_rank,
            dp_size,
            options.micro_batch,
            options.seq_len,
        )
        inputs, targets, *packed = (t.to(device) for t in batch)
        with sequence_shards(mesh["cp"], inputs, targets, *packed) as positions:
            counted = _counted(targets)
            sums.append(model(inputs, targets, positions=positions).float() * counted)
            counts.append(counted.float())
    model.train()
    totals = torch.stack([torch.stack(sums).sum(), torch.stack(counts).sum()])
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


@torch.no_grad()
def sample_of(
    model, data: RunData, prompt: str, options: TrainOptions, device: torch.device
) -> str:
    """Sampling (temperature 0.8) in lockstep on every rank from a shared seed.

    In eval mode: every block runs (``--layer-drop`` is for training), and dropout is off.
    """
    prompt_tokens = data.encode(prompt).to(device)
    model.eval()
    try:
        sequence = sample_text(
            model, prompt_tokens, options.sample_tokens, options.seq_len, options.seed + 1
        )
    finally:
        model.train()
    return data.decode(sequence.cpu())
