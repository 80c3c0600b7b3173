"""``mf-train --model PATH``: a local transformers causal-LM folder as the model to train.

A folder holds ``config.json``, its weights as ``*.safetensors`` (one file, or
shards named by ``model.safetensors.index.json``) and its tokenizer files. It is
read offline: ``HF_HUB_OFFLINE`` is set and every transformers call passes
``local_files_only=True``, so a folder that lacks a file fails instead of
reaching for the Hub, and no code from the folder runs (``trust_remote_code``
stays off).

The model is built with its parameters on the meta device (its buffers, such as
rotary tables, are computed on the host as transformers computes them) and
wrapped in ``CausalLM``, whose forward is mf's GPT's: ``model(tokens, targets)``
is the mean next-token cross-entropy, ``model(tokens)`` the logits. Its decoder
layers (the classes the model names in ``_no_split_modules``) are the FSDP units.
Each rank then reads only its own rows of each weight from the files
(``mf.train.sources.folder_weights``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mf.train.sources.example_mask import example_mask

__all__ = [
    "CONFIG_FILE",
    "PREFIX",
    "CausalLM",
    "ModelFolder",
    "attends_through_sdpa",
    "folder_of",
    "meta_causal_lm",
    "meta_module",
    "model_folder",
    "unit_classes",
]

PREFIX = "lm."
"""What ``CausalLM`` adds before the transformers model's own state-dict keys."""

CONFIG_FILE = "config.json"


_ENUM_REGISTRATION = "is an Enum subclass and is now natively supported by torch.compile"
"""What torch (2.15) warns, twice, when transformers' modelling imports torchao, whose
float8 module registers two Enums with pytree: not the user's concern, and before a
one-line data error it would be the first two lines."""


def _without_enum_registration(record: logging.LogRecord) -> bool:
    return _ENUM_REGISTRATION not in record.getMessage()


def _offline() -> None:
    """Make every Hugging Face call in this process (and its children) offline and quiet.

    Quiet: transformers' progress bars (loading, writing shards) are not mf-train's,
    nor torch's warning about torchao's Enums (``_ENUM_REGISTRATION``; that one only).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    pytree = logging.getLogger("torch.utils._pytree")
    if _without_enum_registration not in pytree.filters:
        pytree.addFilter(_without_enum_registration)


@dataclass(frozen=True)
class ModelFolder:
    """A checked transformers causal-LM folder: its config and what mf-train needs of it."""

    path: Path
    config: Any  # transformers.PretrainedConfig
    parameters: int

    @property
    def positions(self) -> int:
        """The longest sequence the model's positions allow (``max_position_embeddings``)."""
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def layers(self) -> int:
        """Its decoder layers."""
        return int(self.config.num_hidden_layers)

    @property
    def width(self) -> int:
        """Its hidden size."""
        return int(self.config.hidden_size)

    @property
    def name(self) -> str:
        """How mf-train names it in its lines: the config's model type and the folder."""
        return f"{self.config.model_type} model {str(self.path)!r}"


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(f"--model {path!r}: {why}")


