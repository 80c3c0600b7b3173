"""Crash-safe distributed checkpoints of a ``MegatronFSDP`` model and its optimizer.

A checkpoint is a folder ``step_NNNNNNN`` holding a torch.distributed.checkpoint
(DCP) save of ``{"model": ..., "optimizer": ...}`` in the form of
``mf_fsdp.state_dict`` (see [Note: checkpoint form]: parameter-shaped,
tp-gathered global shapes), so it loads into any ZeRO strategy, data-parallel
world size, HSDP layout and tp size, plus a record file ``mf_checkpoint.json``
(format version, step, the caller's ``extra``, and the model's fingerprint:
FQN, global shape and dtype of every tensor, and tied names). A checkpoint of
the flat format of mf-fsdp 0.1 (version 1: every tensor stored as ``(numel,)``)
is refused with one error naming that format.

[Note: crash-safe save]
Every rank writes into ``.step_NNNNNNN.partial``. Only after DCP finished on
all ranks (its metadata is written last) does rank 0 write the record file
(fsynced, then renamed into place) and rename the folder to ``step_NNNNNNN``,
an atomic rename on one file system. A save killed at any point therefore
leaves either the finished folder or a ``.partial`` folder without a record,
which :func:`latest_checkpoint` ignores, :func:`load_checkpoint` refuses and
the next save of that step replaces. Other checkpoints are never touched.

Loading checks the record before any collective, on every rank alike, so a
partial checkpoint or one of another model raises the same ``ValueError``
everywhere and no rank is left waiting. The offline converters
(:func:`checkpoint_to_full_state_dict`, :func:`full_state_dict_to_checkpoint`)
need no process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mf_fsdp.megatron_fsdp import MegatronFSDP
from mf_fsdp.optimizer import Optimizers, optimizer_list
from mf_fsdp.state_dict import (
    alias_names,
    apply_optimizer_state,
    check_optimizer_binding,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

__all__ = [
    "RECORD_FILE",
    "checkpoint_to_full_state_dict",
    "full_state_dict_to_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_full_state_dict",
]

RECORD_FILE = "mf_checkpoint.json"
"""Written last into a checkpoint folder: its presence means the checkpoint is complete."""

_FORMAT = "mf-fsdp-dcp"
_VERSION = 2  # 1: mf-fsdp 0.1's flat form, every tensor (numel,); 2: parameter-shaped
_STEP_DIR = re.compile(r"step_(\d+)")


def _step_name(step: int) -> str:
    return f"step_{step:07d}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_info(shape: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": _dtype_name(dtype)}


def _model_fingerprint(model: MegatronFSDP) -> dict[str, Any]:
    """FQN -> global shape and dtype of every tensor a checkpoint holds, plus tied names."""
    tensors = {
        fqn: _tensor_info(value.shape, value.dtype)
        for fqn, value in get_model_state_dict(model).items()
        if isinstance(value, torch.Tensor)
    }
    return {"tensors": tensors, "aliases": alias_names(model)}


def _compare(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise one ValueError listing every difference between two fingerprints' tensors."""
    saved_t, current_t = saved["tensors"], current["tensors"]
    missing = [k for k in current_t if k not in saved_t]
    unexpected = [k for k in saved_t if k not in current_t]
    differ = [
        f"{k}: checkpoint {_describe(saved_t[k])} vs model {_describe(current_t[k])}"
        for k in current_t
        if k in saved_t and _describe(saved_t[k]) != _describe(current_t[k])
    ]
    if missing or unexpected or differ:
        raise ValueError(
            f"checkpoint {str(path)!r} was saved from a different model: missing keys "
            f"{missing!r}, unexpected keys {unexpected!r}, mismatched: {'; '.join(differ) or '-'}"
        )


def _describe(info: Mapping[str, Any]) -> str:
    return f"{tuple(info['shape'])} {info['dtype']}"


