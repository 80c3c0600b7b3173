"""Saving a ``MegatronFSDP`` model and its optimizers as a crash-safe, checksummed folder.

A checkpoint is a folder ``step_NNNNNNN`` holding a torch.distributed.checkpoint
(DCP) save of the model's and the optimizers' *tensors* in the form of
``mf_fsdp.checkpoint.state_dict`` (see [Note: checkpoint form]: parameter-shaped,
tp-gathered global shapes), so it loads into any ZeRO strategy, data-parallel
world size, HSDP layout and tp size, plus the record ``mf_checkpoint.json``
(``checkpoint/record.py``: format version, step, the caller's ``extra``, the
model's fingerprint, every non-tensor value of the optimizers' state as JSON,
and the size and SHA-256 of every data file; see [Note: checkpoint integrity]).

[Note: crash-safe save]
Every rank writes into ``.step_NNNNNNN.partial``. Only after DCP finished on
all ranks (its metadata is written last) and the files are hashed does rank
0 write the record (fsynced, then renamed into place) and rename the folder
to ``step_NNNNNNN``, an atomic rename on one file system. A save that fails
(a full disk, an unwritable folder) removes its partial folder on every
rank's behalf and raises ``RuntimeError`` on every rank, the first line
naming the cause and the file ("No space left on device while writing
..."). A save killed at any point leaves either the finished folder or a
``.partial`` folder without a record, which :func:`latest_checkpoint`
ignores, :func:`load_checkpoint` refuses and the next save of that step
replaces. Other checkpoints are never touched.

This module writes checkpoints (``save_checkpoint``, synchronous or through
``checkpoint/background.py``) and owns what a written folder is: its name
(``step_name``, ``STEP_DIR``), the model's fingerprint its record holds, the
publication that makes it complete, and the one-line cause of a failed write;
the loader and the offline converter use these. It never reads a checkpoint
back (``checkpoint/load.py``, ``checkpoint/verify.py``) and never touches a
folder but the one of the step it saves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mf_fsdp.checkpoint.background import (
    run_in_background,
    stage_on_host,
    wait_for_pending_save,
    writer_group,
)
from mf_fsdp.checkpoint.integrity import data_files, digest_folder
from mf_fsdp.checkpoint.record import RECORD_FILE, build_record, tensor_info, to_json
from mf_fsdp.checkpoint.state_dict import (
    alias_names,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP
from mf_fsdp.optim.optimizer import Optimizers, optimizer_list

__all__ = [
    "STEP_DIR",
    "class_names",
    "failure_cause",
    "fresh_dir",
    "model_fingerprint",
    "publish",
    "save_checkpoint",
    "step_name",
]

STEP_DIR = re.compile(r"step_(\d+)")
"""The name of a checkpoint's folder (``step_NNNNNNN``); its group is the step."""


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``step_`` and at least seven digits."""
    return f"step_{step:07d}"


def _every_rank(model: MegatronFSDP, value: Any) -> list[Any]:
    """Every rank's ``value`` (collective) when ranks hold different parameters, else ``[value]``.

    Only expert parallelism gives ranks different parameters (each holds its own
    experts); a checkpoint's record then describes the union, the whole model.
    """
    if model.dist_index.expert_index is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def model_fingerprint(model: MegatronFSDP) -> dict[str, Any]:
    """FQN -> global shape and dtype of every tensor a checkpoint holds, plus tied names.

    Collective for a model with experts: the fingerprint of the whole model.
    """
    tensors = {
        fqn: tensor_info(value.shape, value.dtype)
        for fqn, value in get_model_state_dict(model).items()
        if isinstance(value, torch.Tensor)
    }
    merged: dict[str, Any] = {}
    for rank_tensors in _every_rank(model, tensors):
        merged.update(rank_tensors)
    return {"tensors": merged, "aliases": alias_names(model)}


def _merge_optimizer_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer record of the whole model from every rank's (the ranks' experts differ).

    Each group lists every rank's parameters in first-seen order; the non-tensor
    state of every parameter is kept.
    """
    merged = records[0]
    for other in records[1:]:
        for group, other_group in zip(merged["param_groups"], other["param_groups"], strict=True):
            seen = set(group["params"])
            group["params"].extend(p for p in other_group["params"] if p not in seen)
        merged["state"].update(other["state"])
    return merged


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: Path, final: Path, record: dict[str, Any]) -> None:
    """Write the record into ``partial``, rename it to ``final`` ([Note: crash-safe save])."""
    tmp = partial / f"{RECORD_FILE}.tmp"
    with open(tmp, "w") as out:
        json.dump(record, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, partial / RECORD_FILE)
    _fsync_dir(partial)
    replaced = final.with_name(f".{final.name}.replaced")
    if final.exists():  # a re-save of the same step: swap, then drop the old one
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def fresh_dir(path: Path) -> None:
    """Make ``path`` an empty folder, dropping what an interrupted save left there."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def failure_cause(error: BaseException, partial: Path) -> str:
    """One line naming what failed and where, e.g. "No space left on device while writing X"."""
    failures: list[tuple[int | None, BaseException]]
    if isinstance(error, CheckpointException):
        failures = [(rank, exc) for rank, (exc, _) in sorted(error.failures.items())]
    else:
        failures = [(None, error)]
    for rank, exc in failures:
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, OSError):
                where = seen.filename or partial
                on = "" if rank is None else f" (rank {rank})"
                return f"{seen.strerror or seen} while writing {where}{on}"
            seen = seen.__cause__ or seen.__context__
    rank, exc = failures[0]
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _collective_on_rank0(
    action: Callable[[], None], group: dist.ProcessGroup | None = None
) -> str | None:
    """Run ``action`` on rank 0; every rank gets None, or the error it raised (collective)."""
    error = None
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as exc:
            error = failure_cause(exc, Path())
    status = [error]
    dist.broadcast_object_list(status, src=0, group=group)
    return status[0]


def _fail_save(
    partial: Path,
    cause: str,
    details: BaseException | None = None,
    group: dist.ProcessGroup | None = None,
) -> RuntimeError:
    """Remove the partial folder (rank 0; collective) and build the error every rank raises."""
    _collective_on_rank0(lambda: shutil.rmtree(partial, ignore_errors=True), group)
    message = f"save_checkpoint: {cause}; nothing was saved (older checkpoints are intact)"
    if details is not None:
        message += f"\n{details}"
    return RuntimeError(message)


def _split_optimizer_state(
    model: MegatronFSDP, optimizer: Optimizers
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizers' state dict as DCP tensors and the record's JSON values."""
    saved = get_optimizer_state_dict(model, optimizer)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for fqn, values in saved["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(fqn, {})[key] = value
            else:
                where = f"optimizer state[{fqn!r}][{key!r}]"
                objects.setdefault(fqn, {})[key] = to_json(value, where)
    record = {
        "classes": class_names(optimizer),
        "param_groups": to_json(saved["param_groups"], "optimizer param_groups"),
        "state": objects,
    }
    return {"state": tensors}, _merge_optimizer_records(_every_rank(model, record))


@overload
def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: Literal[False] = False,
) -> Path: ...


