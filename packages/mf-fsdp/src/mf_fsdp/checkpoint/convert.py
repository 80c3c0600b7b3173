"""Offline conversion between mf checkpoints and plain full state dicts.

``checkpoint_to_full_state_dict`` reads a checkpoint's model weights into one
plain state dict, ``save_full_state_dict`` writes such a dict as safetensors,
and ``full_state_dict_to_checkpoint`` turns one into a complete mf checkpoint
that ``load_checkpoint`` loads at any strategy and world size.

Each runs on one process and needs no process group. Reading never runs code
from the checkpoint and verifies its files first, as loading does; writing
publishes the folder as a save does ([Note: crash-safe save]), so a failure
leaves no partial folder. This module neither wraps a model nor communicates.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mf_fsdp.checkpoint.integrity import FileDigest, data_files, digest_folder
from mf_fsdp.checkpoint.load import read_tensors
from mf_fsdp.checkpoint.record import RECORD_FILE, build_record, read_record, tensor_info
from mf_fsdp.checkpoint.save import failure_cause, fresh_dir, publish, step_name
from mf_fsdp.checkpoint.verify import checked_metadata, single_process, verify_files

__all__ = [
    "checkpoint_to_full_state_dict",
    "full_state_dict_to_checkpoint",
    "save_full_state_dict",
]


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
    checked_metadata(path, record)
    if verify:
        verify_files(path, record, "checkpoint_to_full_state_dict", collective=False)
    model = {
        fqn: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        for fqn, info in record["tensors"].items()
    }
    with single_process():
        read_tensors({"model": model}, path, "checkpoint_to_full_state_dict", no_dist=True)
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
    partial = checkpoint_dir / f".{step_name(step)}.partial"
    final = checkpoint_dir / step_name(step)
    try:
        fresh_dir(partial)
        with single_process():
            dcp.save({"model": model}, checkpoint_id=str(partial), no_dist=True)
        digests: dict[str, FileDigest | str] = digest_folder(
            partial, data_files(partial, RECORD_FILE), collective=False
        )
        record["files"] = digests
        publish(partial, final, record)
    except (CheckpointException, OSError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(
            f"full_state_dict_to_checkpoint: {failure_cause(error, partial)}; nothing was saved"
        ) from None
    return final
