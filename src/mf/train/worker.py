"""The per-rank body of ``mf-train``: build, shard, train, validate, save, sample.

Started on every rank by torch's elastic launcher (``mf-train``) or by
``torchrun -m mf.train.worker`` for multi-node runs. All ranks run the same
steps in lockstep; rank 0 alone prints, writes metrics and draws plots.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record

from mf.models import GPT, PRESETS, Block
from mf.train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from mf.train.data import TextData, decode, encode, load_corpus
from mf.train.options import TrainOptions
from mf.train.report import Reporter

__all__ = ["train"]


class _StopFlag:
    """Set by SIGINT/SIGTERM; ranks agree on it with one all-reduce per step."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _setup(options: TrainOptions) -> tuple[torch.device, DeviceMesh]:
    use_cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        )
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    world = dist.get_world_size()
    if world != options.nproc:
        options_world = options.nproc
        raise ValueError(f"--nproc says {options_world} processes but the launcher started {world}")
    dp_shard = world // options.tp // options.dp_outer
    mesh = init_device_mesh(
        device.type,
        (options.dp_outer, dp_shard, options.tp),
        mesh_dim_names=("dp_outer", "dp", "tp"),
    )
    return device, mesh


def _dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    outer, shard = mesh["dp_outer"], mesh["dp"]
    return (
        outer.get_local_rank() * shard.size() + shard.get_local_rank(),
        outer.size() * shard.size(),
    )


def _build(options: TrainOptions, mesh: DeviceMesh, device: torch.device):
    from mf_fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(options.seed)
    config = PRESETS[options.model]
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=0.1)
    compute = torch.bfloat16 if options.precision == "bf16" else torch.float32
    model, optimizer = fully_shard(
        model,
        optimizer,
        device_mesh=mesh,
        dp_shard_dim="dp",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        fsdp_unit_modules=[Block],
        zero_dp_strategy=options.zero,
        mixed_precision_policy=MixedPrecisionPolicy(
            main_params_dtype=torch.float32, param_dtype=compute
        ),
    )
    return model, optimizer


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


@torch.no_grad()
def _validate(
    model, data: TextData, options: TrainOptions, mesh: DeviceMesh, device: torch.device
) -> float:
    model.eval()
    dp_rank, dp_size = _dp_coordinates(mesh)
    losses = []
    for index in range(options.eval_batches):
        inputs, targets = data.batch(
            "validation",
            index,
            options.seed,
            dp_rank,
            dp_size,
            options.micro_batch,
            options.seq_len,
        )
        losses.append(model(inputs.to(device), targets.to(device)))
    model.train()
    return _mean_over(torch.stack(losses).mean(), mesh)


@torch.no_grad()
def _sample(model, prompt: str, options: TrainOptions, device: torch.device) -> str:
    """Greedy-free sampling (temperature 0.8) in lockstep on every rank from a shared seed."""
    model.eval()
    generator = torch.Generator().manual_seed(options.seed + 1)
    tokens = encode(prompt).unsqueeze(0).to(device)
    for _ in range(options.sample_tokens):
        window = tokens[:, -options.seq_len :]
        logits = model(window)[0, -1].float().cpu() / 0.8
        choice = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, choice.to(device).view(1, 1)], dim=1)
    model.train()
    return decode(tokens[0].cpu())


@record
def train(options: TrainOptions) -> dict[str, Any]:
    """Run the whole job on this rank; rank 0 returns the summary the launcher prints."""
    device, mesh = _setup(options)
    rank = dist.get_rank()
    text, corpus_name = load_corpus(options.data)
    data = TextData.from_text(text, options.seq_len)
    model, optimizer = _build(options, mesh, device)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    info = {"model": options.model, "tp": options.tp, "zero": options.zero, "seed": options.seed}
    ckpt_dir = Path(options.ckpt_dir)
    start_step = 0
    if options.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint in {options.ckpt_dir!r}")
        start_step = load_checkpoint(path, state, info)["step"]
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    reporter = Reporter(
        options, rank == 0, start_step, corpus_name, len(data.train), len(data.validation)
    )
    dp_rank, dp_size = _dp_coordinates(mesh)
    stop = _StopFlag()
    tokens_per_step = options.micro_batch * options.seq_len * options.grad_accum * dp_size
    saved_path: Path | None = None
    step = start_step
    while step < options.steps:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(options, step)
        losses = []
        for micro in range(options.grad_accum):
            inputs, targets = data.batch(
                "train",
                step * options.grad_accum + micro,
                options.seed,
                dp_rank,
                dp_size,
                options.micro_batch,
                options.seq_len,
            )
            last = micro == options.grad_accum - 1
            context = contextlib.nullcontext() if last else model.no_sync()
            with context:
                loss = model(inputs.to(device), targets.to(device)) / options.grad_accum
                loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        train_loss = _mean_over(torch.stack(losses).sum(), mesh)
        elapsed = time.perf_counter() - started
        validation = None
        if step % options.eval_every == 0 or step == options.steps:
            validation = _validate(model, data, options, mesh, device)
        reporter.step(step, train_loss, validation, tokens_per_step / elapsed, device)
        interrupted = stop.agreed(device)
        if (
            (options.save_every and step % options.save_every == 0)
            or step == options.steps
            or interrupted
        ):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            saved_path = save_checkpoint(ckpt_dir, step, state, {**info, "step": step})
            reporter.saved(saved_path)
        if interrupted:
            reporter.interrupted(step)
            break
    sample = _sample(model, "The ", options, device) if step == options.steps else None
    summary = reporter.finish(sample, saved_path)
    dist.destroy_process_group()
    return summary


def main() -> None:
    """Entry point under ``torchrun -m mf.train.worker -- <mf-train options>``."""
    from mf.train.options import parse_options

    options = parse_options(sys.argv[1:])
    summary = train(options)
    if summary:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