def _read_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record of a complete checkpoint folder (no communication).

    Raises:
        ValueError: if ``path`` is not a folder, or is an incomplete (partial) checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path: {str(path)!r} is not a checkpoint folder (it does not exist)")
    record = path / RECORD_FILE
    if not record.is_file():
        raise ValueError(
            f"path: {str(path)!r} is an incomplete checkpoint (no {RECORD_FILE}; a save was "
            "interrupted); load a complete one, e.g. latest_checkpoint(checkpoint_dir)"
        )
    data = json.loads(record.read_text())
    if data.get("format") != _FORMAT:
        raise ValueError(f"path: {str(path)!r} is not an mf_fsdp checkpoint ({RECORD_FILE})")
    if data.get("version") != _VERSION:
        raise ValueError(
            f"path: {str(path)!r} is an mf_fsdp checkpoint of format version "
            f"{data.get('version')!r} (1 = the flat form of mf-fsdp 0.1, every tensor stored as "
            f"(numel,)); this mf-fsdp reads version {_VERSION} (parameter-shaped tensors) only"
        )
    return data


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


def _record(
    step: int, extra: Mapping[str, Any] | None, fingerprint: dict[str, Any], **kw: Any
) -> dict[str, Any]:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    record = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "extra": dict(extra or {}),
        **kw,
        **fingerprint,
    }
    try:
        json.dumps(record)
    except TypeError as error:
        raise TypeError(f"extra: expected JSON-serialisable values, got {extra!r}") from error
    return record


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _on_rank0(action: Callable[[], None], what: str) -> None:
    """Run ``action`` on rank 0; every rank returns after it, or raises its error (collective)."""
    error = None
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    status = [error]
    dist.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise RuntimeError(f"save_checkpoint: rank 0 could not {what}: {status[0]}")


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) as ``checkpoint_dir/step_NNNNNNN``; collective.

    Every rank calls it with the same arguments. The save is crash-safe (see
    [Note: crash-safe save]); an existing checkpoint of the same step is
    replaced only once the new one is complete.

    Args:
        checkpoint_dir: folder holding the checkpoints (created if needed; shared by
            all ranks).
        model: the wrapped model.
        optimizer: its optimizer (bound by ``fully_shard_optimizer``), a list or tuple of
            them (stored as one state dict, see ``get_optimizer_state_dict``), or None.
        step: the training step, recorded and used in the folder name.
        extra: JSON-serialisable values returned by :func:`load_checkpoint`.

    Returns:
        The path of the complete checkpoint.

    Raises:
        TypeError / ValueError: for bad arguments (on every rank, before any I/O).
        RuntimeError: on every rank, if rank 0 could not create the partial folder or
            publish the checkpoint (the partial folder is then left as it is).
    """
    classes = None if optimizer is None else _class_names(optimizer)
    record = _record(step, extra, _model_fingerprint(model), optimizer=classes)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        optim = get_optimizer_state_dict(model, optimizer)
        # A tuple is stored by DCP as one object; a list of dicts would be split per key.
        state["optimizer"] = {"state": optim["state"], "param_groups": tuple(optim["param_groups"])}
    checkpoint_dir = Path(checkpoint_dir)
    partial = checkpoint_dir / f".{_step_name(step)}.partial"
    final = checkpoint_dir / _step_name(step)
    _on_rank0(lambda: _fresh_dir(partial), f"create {str(partial)!r}")
    dcp.save(state, checkpoint_id=str(partial))
    _on_rank0(lambda: _publish(partial, final, record), f"publish {str(final)!r}")
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
    model: MegatronFSDP, optimizer: Optimizers, metadata: Metadata, path: Path
) -> dict[str, Any]:
    """Empty optimizer state built from the checkpoint's DCP metadata, in this model's layout.

    The keys are DCP's flattened names (``optimizer.state.<fqn>.<key>``), which
    DCP maps to themselves on load. A tensor takes the layout of the optimizer's
    own state tensor of that key and shape (eagerly created, so it exists: a
    parameter's rows, a row statistic's rows, a replicated column statistic),
    else, shaped like its parameter, the parameter's. Nothing is created by a
    synthetic step.
    """
    params = {fp.fqn: fp.sharded for fp in model.fsdp_params}
    states = {id(p): state for opt in optimizer_list(optimizer) for p, state in opt.state.items()}
    target: dict[str, Any] = {}
    prefix = "optimizer.state."
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith("optimizer."):
            continue
        if not isinstance(item, TensorStorageMetadata):
            target[key] = None  # a pickled object: DCP replaces the placeholder
            continue
        fqn, _, name = (
            key[len(prefix) :].rpartition(".") if key.startswith(prefix) else ("", "", "")
        )
        param = params.get(fqn)
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


def _unflatten_optimizer(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The ``get_optimizer_state_dict`` structure from DCP's flattened optimizer keys."""
    prefix = "optimizer.state."
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix) :].rpartition(".")
            state.setdefault(fqn, {})[name] = value
    return {"state": state, "param_groups": list(flat["optimizer.param_groups"])}


