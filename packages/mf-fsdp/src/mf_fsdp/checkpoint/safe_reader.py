"""Read torch.distributed.checkpoint (DCP) folders without running code from them.

[Note: loading never runs code]
DCP stores its ``.metadata`` file as a pickle, and ``pickle.load`` calls
whatever the file names: a checkpoint someone sends you could run anything
when it is loaded. ``SafeFileSystemReader`` reads that file with an
unpickler that resolves only an allow-list (``ALLOWED_GLOBALS``: DCP's own
metadata classes, ``torch.Size``, torch dtypes and layouts, ``pathlib``
paths) and refuses anything else, naming the file and the global. The
tensor data itself DCP reads with ``torch.load(weights_only=True)``; mf's
checkpoints hold tensors only (every other value is in the JSON record), and
a checkpoint with a pickled object (DCP's ``BytesStorageMetadata``) is
refused before it is read (``refuse_pickled_items``). A data file that holds
pickled code anyway is refused by name when it is read.

[Note: a checkpoint reads only its own folder]
DCP's metadata names each data file by a path relative to the folder, and
its reader opens whatever that path reaches: ``../../x`` or an absolute
path would put the bytes of any file the user can read into the weights.
``read_metadata`` accepts only bare file names that are regular files of the
folder itself (no symlink, no sub-folder), so every loader refuses anything
else before a byte of data is read; ``load_checkpoint`` further requires each
to be listed, with its checksum, in the record.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = [
    "ALLOWED_GLOBALS",
    "SafeFileSystemReader",
    "data_file_names",
    "read_every_tensor",
    "read_metadata",
    "refuse_pickled_items",
]

METADATA_FILE = ".metadata"
"""DCP's metadata file in a checkpoint folder."""

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to the layout
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)
"""``(module, name)`` of every global a DCP metadata file may name, besides torch dtypes."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``ALLOWED_GLOBALS`` and torch dtypes."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ValueError(
            f"checkpoint file {str(self._path)!r} names the global {module}.{name}, which a "
            "DCP metadata file never needs; refusing to load it (loading it could run code "
            "from the checkpoint)"
        )


def read_metadata(path: str | os.PathLike[str], rank: int | None = None) -> Metadata:
    """The DCP metadata of the checkpoint folder ``path``, read without running its code.

    Raises:
        ValueError: if the file is missing, is not DCP metadata, or names a global
            outside the allow-list.
    """
    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    file = Path(path) / name
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream, file).load()
    except FileNotFoundError as error:
        raise ValueError(
            f"path: {str(path)!r} has no {name} (DCP's metadata, written last by a save): "
            "the checkpoint is incomplete or damaged"
        ) from error
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as error:
        raise ValueError(
            f"checkpoint file {str(file)!r} is not readable DCP metadata ({error}); the "
            "checkpoint is damaged"
        ) from error
    if not isinstance(metadata, Metadata):
        raise ValueError(
            f"checkpoint file {str(file)!r} holds a {type(metadata).__name__}, not DCP "
            "metadata; the checkpoint is damaged"
        )
    for name in data_file_names(metadata):
        _refuse_outside(Path(path), name)
    return metadata


def data_file_names(metadata: Metadata) -> set[str]:
    """The data files DCP's ``metadata`` reads from, as it names them."""
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    return {str(getattr(info, "relative_path", info)) for info in storage.values()}


def _refuse_outside(folder: Path, name: str) -> None:
    """Raise unless ``name`` is a regular file directly inside ``folder``.

    See [Note: a checkpoint reads only its own folder].
    """
    if name in ("", ".", "..") or Path(name).name != name or os.sep in name or "/" in name:
        reason = "is not a file name inside the checkpoint's folder"
    else:
        try:
            mode = (folder / name).lstat().st_mode
        except OSError:
            return  # a missing file: the record's check names it, or DCP's read fails on it
        if stat.S_ISLNK(mode):
            reason = "is a symbolic link"
        elif not stat.S_ISREG(mode):
            reason = "is not a regular file"
        else:
            return
    raise ValueError(
        f"checkpoint {str(folder)!r}: its DCP metadata names the data file {name!r}, which "
        f"{reason}; a checkpoint reads only regular files of its own folder, refusing to load it"
    )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, reading the metadata through ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata (see ``read_metadata``), stamped with this reader's load id."""
        metadata = read_metadata(self.path, kwargs.get("rank"))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one data file at a time, so a refused file is named."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as error:
                raise ValueError(
                    f"checkpoint file {str(Path(self.path) / name)!r} holds pickled objects "
                    "where tensors belong, which loading could run as code; refusing it "
                    f"({str(error).splitlines()[0]})"
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def refuse_pickled_items(metadata: Metadata, keys: Iterable[str], path: Path) -> None:
    """Raise if any of ``keys`` is stored as a pickled object rather than a tensor.

    Raises:
        ValueError: naming the first such key.
    """
    for key in keys:
        if isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
            raise ValueError(
                f"checkpoint {str(path)!r} stores {key!r} as a pickled object; mf checkpoints "
                "hold tensors only (other values are in the JSON record), and loading it could "
                "run code from the checkpoint"
            )


class _DiscardingPlanner:
    """The planner side of ``read_data`` for a read that keeps nothing.

    Each tensor gets a fresh buffer of its chunk's size, dropped once filled, so a
    whole checkpoint is read with one chunk in memory at a time.
    """

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        entry = self._metadata.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(entry, TensorStorageMetadata)  # only tensors are resolved to tensors
        properties = entry.properties
        return torch.empty(tuple(item.lengths), dtype=properties.dtype)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Drop the tensor: reading it was the point."""


def read_every_tensor(path: str | os.PathLike[str], metadata: Metadata) -> None:
    """Read every tensor chunk that ``metadata`` lists once, through the safe reader.

    Nothing is kept (one chunk is in memory at a time). This proves, without a
    process group or a model, that every item decodes as tensors only: a data file
    holding pickled code is refused naming the file, as a load would refuse it,
    but before any process depends on the checkpoint. Pass metadata from
    ``read_metadata`` (which refused paths outside the folder) after
    ``refuse_pickled_items``.

    Raises:
        ValueError: naming the data file that holds pickled objects or does not decode.
    """
    per_file: dict[str, list[ReadItem]] = {}
    for item in _every_chunk(metadata):
        name = metadata.storage_data[item.storage_index].relative_path
        per_file.setdefault(name, []).append(item)
    reader = SafeFileSystemReader(str(path))
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    planner: Any = _DiscardingPlanner(metadata)
    for name, items in sorted(per_file.items()):
        try:
            reader.read_data(LoadPlan(items), planner).wait()
        except (RuntimeError, EOFError, OSError, AssertionError) as error:
            cause = (str(error).splitlines() or [type(error).__name__])[0]
            raise ValueError(
                f"checkpoint file {str(Path(path) / name)!r} does not hold the tensors its "
                f"DCP metadata names ({type(error).__name__}: {cause}); the checkpoint is damaged"
            ) from None


def _every_chunk(metadata: Metadata) -> list[ReadItem]:
    """A read of every stored tensor chunk, whole, as DCP's planner would ask for it."""
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=index,
            dest_offsets=torch.Size([0] * len(chunk.sizes)),
            storage_index=index,
            storage_offsets=torch.Size([0] * len(chunk.sizes)),
            lengths=chunk.sizes,
        )
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
        for position, chunk in enumerate(entry.chunks)
        for index in [MetadataIndex(key, chunk.offsets, position)]
    ]
