"""Checksums of a checkpoint's data files: computed at save, verified at load.

[Note: checkpoint integrity]
DCP has no checksums: a flipped byte in a ``.distcp`` file loads as a wrong
weight. After DCP has written every file, the save hashes each data file
(SHA-256, about 1 GB/s per core) and the record, written last, lists every
file with its size and digest. Loading (and the offline converters) hash the
files again and refuse a checkpoint whose files differ, are missing or are
extra, naming them. Both sides split the files over the ranks (each rank
hashes every world-th file) and exchange the results, so every rank raises
the same error and no rank waits for another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["FileDigest", "data_files", "digest_folder", "find_damage"]

FileDigest = dict[str, Any]
"""``{"bytes": int, "sha256": str}`` of one file."""


def data_files(folder: Path, record_file: str) -> list[str]:
    """The names of every file of a checkpoint folder but its record, sorted."""
    return sorted(
        p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(record_file)
    )


def _digest(file: Path) -> FileDigest:
    with open(file, "rb") as stream:
        digest = hashlib.file_digest(stream, "sha256").hexdigest()
    return {"bytes": file.stat().st_size, "sha256": digest}


def _spread(collective: bool, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's index and the number of processes sharing the hashing."""
    if collective and dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def digest_folder(
    folder: Path,
    names: list[str],
    collective: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, FileDigest | str]:
    """Size and SHA-256 of each file in ``names``, or why it could not be read.

    With ``collective`` and a process group initialized, every rank of ``group``
    (default: the world) passes the same names, hashes its share and gets every
    result; else local.
    """
    rank, world = _spread(collective, group)
    mine: dict[str, FileDigest | str] = {}
    for name in names[rank::world]:
        try:
            mine[name] = _digest(folder / name)
        except OSError as error:
            mine[name] = f"{type(error).__name__}: {error.strerror or error}"
    if world == 1:
        return mine
    everyone: list[dict[str, FileDigest | str] | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return {name: value for part in everyone if part for name, value in part.items()}


def find_damage(
    folder: Path, expected: Mapping[str, FileDigest], record_file: str, collective: bool = True
) -> list[str]:
    """Every way the data files of ``folder`` differ from ``expected`` (empty when intact).

    Collective as ``digest_folder`` is.
    """
    present = data_files(folder, record_file)
    problems = [f"{name}: missing" for name in expected if name not in present]
    problems += [f"{name}: not part of the checkpoint" for name in present if name not in expected]
    found = digest_folder(folder, [name for name in present if name in expected], collective)
    for name, value in found.items():
        want = expected[name]
        if isinstance(value, str):
            problems.append(f"{name}: unreadable ({value})")
        elif value["bytes"] != want["bytes"]:
            problems.append(f"{name}: {value['bytes']} bytes, expected {want['bytes']}")
        elif value["sha256"] != want["sha256"]:
            problems.append(f"{name}: contents differ from the checksum saved with it")
    return sorted(problems)
