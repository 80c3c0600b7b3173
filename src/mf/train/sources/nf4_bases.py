"""``mf-train --base-dtype nf4`` (QLoRA): LoRA's frozen bases as torchao NF4 tensors, per rank.

Which weights: the ``base_layer.weight`` of every projection peft wrapped
(``--lora-targets``); embeddings, norms, the output head and any bias stay as
they are. Each becomes a torchao ``NF4Tensor`` quantized from the file's
weight cast to bf16, which mf-fsdp shards and gathers through FSDP2's
extension protocol (``mf_fsdp.buckets.extension``): ``torch.chunk`` pieces of
dim 0, gathered as packed 4-bit data and int8 block scalers.

[Note: NF4 quantized per rank]
torchao's NF4 (``to_nf4``, block 64, scaler block 256) keeps one absmax per
64 elements (``quantized_data`` depends on it alone), then quantizes those
absmaxes again: it subtracts their mean over the WHOLE tensor
(``scaler_mean``), and scales each run of 256 of them by its own factor to
int8. ``fsdp_post_all_gather`` concatenates the ranks' ``quantized_data``,
``quantized_scalers`` and ``quantization_factor`` and keeps one rank's
``scaler_mean``. So a rank can quantize its own rows alone only if (a) its
piece starts and ends on a scaler block (64 x 256 = 16384 elements; else
the ranks' factor lists do not line up) and (b) it subtracts the global mean,
not its own: a local mean would dequantize every other rank's rows off by the
difference of the means after the gather, a silent wrong result. Here each
rank computes its rows' absmaxes, the ranks sum a vector of all of them (each
entry written by one rank, the others zero: the sum is exact) and each takes
its mean exactly as torchao does, so every rank's shard equals the matching
piece of ``to_nf4(whole weight)`` bit for bit (tests/train/adapters/
test_qlora.py). (a) is checked from ``config.json`` before any process
starts (``nf4_shape_problem``).

The NF4 parameters are made on the meta device with the model, before
wrapping; ``to_empty`` gives their shards storage, and ``load_nf4_bases``
fills them from the folder's files, each rank reading only its rows. They are
left out of the model's state dict (``leave_out_of_state_dict``): checkpoints
hold the adapters, and a resume quantizes the bases from the files again.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "NF4_SPAN",
    "dequantize_targets",
    "leave_out_of_state_dict",
    "load_nf4_bases",
    "make_bases_nf4",
    "nf4_parameters",
    "nf4_shape_problem",
    "quantize_rows",
]

NF4_BLOCK = 64
"""Elements per absmax block of torchao's ``to_nf4`` (its default ``block_size``)."""

NF4_SCALER_BLOCK = 256
"""Absmax blocks per int8 scaler block (``to_nf4``'s default ``scaler_block_size``)."""

NF4_SPAN = NF4_BLOCK * NF4_SCALER_BLOCK
"""Elements one scaler block covers: a rank's piece must start and end on a multiple."""

BASE_DTYPE = torch.bfloat16
"""The dtype the bases are quantized from (the file's weight is cast to it), as QLoRA does."""


def nf4_shape_problem(name: str, shape: tuple[int, ...], shards: int) -> str | None:
    """Why the weight ``name`` of ``shape`` cannot be NF4 over ``shards`` ranks, or None.

    Every rank's ``torch.chunk`` piece of dim 0 must be whole scaler blocks
    (``NF4_SPAN`` elements) and the pieces equal (an NF4 piece cannot be padded).
    """
    if len(shape) != 2:
        return f"{name} has shape {shape}; NF4 bases are 2-D weights"
    rows, columns = shape
    piece = math.ceil(rows / shards)
    if rows * columns % NF4_SPAN == 0 and rows % shards == 0 and piece * columns % NF4_SPAN == 0:
        return None
    return (
        f"{name} of shape {tuple(shape)} does not split into {shards} equal pieces of whole NF4 "
        f"scaler blocks ({NF4_SPAN} elements: {NF4_BLOCK} x {NF4_SCALER_BLOCK}); expected rows "
        f"divisible by {shards} and each piece's {piece} x {columns} elements a multiple of "
        f"{NF4_SPAN} (leave it out of --lora-targets, or use another --nproc or --dp-outer)"
    )


def _lora_layers(lm: nn.Module) -> list[tuple[str, Any]]:
    """The LoRA layers peft put in ``lm``, with their names (each holds a ``base_layer``)."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in lm.named_modules() if isinstance(m, LoraLayer)]


@functools.lru_cache(maxsize=4)
def _code_book(device: torch.device) -> torch.Tensor:
    """The 16 values of torchao's NF4 in ``BASE_DTYPE`` on ``device`` (from a tiny ``to_nf4``)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(torch.zeros(NF4_SPAN, dtype=BASE_DTYPE)).nf4.to(device)


