"""Damaged and hostile checkpoint folders, made as a careless or hostile author would.

Shared by the mf_fsdp trust tests and mf-train's ``--resume`` tests. A hostile
author keeps the record consistent (``rewrite_checksum``), so only the checks
that do not trust the record catch the file. Every payload, when unpickled,
creates a marker file: a test that finds no marker knows no code ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import torch

import mf_fsdp

__all__ = [
    "METADATA",
    "Payload",
    "outside_copies",
    "plant_payload",
    "plant_pickled_data",
    "redirect_data",
    "rewrite_checksum",
]

METADATA = ".metadata"


class Payload:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def rewrite_checksum(path: Path, name: str) -> None:
    """Update the record's checksum of ``name``, as the author of a hostile file would."""
    record_file = path / mf_fsdp.RECORD_FILE
    record = json.loads(record_file.read_text())
    data = (path / name).read_bytes()
    record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    record_file.write_text(json.dumps(record))


def plant_payload(path: Path, marker: Path) -> None:
    """Replace the DCP metadata by a pickle of the real metadata plus a payload."""
    real = pickle.loads((path / METADATA).read_bytes())
    (path / METADATA).write_bytes(pickle.dumps((Payload(str(marker)), real)))
    rewrite_checksum(path, METADATA)


def redirect_data(path: Path, to: str) -> None:
    """Make ``.metadata`` name ``to`` for every data item (checksum updated, as an author would)."""
    metadata = pickle.loads((path / METADATA).read_bytes())
    for key, info in metadata.storage_data.items():
        metadata.storage_data[key] = dataclasses.replace(info, relative_path=to)
    (path / METADATA).write_bytes(pickle.dumps(metadata))
    rewrite_checksum(path, METADATA)


def outside_copies(path: Path, outside: Path) -> dict[str, Path]:
    """A copy of each data file in ``outside``: bytes DCP would read happily if pointed there."""
    outside.mkdir(exist_ok=True)
    copies = {}
    for data in sorted(path.glob("*.distcp")):
        copies[data.name] = outside / data.name
        shutil.copyfile(data, copies[data.name])
    return copies


def plant_pickled_data(path: Path, marker: Path, key_prefix: str = "") -> str:
    """Make the items under ``key_prefix`` of the last data file a pickled payload.

    The payload (``torch.save`` of a ``Payload``) is appended to the file and the
    metadata of those items points at it; checksums are rewritten. Returns the
    data file's name.
    """
    payload = io.BytesIO()
    torch.save(Payload(str(marker)), payload)
    data = sorted(path.glob("*.distcp"))[-1]
    offset = data.stat().st_size
    with open(data, "ab") as out:
        out.write(payload.getvalue())
    metadata = pickle.loads((path / METADATA).read_bytes())
    for key, info in metadata.storage_data.items():
        if info.relative_path == data.name and key.fqn.startswith(key_prefix):
            metadata.storage_data[key] = dataclasses.replace(
                info, offset=offset, length=len(payload.getvalue())
            )
    (path / METADATA).write_bytes(pickle.dumps(metadata))
    rewrite_checksum(path, METADATA)
    rewrite_checksum(path, data.name)
    return data.name
