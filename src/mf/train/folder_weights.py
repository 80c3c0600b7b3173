"""Each rank reads its own rows of a transformers folder's safetensors weights.

The model is wrapped on the meta device (mf-fsdp's FSDP2 flow: the engine gives
every rank storage for its rows only), then this module fills that storage:
for each tensor of the wrapped model's state dict, the rank's boxes of it (the
whole rows ``mf_dtensor.UnevenDTensor.local_boxes`` names) are read with
``safetensors.safe_open(...).get_slice``, which reads those bytes and no
others. No rank ever holds a whole weight, let alone the model (under ZeRO-3;
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
    A plain tensor (ZeRO-0): the whole tensor is one box.
    """
    from mf_dtensor import UnevenDTensor

    if isinstance(value, UnevenDTensor):
        boxes = [(tuple(b.offsets), tuple(b.sizes)) for b in value.local_boxes()]
        return value._local_tensor, boxes
    return value, [((0,) * value.ndim, tuple(value.shape))]


@contextlib.contextmanager
def _open_files() -> Iterator[Callable[[Path], Any]]:
    """A function from a file to its open ``safe_open`` handle, each file opened once."""
    from safetensors import safe_open

    handles: dict[Path, Any] = {}
    with contextlib.ExitStack() as stack:

        def opened(file: Path) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, "pt"))
            return handles[file]

        yield opened


def write_rows(value: torch.Tensor, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> None:
    """Write this rank's rows of the sharded (or plain) ``value``; ``read(cut)`` gives them.

    ``cut`` is one box of the global tensor, a slice per dim (empty for a scalar).
    """
    local, boxes = _boxes(value)
    row = 0
    for offsets, sizes in boxes:
        if sizes and sizes[0] == 0:
            continue
        cut = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        target = local.narrow(0, row, sizes[0]) if sizes else local
        target.copy_(read(cut))
        row += sizes[0] if sizes else 0


def _rows(piece: Any, whole: Callable[[], torch.Tensor], cut: tuple[slice, ...]) -> torch.Tensor:
    """A file tensor's rows ``cut`` (a scalar has no cut: read whole)."""
    return piece[cut] if cut else whole()


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
            piece = opened(files[name]).get_slice(name)
            shape = tuple(piece.get_shape())
            if shape != tuple(value.shape):
                raise ValueError(
                    f"--model {str(folder)!r}: {files[name].name} holds {name!r} of shape "
                    f"{shape}, the model built from its config.json expects {tuple(value.shape)}"
                )
            whole = functools.partial(opened(files[name]).get_tensor, name)
            write_rows(value, functools.partial(_rows, piece, whole))