def make_bases_nf4(lm: nn.Module, device: torch.device) -> list[str]:
    """Make the base weight of every LoRA layer of the meta ``lm`` a meta NF4 parameter, frozen.

    The packed data and scalers stay on the meta device until ``to_empty``; the
    code book and the (global) scaler mean, which are not cut into pieces, are
    made on ``device`` now and shared by every piece. Returns the weights' names.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    names = []
    for name, layer in _lora_layers(lm):
        base: nn.Linear = layer.base_layer
        shape = tuple(base.weight.shape)
        nf4 = to_nf4(torch.empty(shape, dtype=BASE_DTYPE, device="meta"))
        nf4.nf4 = _code_book(device)
        nf4.scaler_mean = torch.zeros((), dtype=BASE_DTYPE, device=device)
        base.weight = nn.Parameter(nf4, requires_grad=False)
        names.append(f"{name}.base_layer.weight")
    return names


def quantize_rows(
    piece: torch.Tensor, first_row: int, rows: int, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """NF4's tensors of rows ``first_row:first_row + len(piece)`` of a ``rows``-row weight.

    ``piece``: this rank's rows in ``BASE_DTYPE``; every rank of ``group`` calls this
    with its own piece (together: the whole weight). Returns ``quantized_data``,
    ``quantized_scalers``, ``quantization_factor`` and ``scaler_mean``: each the
    matching piece (the mean: the value) of ``to_nf4(whole weight)``'s, bitwise.
    See [Note: NF4 quantized per rank].
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    columns = piece.shape[1]
    flat = piece.reshape(-1)
    absmax = flat.view(-1, NF4_BLOCK).abs().amax(dim=1)
    every = torch.zeros(rows * columns // NF4_BLOCK, dtype=torch.float32, device=piece.device)
    start = first_row * columns // NF4_BLOCK
    every[start : start + absmax.numel()] = absmax.float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(every, group=group)  # one writer per entry: exact
    mean = every.to(BASE_DTYPE).mean()
    centered = (absmax - mean).view(-1, NF4_SCALER_BLOCK)
    factor = 256 / (2 * centered.abs().amax(dim=1))
    scaled = (centered * factor.unsqueeze(1)).round().clamp(-128, 127)
    data = NF4Tensor.convert_to_norm_float_weight(
        piece, absmax.numel(), NF4_BLOCK, _code_book(piece.device)
    )
    return {
        "quantized_data": data,
        "quantized_scalers": scaled.reshape(-1).to(torch.int8),
        "quantization_factor": factor.contiguous(),
        "scaler_mean": mean,
    }


def leave_out_of_state_dict(model: nn.Module) -> None:
    """Drop ``model``'s NF4 bases from its ``state_dict`` (so from checkpoints and exports).

    They are frozen and rebuilt from the folder's files by every build, bitwise;
    a checkpoint of a QLoRA run holds the adapters and their optimizer state.
    (torchao's NF4 tensor also lacks the copies a checkpoint's staging makes.)
    """
    names = [name for name, _ in nf4_parameters(model)]

    def drop(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        for name in names:
            state.pop(prefix + name, None)

    # mf-fsdp's wrapper returns its wrapped module's state dict, under the same names.
    getattr(model, "module", model).register_state_dict_post_hook(drop)


def nf4_parameters(model: nn.Module) -> list[tuple[str, Any]]:
    """``model``'s parameters whose (local) tensor is an ``NF4Tensor``, with their names."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    found = []
    for name, param in model.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, NF4Tensor):
            found.append((name, param))
    return found


@torch.no_grad()
def load_nf4_bases(model: nn.Module, folder: Path, file_name: Any) -> None:
    """Fill this rank's rows of every NF4 base of the wrapped ``model`` from ``folder``'s files.

    ``file_name(key)``: the files' name of a parameter's key. Each rank reads its
    rows only, casts them to ``BASE_DTYPE`` and quantizes them with the global
    scaler mean (one all-reduce per weight over its shard group).
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    from mf.train.sources.folder_weights import tensor_files

    files = tensor_files(folder)
    for key, param in nf4_parameters(model):
        name = file_name(key)
        if name not in files:
            raise ValueError(
                f"--model {str(folder)!r}: its safetensors files hold no {name!r}, which the "
                "model built from its config.json has; expected every weight under "
                "transformers' names"
            )
        local: Any = param._local_tensor if isinstance(param, DTensor) else param
        group, first = None, 0
        if isinstance(param, DTensor):
            (dim,) = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
            mesh = param.device_mesh
            group = mesh.get_group(dim)
            first = mesh.get_local_rank(dim) * math.ceil(param.shape[0] / mesh.size(dim))
        count = local.shape[0]
        with safe_open(files[name], "pt") as handle:
            rows = handle.get_slice(name)[first : first + count]
        piece = rows.to(device=local.quantized_data.device, dtype=BASE_DTYPE).contiguous()
        for attribute, value in quantize_rows(piece, first, param.shape[0], group).items():
            getattr(local, attribute).copy_(value)


@torch.no_grad()
def dequantize_targets(lm: nn.Module, targets: list[str]) -> None:
    """Replace each ``targets`` projection's weight of the plain ``lm`` by its NF4 round trip.

    ``--merge`` of a QLoRA run merges the adapter into the bases it was trained
    on: the file's weight cast to bf16, quantized by ``to_nf4`` and dequantized
    (in fp32 after), not the file's weight.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for name, module in lm.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, nn.Linear):
            nf4 = to_nf4(module.weight.detach().to(BASE_DTYPE))
            module.weight.copy_(nf4.get_original_weight().to(module.weight.dtype))
