"""Crash-safe, verified distributed checkpoints of a ``MegatronFSDP`` model and its optimizers.

A checkpoint is a folder ``step_NNNNNNN`` holding a torch.distributed.checkpoint
(DCP) save of the model's and the optimizers' *tensors* in the form of
``mf_fsdp.checkpoint.state_dict`` (see [Note: checkpoint form]: parameter-shaped,
tp-gathered global shapes), so it loads into any ZeRO strategy, data-parallel
world size, HSDP layout and tp size, plus the record ``mf_checkpoint.json``
(``checkpoint/record.py``: format version, step, the caller's ``extra``, the
model's fingerprint, every non-tensor value of the optimizers' state as JSON,
and the size and SHA-256 of every data file). Checkpoints of older formats
are refused with one error naming the format.

Loading never runs code from the checkpoint (see [Note: loading never runs
code] in ``checkpoint/safe_reader.py``) and verifies every file against the record
first (see [Note: checkpoint integrity]; ``verify=False`` skips that for a
trusted local resume).

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

Loading checks the record before any collective, on every rank alike, so a
partial or damaged checkpoint or one of another model raises the same
``ValueError`` everywhere and no rank is left waiting. The offline
converters (:func:`checkpoint_to_full_state_dict`,
:func:`full_state_dict_to_checkpoint`) need no process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mf_fsdp.checkpoint.background import (
    run_in_background,
    stage_on_host,
    wait_for_pending_save,
    writer_group,
)
from mf_fsdp.checkpoint.integrity import FileDigest, data_files, digest_folder, find_damage
from mf_fsdp.checkpoint.record import (
    RECORD_FILE,
    build_record,
    compare_fingerprints,
    from_json,
    read_record,
    tensor_info,
    to_json,
)
from mf_fsdp.checkpoint.safe_reader import (
    SafeFileSystemReader,
    data_file_names,
    read_every_tensor,
    read_metadata,
    refuse_pickled_items,
)
from mf_fsdp.checkpoint.state_dict import (
    alias_names,
    apply_optimizer_state,
    check_optimizer_binding,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP
from mf_fsdp.optim.optimizer import Optimizers, optimizer_list

__all__ = [
    "RECORD_FILE",
    "checkpoint_to_full_state_dict",
    "full_state_dict_to_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_full_state_dict",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"step_(\d+)")
_OPTIMIZER_PREFIX = "optimizer.state."


def _step_name(step: int) -> str:
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


def _model_fingerprint(model: MegatronFSDP) -> dict[str, Any]:
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


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's warning that ``no_dist=True`` means a single process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(partial: Path, final: Path, record: dict[str, Any]) -> None:
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


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _failure_cause(error: BaseException, partial: Path) -> str:
    """One line naming what failed and where, e.g. "No space left on device while writing X"."""
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
            error = _failure_cause(exc, Path())
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
        "classes": _class_names(optimizer),
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
    record = build_record(step, extra, _model_fingerprint(model), optimizer_record)
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
    partial = checkpoint_dir / f".{_step_name(step)}.partial"
    final = checkpoint_dir / _step_name(step)
    cause = _collective_on_rank0(lambda: _fresh_dir(partial), group)
    if cause is not None:
        raise _fail_save(partial, cause, group=group)
    try:
        dcp.save(state, checkpoint_id=str(partial), process_group=group)
    except CheckpointException as error:
        raise _fail_save(partial, _failure_cause(error, partial), error, group) from None
    digests = digest_folder(partial, data_files(partial, RECORD_FILE), group=group)
    unreadable = [f"{name}: {value}" for name, value in digests.items() if isinstance(value, str)]
    if unreadable:
        raise _fail_save(partial, f"could not read back {unreadable[0]}", group=group)
    record["files"] = digests
    cause = _collective_on_rank0(lambda: _publish(partial, final, record), group)
    if cause is not None:
        raise _fail_save(partial, cause, group=group)
    return final


def _class_names(optimizer: Optimizers) -> list[str]:
    return [type(opt).__name__ for opt in optimizer_list(optimizer)]


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step in ``checkpoint_dir``, or None.

    Partial folders (interrupted saves) are ignored. No communication.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return None
    complete = [
        (int(match.group(1)), path)
        for path in checkpoint_dir.iterdir()
        if (match := _STEP_DIR.fullmatch(path.name)) and (path / RECORD_FILE).is_file()
    ]
    return max(complete, default=(None, None))[1]


def _optimizer_target(
    model: MegatronFSDP,
    optimizer: Optimizers,
    metadata: Metadata,
    path: Path,
    fingerprint_fqns: Collection[str],
) -> dict[str, Any]:
    """Empty optimizer tensors built from the checkpoint's DCP metadata, in this model's layout.

    The keys are DCP's flattened names (``optimizer.state.<fqn>.<key>``), which
    DCP maps to themselves on load. A tensor takes the layout of the optimizer's
    own state tensor of that key and shape (eagerly created, so it exists: a
    parameter's rows, a row statistic's rows, a replicated column statistic),
    else, shaped like its parameter, the parameter's. Nothing is created by a
    synthetic step. Tensors of parameters another rank holds (``fingerprint_fqns``
    names the whole model's) are left to that rank.
    """
    params = {fp.fqn: fp.sharded for fp in model.fsdp_params}
    states = {id(p): state for opt in optimizer_list(optimizer) for p, state in opt.state.items()}
    target: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(_OPTIMIZER_PREFIX) or not isinstance(item, TensorStorageMetadata):
            continue
        fqn, _, name = key[len(_OPTIMIZER_PREFIX) :].rpartition(".")
        param = params.get(fqn)
        if param is None and fqn in fingerprint_fqns:
            continue  # another expert-parallel rank's expert
        if param is None:
            raise ValueError(
                f"checkpoint {str(path)!r}: optimizer tensor {key!r} does not belong to a "
                "parameter of this model"
            )
        dtype, size = item.properties.dtype, tuple(item.size)
        like = states.get(id(param), {}).get(name)
        if not (isinstance(like, torch.Tensor) and tuple(like.shape) == size):
            like = param if size == tuple(param.shape) else None
        if like is None:
            target[key] = torch.empty(size, dtype=dtype)
        else:
            target[key] = torch.empty_like(like, dtype=dtype, requires_grad=False)
    return target


def _optimizer_state(
    flat: Mapping[str, Any], record: Mapping[str, Any], local: Collection[str]
) -> dict[str, Any]:
    """The ``get_optimizer_state_dict`` structure: DCP's tensors and the record's values.

    Restricted to the parameters this rank holds (``local``): the record describes
    the whole model, whose experts may be spread over ranks.
    """
    state: dict[str, dict[str, Any]] = {
        fqn: {key: from_json(value, f"optimizer state[{fqn!r}]") for key, value in values.items()}
        for fqn, values in record["state"].items()
        if fqn in local
    }
    for key, value in flat.items():
        if key.startswith(_OPTIMIZER_PREFIX):
            fqn, _, name = key[len(_OPTIMIZER_PREFIX) :].rpartition(".")
            state.setdefault(fqn, {})[name] = value
    groups = from_json(record["param_groups"], "param_groups")
    for group in groups:
        group["params"] = [fqn for fqn in group["params"] if fqn in local]
    return {"state": state, "param_groups": groups}


def _verify(path: Path, record: Mapping[str, Any], caller: str, collective: bool = True) -> None:
    """Raise on every rank if a data file differs from the record (see ``find_damage``)."""
    problems = find_damage(path, record["files"], RECORD_FILE, collective)
    if problems:
        skip = "" if caller == "verify_checkpoint" else " (verify=False skips this check)"
        raise ValueError(
            f"{caller}: checkpoint {str(path)!r} is damaged: {'; '.join(problems)}; refusing "
            f"to load it{skip}"
        )


def _check_optimizer_classes(path: Path, record: Mapping[str, Any], optimizer: Optimizers) -> None:
    """Raise unless the checkpoint holds the state of ``optimizer``'s classes, in order."""
    saved = record["optimizer"]["classes"] if record["optimizer"] else []
    if saved != _class_names(optimizer):
        raise ValueError(
            f"optimizer: checkpoint {str(path)!r} holds the state of "
            f"{', '.join(saved or ['no optimizer'])}, not of "
            f"{', '.join(_class_names(optimizer))}; pass the same optimizer classes in "
            "the same order, or optimizer=None to load the model only"
        )


def _checked_metadata(path: Path, record: Mapping[str, Any]) -> Metadata:
    """DCP's metadata, read safely; refuses pickled items and records without checksums."""
    metadata = read_metadata(path)
    refuse_pickled_items(metadata, metadata.state_dict_metadata, path)
    if not record["files"]:
        raise ValueError(f"checkpoint record {str(path / RECORD_FILE)!r} lists no data files")
    unlisted = sorted(data_file_names(metadata) - set(record["files"]))
    if unlisted:
        raise ValueError(
            f"checkpoint {str(path)!r}: its DCP metadata names the data file {unlisted[0]!r}, "
            f"which its record {RECORD_FILE} does not list with a checksum; refusing to load it"
        )
    return metadata


def _read_tensors(state: dict[str, Any], path: Path, caller: str, **kwargs: Any) -> None:
    """``dcp.load`` through the safe reader; a read failure raises one line naming its cause."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), **kwargs)
    except CheckpointException as error:
        refused = [exc for exc, _ in error.failures.values() if isinstance(exc, ValueError)]
        if refused:  # the safe reader refused a file: its one line says which and why
            raise ValueError(f"{caller}: {refused[0]}") from None
        cause = _failure_cause(error, path).replace("while writing", "while reading")
        raise RuntimeError(f"{caller}: {cause}\n{error}") from None


def load_checkpoint(
    path: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a complete checkpoint into ``model`` (and ``optimizer``); collective.

    Works across ZeRO strategies and data-parallel world sizes, and into a fresh
    optimizer whose state is still empty (its state is built from the
    checkpoint's metadata). Never runs code from the checkpoint.

    Args:
        path: a checkpoint folder (e.g. from :func:`latest_checkpoint`).
        model: the wrapped model; its weights are replaced and installed.
        optimizer: its optimizer, whose state and options are replaced, a list or tuple
            of them (the classes, in order, of the save), or None.
        verify: check every data file against the checksums saved with it first (the
            ranks share the hashing); False skips that, for a trusted local resume.

    Returns:
        The ``extra`` values saved with the checkpoint, plus ``"step"``.

    Raises:
        ValueError: on every rank, before any tensor is read, if ``path`` is absent,
            a file or incomplete, its record or metadata is damaged, a data file
            differs from its checksum, it was saved from a different model (listing
            the differences), or holds no state of ``optimizer``'s classes.
    """
    wait_for_pending_save()  # the pending save may be writing this very folder
    record = read_record(path)
    path = Path(path)
    fingerprint = _model_fingerprint(model)
    compare_fingerprints(path, record, fingerprint)
    if optimizer is not None:
        _check_optimizer_classes(path, record, optimizer)
        check_optimizer_binding(model, optimizer)
    metadata = _checked_metadata(path, record)
    if verify:
        _verify(path, record, "load_checkpoint")
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state.update(_optimizer_target(model, optimizer, metadata, path, fingerprint["tensors"]))
    _read_tensors(state, path, "load_checkpoint")
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        local = {fp.fqn for fp in model.fsdp_params}
        loaded = _optimizer_state(state, record["optimizer"], local)
        apply_optimizer_state(model, optimizer, loaded, owned=True)
    return {**record["extra"], "step": record["step"]}


def _module_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """Name -> shape and dtype of every tensor of an unwrapped module's state dict.

    Tied names are listed like any other: tying does not change what a checkpoint
    must hold under each name.
    """
    return {
        "tensors": {
            fqn: tensor_info(value.shape, value.dtype)
            for fqn, value in module.state_dict().items()
            if isinstance(value, torch.Tensor)
        }
    }


def _saved_fingerprint(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's tensors with each tied name listed under its own name too."""
    tensors = dict(record["tensors"])
    for alias, fqn in record["aliases"].items():
        if fqn in tensors:
            tensors[alias] = tensors[fqn]
    return {"tensors": tensors}


def verify_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module | None = None,
    optimizer: Optimizers | None = None,
) -> dict[str, Any]:
    """Check a checkpoint as :func:`load_checkpoint` would, offline and loading nothing.

    For a launcher to refuse a damaged, hostile or foreign checkpoint before it
    starts any process. Needs no process group and reads one tensor at a time.
    Checks, in order: the record (every field); that it was saved from ``model``
    and holds the state of ``optimizer``'s classes; DCP's metadata, read without
    running code, naming no pickled item and only regular files of the folder
    listed in the record; every data file against its checksum; and every tensor
    chunk, read once and dropped, so a data file holding pickled code is refused by
    name. Nothing runs from the checkpoint.

    Args:
        path: a checkpoint folder.
        model: the *unwrapped* module the checkpoint is for (one built on the meta
            device costs nothing): the names, global shapes and dtypes of its state
            dict must be the checkpoint's; None skips this.
        optimizer: an optimizer or a list of them whose classes, in order, must be
            the checkpoint's (built over the meta module's parameters is enough);
            None skips this.

    Returns:
        The ``extra`` values saved with the checkpoint, plus ``"step"``.

    Raises:
        TypeError: if ``model`` is a ``MegatronFSDP`` (pass its unwrapped module, or
            use :func:`load_checkpoint`).
        ValueError: naming the folder and the file or field at fault.
    """
    if isinstance(model, MegatronFSDP):
        raise TypeError(
            "model: verify_checkpoint takes the unwrapped module (e.g. built on the meta "
            "device), not a MegatronFSDP; load_checkpoint checks a wrapped model"
        )
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
    record = read_record(path)
    path = Path(path)
    if model is not None:
        compare_fingerprints(path, _saved_fingerprint(record), _module_fingerprint(model))
    if optimizer is not None:
        _check_optimizer_classes(path, record, optimizer)
    metadata = _checked_metadata(path, record)
    _verify(path, record, "verify_checkpoint", collective=False)
    try:
        with _single_process():
            read_every_tensor(path, metadata)
    except ValueError as error:
        raise ValueError(f"verify_checkpoint: {error}") from None
    return {**record["extra"], "step": record["step"]}


def checkpoint_to_full_state_dict(
    path: str | os.PathLike[str], *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as one plain full state dict (offline).

    Needs no process group and reads only the model's tensors, never running
    code from the checkpoint. The result (parameters in their full module
    shapes, tensor-parallel ones gathered whatever their partition dim and
    stride, persistent buffers, tied names) loads with
    ``unwrapped_model.load_state_dict``; write it with :func:`save_full_state_dict`.

    Args:
        path: a checkpoint folder.
        verify: check every data file against its checksum first.

    Raises:
        ValueError: if ``path`` is not a complete, undamaged checkpoint of the current
            format.
    """
    record = read_record(path)
    path = Path(path)
    _checked_metadata(path, record)
    if verify:
        _verify(path, record, "checkpoint_to_full_state_dict", collective=False)
    model = {
        fqn: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        for fqn, info in record["tensors"].items()
    }
    with _single_process():
        _read_tensors({"model": model}, path, "checkpoint_to_full_state_dict", no_dist=True)
    for alias, fqn in record["aliases"].items():
        model[alias] = model[fqn]
    return model


def save_full_state_dict(
    state_dict: Mapping[str, torch.Tensor], file: str | os.PathLike[str]
) -> Path:
    """Write a full state dict as a safetensors file (``.safetensors``).

    Safetensors holds tensors only, so loading the export runs no code
    (``safetensors.torch.load_file``). Tied entries are written as separate
    copies.

    Raises:
        ValueError: if ``file`` does not end in ``.safetensors``.
        TypeError: if a value is not a tensor.
    """
    file = Path(file)
    if file.suffix != ".safetensors":
        raise ValueError(
            f"file: {str(file)!r} must end in .safetensors (exports are safetensors, which "
            "hold tensors only and load without running code)"
        )
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}]: expected a tensor, got {type(value).__name__}")
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, str(file))
    return file


def full_state_dict_to_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    checkpoint_dir: str | os.PathLike[str],
    *,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Turn a plain model state dict into a complete mf checkpoint (offline, no process group).

    The checkpoint holds no optimizer state; :func:`load_checkpoint` loads it into
    a wrapped model of any strategy and world size. Entries that share storage
    (tied weights) are stored once and recorded as aliases, as a wrapped model
    stores them. Call it on one process only.

    Args:
        state_dict: e.g. ``unwrapped_model.state_dict()`` or the result of
            :func:`checkpoint_to_full_state_dict`.
        checkpoint_dir: folder to create ``step_NNNNNNN`` in.
        step: the step recorded (and in the folder name).
        extra: JSON-serialisable values returned by :func:`load_checkpoint`.

    Returns:
        The path of the complete checkpoint.

    Raises:
        TypeError: if a value is not a tensor, or ``extra`` is not JSON-serialisable.
        RuntimeError: when writing fails (the first line names the cause and the file;
            the partial folder is removed).
    """
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    model: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for fqn, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state_dict[{fqn!r}]: expected a tensor, got {type(value).__name__}; drop "
                "non-tensor entries (e.g. _extra_state) first"
            )
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            value.shape,
            value.stride(),
            value.dtype,
        )
        if value.numel() and key in seen:
            aliases[fqn] = seen[key]
            continue
        seen[key] = fqn
        tensors[fqn] = tensor_info(value.shape, value.dtype)
        model[fqn] = value.detach().contiguous()
    record = build_record(step, extra, {"tensors": tensors, "aliases": aliases}, None)
    checkpoint_dir = Path(checkpoint_dir)
    partial = checkpoint_dir / f".{_step_name(step)}.partial"
    final = checkpoint_dir / _step_name(step)
    try:
        _fresh_dir(partial)
        with _single_process():
            dcp.save({"model": model}, checkpoint_id=str(partial), no_dist=True)
        digests: dict[str, FileDigest | str] = digest_folder(
            partial, data_files(partial, RECORD_FILE), collective=False
        )
        record["files"] = digests
        _publish(partial, final, record)
    except (CheckpointException, OSError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(
            f"full_state_dict_to_checkpoint: {_failure_cause(error, partial)}; nothing was saved"
        ) from None
    return final
