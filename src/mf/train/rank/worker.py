"""The per-rank body of ``mf-train``: build, shard, train, validate, save, sample.

Started on every rank by torch's elastic launcher (``mf-train``) or by
``torchrun -m mf.train.rank.worker`` for multi-node runs. All ranks run the same
steps in lockstep; rank 0 alone prints, writes metrics and draws plots.
A run that cannot go on (a NaN or infinite loss, a failed final save) stops
on every rank at the same step, after rank 0 printed why in one line.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mf.launch import leave_process_group, stop_with_launcher
from mf.models import (
    MODEL_PRESETS,
)
from mf.train.data.run_data import training_data
from mf.train.exports.export import export_model
from mf.train.exports.folder_export import export_folder
from mf.train.rank.checkpoints import Checkpoints, last_save_reason, restart_checkpoint, resume
from mf.train.rank.setup import build, dp_coordinates, setup
from mf.train.rank.step import routing_metrics, sample_of, train_step, validate
from mf.train.reports.profiling import StepProfiler, parse_window
from mf.train.reports.report import Reporter
from mf.train.run.failures import report_rank_failure
from mf.train.run.options import RESULT_SETTINGS, TrainOptions
from mf.train.run.resume import verify_resume
from mf.train.run.run_lock import (
    RunLockError,
    acquire_run_locks,
    started_by_launcher,
    worker_takes_locks,
)
from mf.train.run.stopping import RunStoppedError, StopFlag, stop_if_diverged
from mf.train.sources.model_folder import folder_of
from mf_fsdp import checkpoint as fsdp_checkpoint

__all__ = ["RunStoppedError", "main", "train"]


# --- checkpoints: the only place that saves or loads training state ---------------------------


# -----------------------------------------------------------------------------------------------


def _run(options: TrainOptions, device: torch.device, mesh: DeviceMesh) -> dict[str, Any]:
    data, corpus_name = training_data(options)
    model, optimizers = build(options, mesh, device)
    info = {
        "model": options.model,
        "tp": options.tp,
        "cp": options.cp,
        "ep": options.ep,
        "etp": options.etp,
        "zero": options.zero,
        "optimizer": options.optimizer,
        "lora_rank": options.lora_rank,
        "lora_targets": options.lora_targets,
        "base_dtype": options.base_dtype,  # NF4 checkpoints hold no bases
        **{name: getattr(options, name) for name in RESULT_SETTINGS},
    }
    ckpt_dir = Path(options.ckpt_dir)
    restart = restart_checkpoint(options)
    if restart is not None:  # the steps since that checkpoint are recomputed
        start_step = fsdp_checkpoint.load_checkpoint(restart, model, optimizers)["step"]
    else:
        start_step = resume(options, model, optimizers) if options.resume else 0
    reporter = Reporter(
        options,
        dist.get_rank() == 0,
        start_step,
        corpus_name,
        len(data.train),
        len(data.validation),
        _parameters(options.model),
    )
    tokens_per_step = options.micro_batch * options.seq_len * options.grad_accum
    tokens_per_step *= dp_coordinates(mesh)[1]
    checkpoints = Checkpoints(ckpt_dir, model, optimizers, info, reporter)
    step = start_step
    profiler = StepProfiler(
        None if options.profile is None else parse_window(options.profile, options.steps),
        Path(options.out_dir),
        dist.get_rank(),
    )
    with StopFlag() as stop, reporter.bar_closed_on_error(), contextlib.closing(profiler):
        while step < options.steps:
            started = time.perf_counter()
            profiler.before(step + 1)
            result = train_step(model, optimizers, data, options, step, mesh, device)
            train_loss = result.loss
            step += 1
            profiler.after(step)
            elapsed = time.perf_counter() - started
            rate = tokens_per_step / elapsed
            host_share = (result.issued - started) / elapsed  # the rest: waiting for the device
            validation = None
            if math.isfinite(train_loss) and (
                step % options.eval_every == 0 or step == options.steps
            ):
                validation = validate(model, data, options, mesh, device)
            extra = {"lr": result.lr, **routing_metrics(model, options.tp)}
            if result.grad_norm is not None:
                extra["grad_norm"] = result.grad_norm
            reporter.step(step, train_loss, validation, rate, device, extra, host_share)
            if not math.isfinite(train_loss):
                checkpoints.settle()  # the stop names the newest checkpoint
            stop_if_diverged(reporter, train_loss, step, checkpoints.newest)
            interrupted = stop.agreed(device)
            final = last_save_reason(step, options.steps, interrupted)
            if final or (options.save_every and step % options.save_every == 0):
                checkpoints.save(step, final, in_background=not options.sync_save)
            if interrupted:
                reporter.interrupted(step)
                break
    checkpoints.settle()
    saved_path = checkpoints.newest
    finished = step == options.steps
    sample = (
        sample_of(model, data, "The ", options, device)
        if finished and options.sample_tokens
        else None
    )
    exported = None
    if finished and saved_path is not None and reporter.active:
        folder = folder_of(options.model)
        if folder is None:
            exported = export_model(saved_path, Path(options.out_dir), options.model)
        elif options.lora_rank is not None:
            from mf.train.exports.adapter_export import export_adapter

            exported = export_adapter(saved_path, Path(options.out_dir), folder, options)
        else:
            exported = export_folder(
                saved_path, Path(options.out_dir), folder, options.chat_template
            )
    return reporter.finish(sample, saved_path, exported)


def _parameters(model: str) -> int:
    """The parameters of ``--model``: a preset's, or a folder's model's."""
    folder = folder_of(model)
    return MODEL_PRESETS[model].num_parameters() if folder is None else folder.parameters


def train(options: TrainOptions) -> dict[str, Any]:
    """Run the whole job on this rank; rank 0 returns the summary the launcher prints.

    Joins the default process group from the launcher's environment unless the
    caller already did (and then leaves it to the caller).
    """
    owns_group = not dist.is_initialized()
    device, mesh = setup(options)
    try:
        return _run(options, device, mesh)
    finally:
        if owns_group:
            leave_process_group()


def _train_and_report(options: TrainOptions) -> int:
    """Train on this rank; rank 0 prints the summary. Returns the exit code (see ``main``)."""
    from mf.train.run.cli import STOPPED_EXIT_CODE, print_summary

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
    """Entry point of one rank under ``torchrun ... -m mf.train.rank.worker <mf-train options>``.

    ``--nproc`` defaults to torchrun's world size. Rank 0 prints the summary
    (or the one-line error) the ``mf-train`` launcher would. A run that stops
    (non-finite loss, failed final save) exits with ``STOPPED_EXIT_CODE`` after
    rank 0 printed why, without a traceback. Any other exception (a lost peer,
    out of memory, a bug) exits with code 1, its traceback in this rank's log and
    one line (``mf.train.run.failures``): printed by this rank under torchrun, by the
    ``mf-train`` launcher once for all ranks that raised it.
    Without ``mf-train``'s launcher, global rank 0 locks ``--ckpt-dir`` and
    ``--out-dir`` for the run (``mf.train.run.run_lock``; exit code 2 when another run
    holds one) and releases them when it ends; a rank 0 restarted by torchrun
    takes its run's lock back.
    """
    from mf.train.run.cli import check_data, user_error
    from mf.train.run.options import parse_options

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