def load_checkpoint(
    path: str | os.PathLike[str],
    model: MegatronFSDP,
    optimizer: Optimizers | None = None,
) -> dict[str, Any]:
    """Load a complete checkpoint into ``model`` (and ``optimizer``); collective.

    Works across ZeRO strategies and data-parallel world sizes, and into a fresh
    optimizer whose state is still empty (its state is built from the
    checkpoint's metadata).

    Args:
        path: a checkpoint folder (e.g. from :func:`latest_checkpoint`).
        model: the wrapped model; its weights are replaced and installed.
        optimizer: its optimizer, whose state and options are replaced, a list or tuple
            of them (the classes, in order, of the save), or None.

    Returns:
        The ``extra`` values saved with the checkpoint, plus ``"step"``.

    Raises:
        ValueError: on every rank, before any collective, if ``path`` is absent or
            incomplete, was saved from a different model (listing the
            differences), or holds no state of ``optimizer``'s classes.
    """
    path = Path(path)
    record = _read_record(path)
    _compare(path, record, _model_fingerprint(model))
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        saved = record["optimizer"]
        saved = [saved] if isinstance(saved, str) else saved
        if saved != _class_names(optimizer):
            raise ValueError(
                f"optimizer: checkpoint {str(path)!r} holds the state of "
                f"{', '.join(saved or ['no optimizer'])}, not of "
                f"{', '.join(_class_names(optimizer))}; pass the same optimizer classes in "
                "the same order, or optimizer=None to load the model only"
            )
        check_optimizer_binding(model, optimizer)
        metadata = FileSystemReader(str(path)).read_metadata()
        state.update(_optimizer_target(model, optimizer, metadata, path))
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        apply_optimizer_state(model, optimizer, _unflatten_optimizer(state), owned=True)
    return {**record["extra"], "step": record["step"]}


def checkpoint_to_full_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as one plain full state dict (offline).

    Needs no process group and reads only the model's tensors. The result
    (parameters in their full module shapes, tensor-parallel ones gathered
    whatever their partition dim and stride, persistent buffers, tied names)
    loads with ``unwrapped_model.load_state_dict``; write it with
    :func:`save_full_state_dict`.

    Raises:
        ValueError: if ``path`` is not a complete checkpoint of the current format.
    """
    path = Path(path)
    record = _read_record(path)
    model = {
        fqn: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        for fqn, info in record["tensors"].items()
    }
    with _single_process():
        dcp.load({"model": model}, checkpoint_id=str(path), no_dist=True)
    for alias, fqn in record["aliases"].items():
        model[alias] = model[fqn]
    return model


def save_full_state_dict(
    state_dict: Mapping[str, torch.Tensor], file: str | os.PathLike[str]
) -> Path:
    """Write a full state dict with ``torch.save``, or as safetensors for a ``.safetensors`` file.

    Safetensors needs the optional ``safetensors`` package (not a dependency of
    mf-fsdp); tied entries are written as separate copies there.

    Raises:
        RuntimeError: for a ``.safetensors`` file when safetensors is not installed.
    """
    file = Path(file)
    if file.suffix != ".safetensors":
        torch.save(dict(state_dict), file)
        return file
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise RuntimeError(
            f"file: {str(file)!r} asks for safetensors, which is not installed; "
            "`pip install safetensors` or use a .pt file"
        ) from error
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
        tensors[fqn] = _tensor_info(value.shape, value.dtype)
        model[fqn] = value.detach().contiguous()
    record = _record(step, extra, {"tensors": tensors, "aliases": aliases}, optimizer=None)
    checkpoint_dir = Path(checkpoint_dir)
    partial = checkpoint_dir / f".{_step_name(step)}.partial"
    _fresh_dir(partial)
    with _single_process():
        dcp.save({"model": model}, checkpoint_id=str(partial), no_dist=True)
    final = checkpoint_dir / _step_name(step)
    _publish(partial, final, record)
    return final
