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
refused before it is read (``refuse_pickled_items``).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

__all__ = ["ALLOWED_GLOBALS", "SafeFileSystemReader", "read_metadata", "refuse_pickled_items"]

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
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, reading the metadata through ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata (see ``read_metadata``), stamped with this reader's load id."""
        metadata = read_metadata(self.path, kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
