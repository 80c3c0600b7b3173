"""The per-rank body of ``mf-train``: build, shard, train, validate, save, sample.

Started on every rank by torch's elastic launcher (``mf-train``) or by
``torchrun -m mf.train.worker`` for multi-node runs. All ranks run the same
steps in lockstep; rank 0 alone prints, writes metrics and draws plots.
A run that cannot go on (a NaN or infinite loss, a failed final save) stops
on every rank at the same step, after rank 0 printed why in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mf.launch import leave_process_group, stop_with_launcher
from mf.models import (
    MODEL_PRESETS,
    Block,
    GPTTensorParallel,
    MoEBlock,
    MoEGPTConfig,
    MoEGPTTensorParallel,
    TensorParallelBlock,
    build_optimizers,
    plain_model,
)
from mf.models.float8 import (
    FSDP_FLOAT8_ALL_GATHER,
    convert_gpt_to_float8,
    refresh_float8_scales,
)
from mf.train.data import TextData, decode, encode, load_corpus
from mf.train.export import export_model, sample_text
from mf.train.failures import report_rank_failure
from mf.train.options import RESULT_SETTINGS, TrainOptions, local_cpu_cores
from mf.train.report import Reporter, last_saved_checkpoint
from mf.train.resume import resume_checkpoint, verify_resume
from mf.train.run_lock import (
    RunLockError,
    acquire_run_locks,
    started_by_launcher,
    worker_takes_locks,
)
from mf.train.sequence_shards import sequence_shards
from mf_fsdp import load_checkpoint, save_checkpoint

__all__ = ["RunStoppedError", "main", "train"]


class RunStoppedError(RuntimeError):
    """The run cannot go on (a non-finite loss, a failed final save); raised on every rank.

    Rank 0 has already printed the message as the one line ``mf-train: <message>``.
    """


class _StopFlag:
    """Set by SIGINT/SIGTERM; ranks agree on it with one all-reduce per step.

    A context manager: the previous signal handlers come back on exit.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it each step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _join(options: TrainOptions) -> None:
    """Join the default process group from the launcher's environment.

    After an elastic restart the agent's store still holds the previous
    attempt's keys (the ranks' old addresses), so each attempt's group lives
    under its own prefix.
    """
    from torch.distributed.rendezvous import rendezvous

    backend = "nccl" if options.use_cuda else "gloo"
    timeout = timedelta(seconds=options.timeout)
    store, rank, world = next(rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"mf-train/attempt-{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _setup(options: TrainOptions) -> tuple[torch.device, DeviceMesh]:
    """Pick the device, join the process group (if the caller has not) and build the mesh."""
    if options.use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", options.nproc))
        torch.set_num_threads(max(1, local_cpu_cores() // local_ranks))
    if not dist.is_initialized():
        _join(options)
    _check_same_settings(options)
    world = dist.get_world_size()
    if world != options.nproc:
        raise ValueError(f"--nproc says {options.nproc} processes but the launcher started {world}")
    dp_shard = world // options.tp // options.cp // options.dp_outer
    mesh = init_device_mesh(
        device.type,
        (options.dp_outer, dp_shard, options.cp, options.tp),
        mesh_dim_names=("dp_outer", "dp", "cp", "tp"),
    )
    # The weights are replicated over cp as over dp: sharded and reduced over both.
    mesh["dp", "cp"]._flatten("dp_cp")
    return device, mesh


def _check_same_settings(options: TrainOptions) -> None:
    """Stop every rank, rank 0 printing one line, unless all ranks run the same options.

    Ranks started with different settings (``torchrun`` with other flags on one
    node) would build different meshes and models and issue different
    collectives: gloo aborts the process (SIGABRT), NCCL hangs or exchanges the
    wrong bytes. One object all-gather, before the first mesh, is safe whatever
    the options are.
    """
    mine = dataclasses.asdict(options)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        differ = sorted(k for k in first.keys() | theirs.keys() if first.get(k) != theirs.get(k))
        if not differ:
            continue
        shown = ", ".join(
            f"--{k.replace('_', '-')} {theirs.get(k)} (rank 0: {first.get(k)})" for k in differ
        )
        message = (
            f"the ranks were started with different settings: rank {rank} has {shown}; "
            "start every rank with the same options"
        )
        if dist.get_rank() == 0:
            from mf.train.cli import user_error

            user_error(message)
        dist.barrier()  # every rank stays until rank 0's line is out
        raise RunStoppedError(message)


def _dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    outer, shard = mesh["dp_outer"], mesh["dp"]
    return (
        outer.get_local_rank() * shard.size() + shard.get_local_rank(),
        outer.size() * shard.size(),
    )


def _expert_mesh(options: TrainOptions, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of a MoE model's experts: each ``ep`` group is ``--ep`` consecutive dp ranks.

    Same ranks and row-major order as ``mesh`` (whose cp size is 1 for a MoE
    model), its ``dp`` dim split into the expert-data-parallel ``dp_cp`` (the
    ranks holding the same experts, which their gradients are reduced over;
    named as the dense mesh's shard dim) and ``ep``.
    """
    return init_device_mesh(
        mesh.device_type,
        (options.dp_outer, mesh["dp"].size() // options.ep, options.ep, options.tp),
        mesh_dim_names=("dp_outer", "dp_cp", "ep", "tp"),
    )


def _build(options: TrainOptions, mesh: DeviceMesh, device: torch.device):
    """The GPT of the preset (tensor-parallel when --tp > 1), sharded, and its optimizers.

    The optimizers are ``--optimizer``'s recipe, a list (AdamW; or Muon and AdamW).
    """
    from mf_fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(options.seed)  # the same full weights on every rank
    config = MODEL_PRESETS[options.model]
    moe = isinstance(config, MoEGPTConfig)
    expert_mesh = _expert_mesh(options, mesh) if moe else None
    ep_group = None if expert_mesh is None else expert_mesh["ep"].get_group()
    if options.tp == 1:  # experts are keyed globally: --ep does not change the model either
        module, unit = plain_model(config, ep_group), (MoEBlock if moe else Block)
    else:  # the same weights, split: --tp does not change the initial model
        tp_group = mesh["tp"].get_group()
        full_weights = plain_model(config).state_dict()
        if moe:
            module, unit = MoEGPTTensorParallel(config, tp_group, ep_group), MoEBlock
        else:
            module, unit = GPTTensorParallel(config, tp_group), TensorParallelBlock
        module.load_full_weights(full_weights)
    module.to(device)
    if options.precision == "fp8":  # before the optimizers: FP8 gathering swaps the weights
        gathers_fp8 = FSDP_FLOAT8_ALL_GATHER and options.zero == 3
        convert_gpt_to_float8(module, fsdp_float8_all_gather=gathers_fp8)
    optimizers = build_optimizers(options.optimizer, module, options.lr, weight_decay=0.1)
    compute = torch.float32 if options.precision == "fp32" else torch.bfloat16
    return fully_shard(
        module,
        optimizers,
        device_mesh=mesh,
        dp_shard_dim="dp_cp",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        expt_device_mesh=expert_mesh,
        fsdp_unit_modules=[unit],
        zero_dp_strategy=options.zero,
        mixed_precision_policy=MixedPrecisionPolicy(
            main_params_dtype=torch.float32, param_dtype=compute
        ),
    )


# --- checkpoints: the only place that saves or loads training state ---------------------------


def _resume(options: TrainOptions, model, optimizers) -> int:
    """Load the checkpoint --resume continues from; return the step it was saved at.

    ``--resume-from``'s, else the newest complete one in ``--ckpt-dir``
    (``resume_checkpoint``), which the launcher verified. Any ``--zero``, ``--tp`` or
    world size may resume (the checkpoint reshards); the optimizer state is built
    from the checkpoint, never by a synthetic step.
    """
    return load_checkpoint(resume_checkpoint(options), model, optimizers)["step"]


def _restart_checkpoint(options: TrainOptions) -> Path | None:
    """After an elastic restart: the newest checkpoint this run saved, else None.

    Every rank reads the same ``last_checkpoint.json`` (the launcher's run id
    survives restarts), so all resume from the same step by themselves; a
    newer checkpoint of another run in the same folder is never picked.
    """
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    return last_saved_checkpoint(Path(options.out_dir), os.environ.get("TORCHELASTIC_RUN_ID"))


def _newest(saved: Path | None) -> str:
    """The end of a stop message: which checkpoint a user can --resume from."""
    return f"the newest checkpoint of this run is {saved}" if saved else "this run saved none"


def _stop(reporter: Reporter, message: str) -> NoReturn:
    """End the run on every rank (collective): rank 0 prints ``message``, then all raise.

    The barrier keeps every rank alive until rank 0's line is out: the launcher
    stops the other ranks as soon as one exits.
    """
    reporter.stopped(message)
    dist.barrier()
    raise RunStoppedError(message)


def _stop_if_diverged(reporter: Reporter, loss: float, step: int, saved: Path | None) -> None:
    """Stop every rank, before any save, when the loss is NaN or infinite.

    The loss is the mean over all ranks, the same number everywhere, so every rank
    stops at the same step and none waits in a collective.
    """
    if not math.isfinite(loss):
        message = f"the loss is {loss} at step {step}; stopping without saving a checkpoint"
        _stop(reporter, f"{message} ({_newest(saved)})")


def _last_save_reason(step: int, steps: int, interrupted: bool) -> str | None:
    """Why the save after ``step`` is the run's last, or None when training goes on."""
    if interrupted:
        return "after the interrupt"
    if step == steps:
        return "at the end of the run"
    return None


class _Checkpoints:
    """This run's saves: periodic ones written in the background, the last in the foreground.

    save_checkpoint raises RuntimeError on every rank when a save fails (first
    line: the cause); a background save's future raises it. A periodic save
    that fails is a warning: training goes on, the next save retries and the
    older checkpoints stay. A final save that fails stops the run with that
    cause. A background save is reported (and becomes the newest checkpoint)
    once it is published, at the next save at the latest.
    """

    def __init__(
        self, ckpt_dir: Path, model, optimizers, info: dict[str, Any], reporter: Reporter
    ) -> None:
        self.ckpt_dir, self.model, self.optimizers = ckpt_dir, model, optimizers
        self.info, self.reporter = info, reporter
        self.newest: Path | None = None
        self._pending: tuple[int, Future[Path]] | None = None

    def save(self, step: int, final: str | None, in_background: bool) -> None:
        """Save the checkpoint of ``step``; ``final``: why it is the run's last, else None."""
        self.settle()
        try:
            if final is None and in_background:
                self._pending = (step, self._save(step, async_save=True))
                return
            path = self._save(step, async_save=False)
        except RuntimeError as error:
            self._failed(step, error, final)
            return
        self.reporter.saved(path, step)
        self.newest = path

    def _save(self, step: int, async_save: bool) -> Any:
        return save_checkpoint(
            self.ckpt_dir,
            self.model,
            self.optimizers,
            step=step,
            extra=self.info,
            async_save=async_save,
        )

    def settle(self) -> None:
        """Wait for the background save, and report how it ended."""
        if self._pending is None:
            return
        (step, future), self._pending = self._pending, None
        try:
            path = future.result()
        except RuntimeError as error:
            self._failed(step, error, None)
            return
        self.reporter.saved(path, step)
        self.newest = path

    def _failed(self, step: int, error: RuntimeError, final: str | None) -> None:
        cause = (str(error).splitlines() or [type(error).__name__])[0]
        if final is None:
            self.reporter.save_failed(step, cause)
            return
        _stop(
            self.reporter,
            f"could not save the checkpoint of step {step} {final}: {cause}; "
            f"{_newest(self.newest)}",
        )


# -----------------------------------------------------------------------------------------------


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
        inputs, targets = inputs.to(device), targets.to(device)
        with sequence_shards(mesh["cp"], inputs, targets) as positions:
            losses.append(model(inputs, targets, positions=positions))
    model.train()
    return _mean_over(torch.stack(losses).mean(), mesh)


@torch.no_grad()
def _sample(model, prompt: str, options: TrainOptions, device: torch.device) -> str:
    """Sampling (temperature 0.8) in lockstep on every rank from a shared seed.

    In eval mode: every block runs (``--layer-drop`` is for training), and dropout is off.
    """
    prompt_tokens = encode(prompt).to(device)
    model.eval()
    try:
        sequence = sample_text(
            model, prompt_tokens, options.sample_tokens, options.seq_len, options.seed + 1
        )
    finally:
        model.train()
    return decode(sequence.cpu())


def _train_step(
    model, optimizers, data: TextData, options: TrainOptions, step: int, mesh: DeviceMesh, device
) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches.

    Returns the mean loss over ranks and the moment (``time.perf_counter()``) the
    host had issued all of the step's work, before it waits for the loss. The
    micro-batches are copied to the device first: a copy from pageable memory
    waits for the device's earlier work, which would count as host time.
    """
    dp_rank, dp_size = _dp_coordinates(mesh)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(options, step)
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
    losses = []
    for micro, (inputs, targets) in enumerate(batches):
        last = micro == options.grad_accum - 1
        if options.layer_drop:
            _seed_layer_drop(model, options, step * options.grad_accum + micro, dp_rank)
        with (
            contextlib.nullcontext() if last else model.no_sync(),
            sequence_shards(mesh["cp"], inputs, targets) as positions,
        ):
            loss = model(inputs, targets, positions=positions) / options.grad_accum
            loss.backward()
        losses.append(loss.detach())
    for optimizer in optimizers:
        optimizer.step()
    if options.precision == "fp8":
        refresh_float8_scales(model)
    for optimizer in optimizers:
        optimizer.zero_grad()
    issued = time.perf_counter()
    return _mean_over(torch.stack(losses).sum(), mesh), issued


def _seed_layer_drop(model, options: TrainOptions, micro_batch: int, dp_rank: int) -> None:
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


def _routing_metrics(model, tp: int) -> dict[str, Any]:
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


def _run(options: TrainOptions, device: torch.device, mesh: DeviceMesh) -> dict[str, Any]:
    text, corpus_name = load_corpus(options.data)
    data = TextData.from_text(text, options.seq_len)
    model, optimizers = _build(options, mesh, device)
    info = {
        "model": options.model,
        "tp": options.tp,
        "cp": options.cp,
        "ep": options.ep,
        "zero": options.zero,
        "optimizer": options.optimizer,
        **{name: getattr(options, name) for name in RESULT_SETTINGS},
    }
    ckpt_dir = Path(options.ckpt_dir)
    restart = _restart_checkpoint(options)
    if restart is not None:  # the steps since that checkpoint are recomputed
        start_step = load_checkpoint(restart, model, optimizers)["step"]
    else:
        start_step = _resume(options, model, optimizers) if options.resume else 0
    reporter = Reporter(
        options,
        dist.get_rank() == 0,
        start_step,
        corpus_name,
        len(data.train),
        len(data.validation),
        MODEL_PRESETS[options.model].num_parameters(),
    )
    tokens_per_step = options.micro_batch * options.seq_len * options.grad_accum
    tokens_per_step *= _dp_coordinates(mesh)[1]
    checkpoints = _Checkpoints(ckpt_dir, model, optimizers, info, reporter)
    step = start_step
    with _StopFlag() as stop, reporter.bar_closed_on_error():
        while step < options.steps:
            started = time.perf_counter()
            train_loss, issued = _train_step(model, optimizers, data, options, step, mesh, device)
            step += 1
            elapsed = time.perf_counter() - started
            rate = tokens_per_step / elapsed
            host_share = (issued - started) / elapsed  # the rest: waiting for the device
            validation = None
            if math.isfinite(train_loss) and (
                step % options.eval_every == 0 or step == options.steps
            ):
                validation = _validate(model, data, options, mesh, device)
            routing = _routing_metrics(model, options.tp)
            reporter.step(step, train_loss, validation, rate, device, routing, host_share)
            if not math.isfinite(train_loss):
                checkpoints.settle()  # the stop names the newest checkpoint
            _stop_if_diverged(reporter, train_loss, step, checkpoints.newest)
            interrupted = stop.agreed(device)
            final = _last_save_reason(step, options.steps, interrupted)
            if final or (options.save_every and step % options.save_every == 0):
                checkpoints.save(step, final, in_background=not options.sync_save)
            if interrupted:
                reporter.interrupted(step)
                break
    checkpoints.settle()
    saved_path = checkpoints.newest
    finished = step == options.steps
    sample = _sample(model, "The ", options, device) if finished and options.sample_tokens else None
    exported = None
    if finished and saved_path is not None and reporter.active:
        exported = export_model(saved_path, Path(options.out_dir), options.model)
    return reporter.finish(sample, saved_path, exported)


def train(options: TrainOptions) -> dict[str, Any]:
    """Run the whole job on this rank; rank 0 returns the summary the launcher prints.

    Joins the default process group from the launcher's environment unless the
    caller already did (and then leaves it to the caller).
    """
    owns_group = not dist.is_initialized()
    device, mesh = _setup(options)
    try:
        return _run(options, device, mesh)
    finally:
        if owns_group:
            leave_process_group()


def _train_and_report(options: TrainOptions) -> int:
    """Train on this rank; rank 0 prints the summary. Returns the exit code (see ``main``)."""
    from mf.train.cli import STOPPED_EXIT_CODE, print_summary

    try:
        summary = train(options)
    except RunStoppedError:
        return STOPPED_EXIT_CODE  # rank 0 printed why, in one line
    except Exception as error:  # one line, the traceback in this rank's log
        return report_rank_failure(error, options, gathered=started_by_launcher())
    if summary:
        print_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank under ``torchrun ... -m mf.train.worker <mf-train options>``.

    ``--nproc`` defaults to torchrun's world size. Rank 0 prints the summary
    (or the one-line error) the ``mf-train`` launcher would. A run that stops
    (non-finite loss, failed final save) exits with ``STOPPED_EXIT_CODE`` after
    rank 0 printed why, without a traceback. Any other exception (a lost peer,
    out of memory, a bug) exits with code 1, its traceback in this rank's log and
    one line (``mf.train.failures``): printed by this rank under torchrun, by the
    ``mf-train`` launcher once for all ranks that raised it.
    Without ``mf-train``'s launcher, global rank 0 locks ``--ckpt-dir`` and
    ``--out-dir`` for the run (``mf.train.run_lock``; exit code 2 when another run
    holds one) and releases them when it ends; a rank 0 restarted by torchrun
    takes its run's lock back.
    """
    from mf.train.cli import check_data, user_error
    from mf.train.options import parse_options

    stop_with_launcher()  # a killed launcher stops its ranks (they save, as on Ctrl-C)
    args = sys.argv[1:] if argv is None else argv
    args = args[1:] if args[:1] == ["--"] else args
    world = os.environ.get("WORLD_SIZE", "1")
    try:
        options = parse_options(["--nproc", world, *args])
        check_data(options)
        if options.resume and not started_by_launcher():  # mf-train's launcher verified it
            verify_resume(options)
    except ValueError as error:
        if os.environ.get("RANK", "0") == "0":
            user_error(error)
        return 2
    if not worker_takes_locks():
        return _train_and_report(options)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    try:
        locks = acquire_run_locks(
            options, os.environ.get("TORCHELASTIC_RUN_ID"), restarted=restarted
        )
    except RunLockError as error:
        user_error(error)
        return 2
    with locks:
        return _train_and_report(options)


if __name__ == "__main__":
    sys.exit(main())
