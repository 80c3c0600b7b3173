"""``mf-train --lora-rank R``: peft's LoRA adapters on a transformers folder's model.

peft serves under mf's sharding: ``peft.inject_adapter_in_model`` (with
``low_cpu_mem_usage``) wraps each ``--lora-targets`` projection in peft's
``lora.Linear`` while the model is still on the meta device, marks only the
adapters trainable, and creates the adapters on the meta device too. mf-fsdp
then shards the whole model (decoder layers as units), the frozen bases in
buckets without gradient buffers; the optimizer holds the adapters only. Each
rank reads its rows of the bases from the folder's files (the key
``...q_proj.base_layer.weight`` is the file's ``...q_proj.weight``) and
``init_adapters`` writes its rows of the adapters: ``lora_A`` uniform in
``+-1/sqrt(in)`` (peft's default, kaiming with ``a = sqrt(5)``) drawn whole from
the seed, so every world size starts from the same adapters, and ``lora_B`` zero,
so the first forward is the base model's.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from mf.train.adapters.lora_options import lora_alpha, lora_targets
from mf.train.settings import TrainOptions

__all__ = ["ADAPTER_MARK", "add_adapters", "base_file_name", "init_adapters", "lora_config"]

ADAPTER_MARK = ".lora_"
"""What every adapter weight's state-dict key holds (``lora_A``, ``lora_B``)."""


def lora_config(options: TrainOptions) -> Any:
    """The run's ``peft.LoraConfig``: rank, alpha, targets; no dropout, no bias."""
    from peft import LoraConfig

    assert options.lora_rank is not None, "lora_config needs --lora-rank"
    return LoraConfig(
        r=options.lora_rank,
        lora_alpha=lora_alpha(options),
        target_modules=lora_targets(options),
        lora_dropout=0.0,
        bias="none",
    )


def add_adapters(lm: nn.Module, options: TrainOptions) -> None:
    """Wrap ``lm``'s target projections in peft's LoRA layers, on the meta device; freeze the rest.

    Raises:
        ValueError: peft matched none of ``--lora-targets`` (one line).
    """
    from peft import inject_adapter_in_model

    inject_adapter_in_model(lora_config(options), lm, low_cpu_mem_usage=True)
    for name, parameter in lm.named_parameters():
        parameter.requires_grad_(ADAPTER_MARK in name)


def base_file_name(key: str) -> str | None:
    """The folder file's name of a state-dict key, or None for an adapter weight (not in files)."""
    if ADAPTER_MARK in key:
        return None
    return key.replace(".base_layer.", ".")


def _copy_box(
    full: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], target: torch.Tensor
) -> None:
    """Copy the box of ``full`` at ``offsets`` of ``sizes`` into ``target``."""
    target.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))])


@torch.no_grad()
def init_adapters(model: Any, seed: int) -> None:
    """Write this rank's rows of every adapter: ``lora_A`` drawn whole from ``seed``, ``lora_B`` 0.

    Every rank draws every adapter whole, in key order, so the values do not depend
    on the world size or the sharding.
    """
    from mf.train.sources.folder_weights import write_rows
    from mf_fsdp.checkpoint import get_model_state_dict

    generator = torch.Generator().manual_seed(seed)
    state = get_model_state_dict(model)
    for key in sorted(k for k in state if ADAPTER_MARK in k):
        value = state[key]
        if ".lora_A." in key:
            bound = 1.0 / math.sqrt(value.shape[1])
            full = torch.rand(tuple(value.shape), generator=generator) * (2 * bound) - bound
        else:
            full = torch.zeros(tuple(value.shape))
        write_rows(value, functools.partial(_copy_box, full))
