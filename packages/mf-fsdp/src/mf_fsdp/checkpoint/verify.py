"""The checks a checkpoint passes before any tensor is read from it, and ``verify_checkpoint``.

``verify_checkpoint`` checks a checkpoint as ``load_checkpoint`` would, offline
and loading nothing, so a launcher can refuse a damaged, hostile or foreign
checkpoint before it starts any process. The checks the loader and the offline
converter share with it live here too: the optimizer classes the record names,
DCP's metadata read safely and covered by the record's checksums, and every
data file against its checksum ([Note: checkpoint integrity]).

A checkpoint that fails a check raises ``ValueError`` naming the folder and the
file or field at fault; no check runs code from the checkpoint. Only
``verify_files`` with ``collective=True`` communicates (the ranks share the
hashing); ``single_process`` marks the offline reads that need no process group.
This module never loads into a model or optimizer and never writes a file.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from mf_fsdp.checkpoint.integrity import find_damage
from mf_fsdp.checkpoint.record import RECORD_FILE, compare_fingerprints, read_record, tensor_info
from mf_fsdp.checkpoint.safe_reader import (
    data_file_names,
    read_every_tensor,
    read_metadata,
    refuse_pickled_items,
)
from mf_fsdp.checkpoint.save import class_names
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP
from mf_fsdp.optim.optimizer import Optimizers

__all__ = [
    "check_optimizer_classes",
    "checked_metadata",
    "single_process",
    "verify_checkpoint",
    "verify_files",
]


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Silence DCP's warning that ``no_dist=True`` means a single process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def verify_files(
    path: Path, record: Mapping[str, Any], caller: str, collective: bool = True
) -> None:
    """Raise on every rank if a data file differs from the record (see ``find_damage``)."""
    problems = find_damage(path, record["files"], RECORD_FILE, collective)
    if problems:
        skip = "" if caller == "verify_checkpoint" else " (verify=False skips this check)"
        raise ValueError(
            f"{caller}: checkpoint {str(path)!r} is damaged: {'; '.join(problems)}; refusing "
            f"to load it{skip}"
        )


def check_optimizer_classes(path: Path, record: Mapping[str, Any], optimizer: Optimizers) -> None:
    """Raise unless the checkpoint holds the state of ``optimizer``'s classes, in order."""
    saved = record["optimizer"]["classes"] if record["optimizer"] else []
    if saved != class_names(optimizer):
        raise ValueError(
            f"optimizer: checkpoint {str(path)!r} holds the state of "
            f"{', '.join(saved or ['no optimizer'])}, not of "
            f"{', '.join(class_names(optimizer))}; pass the same optimizer classes in "
            "the same order, or optimizer=None to load the model only"
        )


def checked_metadata(path: Path, record: Mapping[str, Any]) -> Metadata:
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
        check_optimizer_classes(path, record, optimizer)
    metadata = checked_metadata(path, record)
    verify_files(path, record, "verify_checkpoint", collective=False)
    try:
        with single_process():
            read_every_tensor(path, metadata)
    except ValueError as error:
        raise ValueError(f"verify_checkpoint: {error}") from None
    return {**record["extra"], "step": record["step"]}
