"""Loading a checkpoint folder into a ``MegatronFSDP`` model and its optimizers.

``load_checkpoint`` reads what ``checkpoint/save.py`` wrote into a wrapped model
of any ZeRO strategy, data-parallel world size, HSDP layout and tp size, and
into a fresh optimizer (its state tensors are built from DCP's metadata);
``latest_checkpoint`` finds the newest complete checkpoint of a folder.

Loading never runs code from the checkpoint (see [Note: loading never runs
code] in ``checkpoint/safe_reader.py``) and verifies every file against the
record first (see [Note: checkpoint integrity]; ``verify=False`` skips that
for a trusted local resume). Checkpoints of older formats are refused with one
error naming the format. Loading checks the record before any collective, on
every rank alike, so a partial or damaged checkpoint or one of another model
raises the same ``ValueError`` everywhere and no rank is left waiting.

This module reads only: it never writes or removes a file, and the checks it
shares with ``verify_checkpoint`` live in ``checkpoint/verify.py``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mf_fsdp.checkpoint.background import wait_for_pending_save
from mf_fsdp.checkpoint.record import RECORD_FILE, compare_fingerprints, from_json, read_record
from mf_fsdp.checkpoint.safe_reader import SafeFileSystemReader
from mf_fsdp.checkpoint.save import STEP_DIR, failure_cause, model_fingerprint
from mf_fsdp.checkpoint.state_dict import (
    apply_optimizer_state,
    check_optimizer_binding,
    get_model_state_dict,
    set_model_state_dict,
)
from mf_fsdp.checkpoint.verify import check_optimizer_classes, checked_metadata, verify_files
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP
from mf_fsdp.optim.optimizer import Optimizers, optimizer_list

__all__ = ["latest_checkpoint", "load_checkpoint", "read_tensors"]

_OPTIMIZER_PREFIX = "optimizer.state."


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
        if (match := STEP_DIR.fullmatch(path.name)) and (path / RECORD_FILE).is_file()
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


def read_tensors(state: dict[str, Any], path: Path, caller: str, **kwargs: Any) -> None:
    """``dcp.load`` through the safe reader; a read failure raises one line naming its cause."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), **kwargs)
    except CheckpointException as error:
        refused = [exc for exc, _ in error.failures.values() if isinstance(exc, ValueError)]
        if refused:  # the safe reader refused a file: its one line says which and why
            raise ValueError(f"{caller}: {refused[0]}") from None
        cause = failure_cause(error, path).replace("while writing", "while reading")
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
    fingerprint = model_fingerprint(model)
    compare_fingerprints(path, record, fingerprint)
    if optimizer is not None:
        check_optimizer_classes(path, record, optimizer)
        check_optimizer_binding(model, optimizer)
    metadata = checked_metadata(path, record)
    if verify:
        verify_files(path, record, "load_checkpoint")
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state.update(_optimizer_target(model, optimizer, metadata, path, fingerprint["tensors"]))
    read_tensors(state, path, "load_checkpoint")
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        local = {fp.fqn for fp in model.fsdp_params}
        loaded = _optimizer_state(state, record["optimizer"], local)
        apply_optimizer_state(model, optimizer, loaded, owned=True)
    return {**record["extra"], "step": record["step"]}
