"""The planned model on the meta device: one of mf's GPT presets, or a folder's config.json.

No weight is read and no value drawn: parameters are meta tensors, so a 70B
model costs what its module objects cost. A folder is checked as mf-train checks
it (a transformers causal LM whose decoder layer is the FSDP unit) except that
it needs no weight files. A mixture of experts is not planned yet and is
refused here in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mf.models import GPT, MOE_PRESETS, PRESETS, Block
from mf.train.sources.model_folder import (
    CONFIG_FILE,
    ModelFolder,
    meta_causal_lm,
    model_folder,
    unit_classes,
)

__all__ = ["ModelSource", "meta_model", "model_source", "planned_seq_len"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the planned model comes from.

    Attributes:
        name: what ``--model`` said.
        parameters: its parameter count (tied weights once).
        layers: its FSDP units (decoder layers).
        folder: the checked folder, or None for a preset.
    """

    name: str
    parameters: int
    layers: int
    folder: ModelFolder | None = None


def model_source(model: str) -> ModelSource:
    """Check ``--model`` (a dense preset, or a causal-LM folder's config.json) and describe it.

    Raises:
        ValueError: one line: an unknown preset, a folder that is not a causal LM,
            or a mixture of experts (not planned yet).
    """
    if model in MOE_PRESETS:
        raise ValueError(
            f"--model {model!r} is a mixture of experts; mf-plan plans dense models only so "
            f"far (presets {', '.join(sorted(PRESETS))}, or a folder)"
        )
    if model in PRESETS:
        config = PRESETS[model]
        return ModelSource(model, config.num_parameters(), config.n_layers)
    if not Path(model).is_dir():
        raise ValueError(
            f"--model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            f"folder; expected one of them (a folder: a transformers causal LM's {CONFIG_FILE})"
        )
    folder = model_folder(model, weights=False)
    return ModelSource(model, folder.parameters, folder.layers, folder)


def meta_model(source: ModelSource) -> tuple[nn.Module, list[type[nn.Module]]]:
    """The model as mf-train builds it, on the meta device, and its unit classes.

    A folder's model is ``CausalLM`` with fp32 parameters, its buffers (rotary
    tables) on the meta device too.
    """
    meta = torch.device("meta")
    if source.folder is not None:
        module = meta_causal_lm(source.folder, meta)
        return module, unit_classes(module.lm)
    with meta:
        return GPT(PRESETS[source.name]), [Block]


def planned_seq_len(source: ModelSource, seq_len: int | None) -> int:
    """``--seq-len``, or the model's positions as mf-train on a GPU uses them.

    Raises:
        ValueError: one line: a length outside the model's positions.
    """
    if source.folder is not None:
        positions = source.folder.positions
    else:
        positions = PRESETS[source.name].seq_len
    planned = positions if seq_len is None else seq_len
    if not 0 < planned <= positions:
        raise ValueError(
            f"--seq-len must be in [1, {positions}] (the {source.name!r} model's positions), "
            f"got {planned}"
        )
    return planned