@functools.lru_cache(maxsize=8)
def model_folder(path: str, weights: bool = True) -> ModelFolder:
    """Check the folder at ``path`` and describe it (cached: every check reads it once).

    ``weights=False`` asks for the config only (``mf-plan`` reads no weights): a
    folder without ``*.safetensors`` passes.

    Raises:
        ValueError: one line naming the folder and what is wrong: no folder, no
            ``config.json``, a config transformers cannot read, a model that is not
            a causal LM, no ``*.safetensors`` weights, or no transformers installed.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise _refuse(
            path, "is not a folder; expected a preset name or a transformers model folder"
        )
    if not (folder / CONFIG_FILE).is_file():
        raise _refuse(path, f"holds no {CONFIG_FILE}; expected a transformers model folder")
    try:
        _offline()
        import transformers
    except ImportError:
        raise _refuse(path, "needs transformers: install mf[hf]") from None
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise _refuse(path, f"{CONFIG_FILE} is not a transformers config ({first})") from None
    try:
        with _parameters_on_meta():
            module = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:
        raise _refuse(
            path,
            f"its {CONFIG_FILE} describes a {type(config).__name__} ({config.model_type!r}), "
            "which is not a causal language model; expected a model "
            "AutoModelForCausalLM builds (Llama, Qwen, Mistral, GPT-2, ...)",
        ) from None
    if weights and not any(folder.glob("*.safetensors")):
        raise _refuse(path, "holds no *.safetensors weights; expected a transformers model folder")
    parameters = sum(p.numel() for p in module.parameters())
    if not unit_classes(module):
        raise _refuse(
            path,
            f"{type(module).__name__} names no decoder layer class in _no_split_modules; "
            "mf-train needs one as the FSDP unit",
        )
    return ModelFolder(folder, config, parameters)


def folder_of(model: str) -> ModelFolder | None:
    """The checked folder ``--model`` names, or None for a preset name (see ``model_folder``).

    Raises:
        ValueError: ``model`` is neither a preset nor a transformers model folder.
    """
    from mf.models import MODEL_PRESETS

    if model in MODEL_PRESETS:
        return None
    if not Path(model).is_dir():
        raise _refuse(
            model,
            f"is neither a preset ({', '.join(sorted(MODEL_PRESETS))}) nor a folder; expected "
            "one of them (a folder: a transformers causal LM with config.json and *.safetensors)",
        )
    return model_folder(model)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers on the host.

    Buffers computed at construction (rotary frequencies) are not in the weight
    files and are not parameters: built for real, they come out exactly as
    transformers computes them. Parameters become meta tensors as they are
    registered, so their values are never drawn and no memory holds them.
    """
    register = nn.Module.register_parameter

    def to_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def unit_classes(module: nn.Module) -> list[type[nn.Module]]:
    """The model's decoder-layer classes: those it names in ``_no_split_modules``."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return sorted({type(m) for m in module.modules() if type(m).__name__ in names}, key=str)


class CausalLM(nn.Module):
    """A transformers causal LM with mf's GPT forward: ``(tokens, targets) -> loss``.

    The loss is the mean cross-entropy of ``targets`` (the tokens shifted by one,
    as mf-train's batches give them) over the positions whose target is not
    ``-100`` (``F.cross_entropy``'s ignored index: prompts and padding of
    instruction data), computed in fp32, the same formula as ``mf.models.GPT``'s;
    0 (with zero gradients) when no target counts, as in a context-parallel
    rank's share of a prompt.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V], or the mean next-token loss when ``targets`` are given.

        ``positions``: None, the model's own; [S], this rank's share of each
        sequence under ``--cp``; [B, S], packed rows whose positions restart at each
        example, which then attends within itself only (``example_mask``).
        """
        extra: dict[str, torch.Tensor] = {}
        if positions is not None and positions.dim() == 2:  # packed rows: examples kept apart
            extra["position_ids"] = positions
            config: Any = self.lm.config
            extra["attention_mask"] = example_mask(positions, config._attn_implementation)
        elif positions is not None:  # this rank's positions of each sequence (--cp)
            extra["position_ids"] = positions.expand_as(tokens)
            # No padding: said so that transformers does not read the head-tail positions
            # as packed documents and build a mask (mf's CP attention serves causal SDPA).
            extra["attention_mask"] = torch.ones_like(tokens)
        logits = self.lm(input_ids=tokens, use_cache=False, **extra).logits
        if targets is None:
            return logits
        flat, wanted = logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        counted = (wanted != -100).sum().clamp(min=1)
        return F.cross_entropy(flat, wanted, reduction="sum") / counted


def meta_module(model: str) -> nn.Module:
    """``--model``'s module on the meta device: a preset's GPT, or a folder's ``CausalLM``."""
    from mf.models import MODEL_PRESETS, plain_model

    folder = folder_of(model)
    if folder is not None:
        return meta_causal_lm(folder, torch.device("meta"))
    with torch.device("meta"):
        return plain_model(MODEL_PRESETS[model])


def attends_through_sdpa(folder: ModelFolder) -> bool:
    """Whether the folder's model class can run its attention through torch's SDPA.

    ``--cp`` needs it: ``mf_tp.context_parallel`` serves the model's
    ``scaled_dot_product_attention`` calls, so a model attending any other way
    would attend within each rank's chunk only.
    """
    import transformers

    _offline()
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(folder.config), None)
    return bool(getattr(model_class, "_supports_sdpa", False))


def meta_causal_lm(
    folder: ModelFolder, device: torch.device | None = None, attention: str | None = None
) -> CausalLM:
    """The folder's model in ``CausalLM``, parameters on the meta device, buffers on ``device``.

    fp32 parameters whatever the files hold: mf keeps fp32 main weights and
    casts for compute as ``--precision`` says. ``attention`` names transformers'
    attention implementation (``"sdpa"`` under ``--cp``); None: the config's own.
    """
    import transformers

    _offline()
    chosen = {} if attention is None else {"attn_implementation": attention}
    with _parameters_on_meta():
        lm = transformers.AutoModelForCausalLM.from_config(
            folder.config, dtype=torch.float32, **chosen
        )
    for module in lm.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device or "cpu")
    return CausalLM(lm)