@overload
def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: Literal[True],
) -> Future[Path]: ...


@overload
def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
) -> Path | Future[Path]: ...


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
) -> Path | Future[Path]:
    """Save ``model`` (and ``optimizer``) as ``checkpoint_dir/step_NNNNNNN``; collective.

    Every rank calls it with the same arguments. The save is crash-safe and
    checksummed (see [Note: crash-safe save], [Note: checkpoint integrity]); an
    existing checkpoint of the same step is replaced only once the new one is
    complete. A save first waits for this process's pending asynchronous save.

    Args:
        checkpoint_dir: folder holding the checkpoints (created if needed; shared by
            all ranks).
        model: the wrapped model.
        optimizer: its optimizer (bound by ``fully_shard_optimizer``), a list or tuple of
            them (stored as one state dict, see ``get_optimizer_state_dict``), or None.
        step: the training step, recorded and used in the folder name.
        extra: JSON-serialisable values returned by :func:`load_checkpoint`.
        async_save: return once the state is copied into host memory and write the
            checkpoint in the background (see [Note: asynchronous save]); training
            may change the model and optimizer meanwhile.

    Returns:
        The path of the complete checkpoint; with ``async_save``, a future of it
        (its ``result()`` raises the ``RuntimeError`` a synchronous save would).

    Raises:
        TypeError / ValueError: for bad arguments (on every rank, before any I/O).
        RuntimeError: on every rank when writing fails; its first line names the cause
            and the file (e.g. "No space left on device while writing ..."), and the
            partial folder is gone.
    """
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save: expected a bool, got {async_save!r}")
    wait_for_pending_save()
    optimizer_tensors, optimizer_record = (
        _split_optimizer_state(model, optimizer) if optimizer is not None else ({}, None)
    )
    record = build_record(step, extra, model_fingerprint(model), optimizer_record)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer_tensors:
        state["optimizer"] = optimizer_tensors
    checkpoint_dir = Path(checkpoint_dir)
    if not async_save:
        return _write(checkpoint_dir, step, state, record, group=None)
    staged, group = stage_on_host(state), writer_group()
    return run_in_background(lambda: _write(checkpoint_dir, step, staged, record, group))


def _write(
    checkpoint_dir: Path,
    step: int,
    state: dict[str, Any],
    record: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> Path:
    """Write ``state`` as the checkpoint of ``step``, then publish ``record``; collective."""
    partial = checkpoint_dir / f".{step_name(step)}.partial"
    final = checkpoint_dir / step_name(step)
    cause = _collective_on_rank0(lambda: fresh_dir(partial), group)
    if cause is not None:
        raise _fail_save(partial, cause, group=group)
    try:
        dcp.save(state, checkpoint_id=str(partial), process_group=group)
    except CheckpointException as error:
        raise _fail_save(partial, failure_cause(error, partial), error, group) from None
    digests = digest_folder(partial, data_files(partial, RECORD_FILE), group=group)
    unreadable = [f"{name}: {value}" for name, value in digests.items() if isinstance(value, str)]
    if unreadable:
        raise _fail_save(partial, f"could not read back {unreadable[0]}", group=group)
    record["files"] = digests
    cause = _collective_on_rank0(lambda: publish(partial, final, record), group)
    if cause is not None:
        raise _fail_save(partial, cause, group=group)
    return final


def class_names(optimizer: Optimizers) -> list[str]:
    """The class names of ``optimizer``'s optimizers, in order, as a checkpoint records them."""
    return [type(opt).__name__ for opt in optimizer_list(optimizer)]
