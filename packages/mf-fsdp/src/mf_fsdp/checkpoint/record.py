"""The JSON record of an mf checkpoint: what it holds, checked before anything is read.

A checkpoint folder's ``mf_checkpoint.json`` (``RECORD_FILE``, written last)
holds the format and version, the step and the caller's ``extra``, the
model's fingerprint (FQN, global shape and dtype of every tensor; tied
names), every non-tensor value of the optimizers' state dict (their classes,
param groups' options, non-tensor state such as SGD's ``None`` buffers), and
the size and SHA-256 of every data file. Non-tensor values go here as JSON
(``to_json``; tuples, non-finite floats and one-element tensors are tagged)
instead of being pickled into DCP's files, so loading a checkpoint never
unpickles anything but DCP's allow-listed metadata (see [Note: loading never
runs code] in ``checkpoint/safe_reader.py``).

``read_record`` checks every field and names the file and the field when
one is wrong. No communication.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "RECORD_FILE",
    "build_record",
    "compare_fingerprints",
    "from_json",
    "read_record",
    "tensor_info",
    "to_json",
]

RECORD_FILE = "mf_checkpoint.json"
"""Written last into a checkpoint folder: its presence means the checkpoint is complete."""

FORMAT = "mf-fsdp-dcp"
VERSION = 3
"""1: mf-fsdp 0.1's flat form, every tensor (numel,); 2: parameter-shaped, optimizer
options pickled into DCP; 3: parameter-shaped, every non-tensor value in this record,
file checksums."""

_TAG = "__mf__"


def tensor_info(shape: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    """The fingerprint entry of one tensor."""
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def to_json(value: Any, where: str) -> Any:
    """``value`` as JSON (tuples, non-finite floats and one-element tensors tagged).

    Raises:
        TypeError: naming ``where`` for a value JSON cannot hold (an object, a large
            tensor, a dict with non-string keys).
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "value": repr(value)}
    if isinstance(value, list):
        return [to_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": to_json(list(value), where)}
    if isinstance(value, torch.Tensor) and value.numel() == 1 and type(value) is torch.Tensor:
        scalar = value.detach().cpu()
        return {
            _TAG: "tensor",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "value": to_json(scalar.item(), where),
        }
    if isinstance(value, Mapping) and all(isinstance(k, str) and k != _TAG for k in value):
        return {k: to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be stored in a checkpoint (non-tensor "
        "values go into its JSON record: None, bool, int, float, str, lists, tuples, dicts "
        "with string keys and one-element tensors)"
    )


def from_json(value: Any, where: str = "value") -> Any:
    """The value ``to_json`` encoded.

    Raises:
        ValueError: naming ``where`` for a tag ``to_json`` never writes.
    """
    if isinstance(value, list):
        return [from_json(item, where) for item in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: from_json(v, where) for k, v in value.items()}
    if tag == "tuple" and isinstance(value.get("items"), list):
        return tuple(from_json(value["items"], where))
    if tag == "float" and value.get("value") in ("inf", "-inf", "nan"):
        return float(value["value"])
    if tag == "tensor" and isinstance(getattr(torch, str(value.get("dtype")), None), torch.dtype):
        dtype = getattr(torch, value["dtype"])
        return torch.tensor(from_json(value.get("value"), where), dtype=dtype).reshape(
            value.get("shape", [])
        )
    raise ValueError(f"{where}: unknown encoded value {value!r}")


def build_record(
    step: int,
    extra: Mapping[str, Any] | None,
    fingerprint: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The record of a checkpoint, without its ``files`` (added once they are written).

    Raises:
        ValueError: for a negative or non-int ``step``.
        TypeError: if ``extra`` is not JSON-serialisable.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra: expected a dict of JSON-serialisable values, got {extra!r}")
    record = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "extra": dict(extra or {}),
        "optimizer": optimizer,
        **fingerprint,
    }
    try:
        json.dumps(record, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"extra: expected JSON-serialisable values (finite numbers), got {extra!r}"
        ) from error
    return record


def _damaged(file: Path, what: str) -> ValueError:
    return ValueError(f"checkpoint record {str(file)!r} is damaged: {what}")


def _check_fields(file: Path, data: Mapping[str, Any]) -> None:
    """Raise naming the first field of a version-3 record that is missing or malformed."""
    expected: dict[str, type | tuple[type, ...]] = {
        "step": int,
        "extra": dict,
        "tensors": dict,
        "aliases": dict,
        "optimizer": (dict, type(None)),
        "files": dict,
    }
    for key, kind in expected.items():
        if key not in data:
            raise _damaged(file, f"no {key!r} field")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise _damaged(file, f"{key!r} is {data[key]!r}")
    for fqn, info in data["tensors"].items():
        shape, dtype = (info.get("shape"), info.get("dtype")) if isinstance(info, dict) else (0, 0)
        good_shape = isinstance(shape, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        )
        if not (good_shape and isinstance(getattr(torch, str(dtype), None), torch.dtype)):
            raise _damaged(file, f"tensors[{fqn!r}] is {info!r}")
    for name, entry in data["files"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
        ):
            raise _damaged(file, f"files[{name!r}] is {entry!r}")
    optimizer = data["optimizer"]
    if optimizer is not None and not (
        isinstance(optimizer.get("classes"), list)
        and isinstance(optimizer.get("param_groups"), list)
        and isinstance(optimizer.get("state"), dict)
    ):
        raise _damaged(file, f"'optimizer' is {optimizer!r}")


def read_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record of a complete checkpoint folder, every field checked (no communication).

    Raises:
        ValueError: if ``path`` is not a folder, is an incomplete (partial) checkpoint,
            its record is not an mf record of this version, or a field is malformed
            (naming the file and the field).
    """
    if path is None or not isinstance(path, str | os.PathLike):
        raise ValueError(f"path: expected a checkpoint folder (str or path), got {path!r}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"path: {str(path)!r} does not exist; expected a checkpoint folder")
    if not path.is_dir():
        raise ValueError(
            f"path: {str(path)!r} is a file, not a checkpoint folder (a folder step_NNNNNNN "
            f"holding {RECORD_FILE})"
        )
    file = path / RECORD_FILE
    if not file.is_file():
        raise ValueError(
            f"path: {str(path)!r} is an incomplete checkpoint (no {RECORD_FILE}; a save was "
            "interrupted); load a complete one, e.g. latest_checkpoint(checkpoint_dir)"
        )
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _damaged(file, f"not JSON ({error})") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"path: {str(path)!r} is not an mf_fsdp checkpoint ({RECORD_FILE})")
    if data.get("version") != VERSION:
        raise ValueError(
            f"path: {str(path)!r} is an mf_fsdp checkpoint of format version "
            f"{data.get('version')!r} (1: the flat form of mf-fsdp 0.1; 2: optimizer options "
            f"pickled into DCP, which loading would have to unpickle); this mf-fsdp reads "
            f"version {VERSION} only"
        )
    _check_fields(file, data)
    return data


def compare_fingerprints(path: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
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
            f"{_first(missing)}, unexpected keys {_first(unexpected)}, mismatched: "
            f"{'; '.join(differ[:_SHOWN]) or '-'}{_more(differ)}"
        )


_SHOWN = 5
"""Differences listed per kind; a model of another size differs in every tensor."""


def _more(items: Sequence[str]) -> str:
    return f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""


def _first(names: Sequence[str]) -> str:
    """``names`` as a list, cut to its first ``_SHOWN`` with a count of the rest."""
    return f"{names[:_SHOWN]!r}{_more(names)}"


def _describe(info: Mapping[str, Any]) -> str:
    return f"{tuple(info['shape'])} {info['dtype']}"
