"""Each rank reads its own rows of a transformers folder's safetensors weights.

The model is wrapped on the meta device (mf-fsdp's FSDP2 flow: the engine gives
every rank storage for its rows only), then this module fills that storage:
for each tensor of the wrapped model's state dict, the rank's boxes of it (the
whole rows ``mf_dtensor.UnevenDTensor.local_boxes`` names) are read from the
file with positioned reads straight into that storage: those bytes and no
others, and no memory map whose touched pages would hold a second copy while
loading. No rank ever holds a whole weight, let alone the model (under ZeRO-3;
ZeRO 1 and 2 keep full compute weights on every rank, ZeRO-0 full main weights
too). The next forward installs the weights into the compute buffers.

A weight the files lack, or hold in another shape, stops the load with one
line naming the folder, the tensor and the file: a model left half random
would train silently wrong.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["load_folder_weights", "tensor_files", "write_rows"]

INDEX_FILE = "model.safetensors.index.json"


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name in the folder's safetensors files, with the file that holds it.

    The index file when there is one (sharded checkpoints), else each file's header.
    """
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    found: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            found.update(dict.fromkeys(handle.keys(), file))
    return found


def _boxes(
    value: torch.Tensor,
) -> tuple[torch.Tensor, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The local tensor to write and, per box, (offsets, sizes) in the global tensor.

    An ``UnevenDTensor`` (ZeRO 1-3): its local tensor stacks its boxes along dim 0.
    A ``DTensor`` (an all-gather-extension weight: float8's under ZeRO-3): its
    unpadded piece of dim 0. A plain tensor (ZeRO-0): the whole tensor is one box.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from mf_dtensor import UnevenDTensor

    if isinstance(value, UnevenDTensor):
        boxes = [(tuple(b.offsets), tuple(b.sizes)) for b in value.local_boxes()]
        return value._local_tensor, boxes
    if isinstance(value, DTensor):  # a parameter sharded as FSDP2 shards it (torch.chunk)
        sizes, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return _plain(value._local_tensor), [(tuple(offsets), tuple(sizes))]
    return value, [((0,) * value.ndim, tuple(value.shape))]


def _plain(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``value``'s elements: itself, or the one a wrapper holds.

    torchao's float8 training (``--precision fp8``) wraps each converted weight
    in a subclass around the high-precision tensor (its one inner tensor), which
    mf-fsdp shards as FSDP2 does (its all-gather extension): the rows are written
    into that inner tensor, the only copy of the weight's values.
    """
    while type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        inner, _ = value.__tensor_flatten__()
        if len(inner) != 1:
            raise TypeError(f"cannot write rows into a {type(value).__name__}")
        value = getattr(value, inner[0])
    return value


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names of the tensors a model folder holds."""


class _SafetensorsFile:
    """One safetensors file read by positioned reads: its header, then the bytes asked for.

    Not memory-mapped: the pages of a mapped file that a rank touches count in its
    resident memory until the file is closed, about its whole share again while
    it loads. A positioned read goes from the page cache straight into the
    destination, so a rank's memory holds its rows once.
    """

    def __init__(self, path: Path, handle: BinaryIO) -> None:
        self.path = path
        self._handle = handle
        size = struct.unpack("<Q", handle.read(8))[0]
        self._header: dict[str, Any] = json.loads(handle.read(size))
        self._data_start = 8 + size

    def entry(self, name: str) -> tuple[torch.dtype | None, tuple[int, ...], int]:
        """A tensor's dtype (None: one mf does not read this way), shape and first byte."""
        entry = self._header[name]
        begin = self._data_start + int(entry["data_offsets"][0])
        return _DTYPES.get(entry["dtype"]), tuple(entry["shape"]), begin

    def read_rows(self, name: str, first: int, out: torch.Tensor) -> None:
        """Rows ``first`` to ``first + len(out)`` of tensor ``name`` into ``out`` (contiguous)."""
        _, shape, begin = self.entry(name)
        row_bytes = math.prod(shape[1:]) * out.element_size() if shape else out.element_size()
        flat = out.reshape(-1).view(torch.uint8)
        view = memoryview(flat.numpy().data) if out.numel() else memoryview(b"")
        done, offset = 0, begin + first * row_bytes
        while done < len(view):
            read = os.preadv(self._handle.fileno(), [view[done:]], offset + done)
            if read <= 0:
                raise ValueError(f"--model: {self.path} ends inside tensor {name!r}")
            done += read


@contextlib.contextmanager
def _open_files() -> Iterator[Callable[[Path], _SafetensorsFile]]:
    """A function from a file to its open ``_SafetensorsFile``, each file opened once."""
    files: dict[Path, _SafetensorsFile] = {}
    with contextlib.ExitStack() as stack:

        def opened(path: Path) -> _SafetensorsFile:
            if path not in files:
                files[path] = _SafetensorsFile(path, stack.enter_context(open(path, "rb")))
            return files[path]

        yield opened


def _read_box(
    file: _SafetensorsFile,
    name: str,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    target: torch.Tensor,
) -> None:
    """Write the box (whole rows, or a whole 0-d tensor) of ``name`` into ``target``.

    Read straight into ``target`` when it is contiguous and of the file's dtype,
    else into a buffer of the box's size, then converted (bf16 files into fp32
    main weights).
    """
    dtype, shape, _ = file.entry(name)
    whole_rows = all(
        o == 0 and s == d for o, s, d in zip(offsets[1:], sizes[1:], shape[1:], strict=True)
    )
    if dtype is None or not whole_rows:
        from safetensors import safe_open  # not whole rows: safetensors' own slicing

        with safe_open(file.path, "pt") as handle:
            piece = handle.get_slice(name)
            cut = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            target.copy_(piece[cut] if cut else handle.get_tensor(name))
        return
    if target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu":
        file.read_rows(name, offsets[0] if offsets else 0, target)
        return
    buffer = torch.empty(target.shape, dtype=dtype)
    file.read_rows(name, offsets[0] if offsets else 0, buffer)
    target.copy_(buffer)


def write_rows(
    value: torch.Tensor, fill: Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], None]
) -> None:
    """Write this rank's rows of the sharded (or plain) ``value``, a box at a time.

    ``fill(offsets, sizes, target)`` writes the box of the global tensor at
    ``offsets`` of ``sizes`` (both empty for a scalar) into ``target``, the view of
    this rank's local piece that holds it.
    """
    local, boxes = _boxes(value)
    row = 0
    for offsets, sizes in boxes:
        if sizes and sizes[0] == 0:
            continue
        target = local.narrow(0, row, sizes[0]) if sizes else local
        fill(offsets, sizes, target)
        row += sizes[0] if sizes else 0


def load_folder_weights(
    model: Any,
    folder: Path,
    prefix: str,
    file_name: Callable[[str], str | None] = lambda key: key,
) -> None:
    """Fill the wrapped ``model``'s weights (this rank's rows) from ``folder``'s files.

    ``prefix``: what the wrapped module's keys add before the file's names. A tied
    weight is read under whichever of its names the files hold. ``file_name``: the
    file's name of a key (prefix removed), None for a weight the files do not
    hold (LoRA's adapters), left to the caller.

    Raises:
        ValueError: a weight the files lack or hold in another shape (one line).
    """
    from mf_fsdp.checkpoint import get_model_state_dict
    from mf_fsdp.checkpoint.state_dict import alias_names

    files = tensor_files(folder)
    names_of: dict[str, list[str]] = {}
    for alias, canonical in alias_names(model).items():
        names_of.setdefault(canonical, []).append(alias)
    with _open_files() as opened, torch.no_grad():
        for key, value in get_model_state_dict(model).items():
            if file_name(key.removeprefix(prefix)) is None:
                continue
            keys = (key, *names_of.get(key, []))
            candidates = [str(file_name(n.removeprefix(prefix))) for n in keys]
            name = next((n for n in candidates if n in files), None)
            if name is None:
                raise ValueError(
                    f"--model {str(folder)!r}: its safetensors files hold no {candidates[0]!r}, "
                    "which the model built from its config.json has; expected every weight "
                    "under transformers' names"
                )
            file = opened(files[name])
            shape = file.entry(name)[1]
            if shape != tuple(value.shape):
                raise ValueError(
                    f"--model {str(folder)!r}: {files[name].name} holds {name!r} of shape "
                    f"{shape}, the model built from its config.json expects {tuple(value.shape)}"
                )
            write_rows(value, functools.partial(_read_box, file, name))
