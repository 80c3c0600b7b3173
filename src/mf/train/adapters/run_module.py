"""The model a ``--model PATH`` run trains, on the meta device, and its optimizers.

One home for what ``mf.train.rank.setup`` wraps and what a ``--resume`` verifies its
checkpoint against (``mf.train.run.resume``): the folder's model, with LoRA's
adapters and NF4 bases as the options say, and its decoder layers' linears in
float8 under ``--precision fp8``.
"""

from __future__ import annotations

import torch
from torch import nn

from mf.models import build_optimizers
from mf.models.float8 import FSDP_FLOAT8_ALL_GATHER, convert_gpt_to_float8, converts_to_float8
from mf.train.settings import TrainOptions
from mf.train.sources.model_folder import CausalLM, ModelFolder, meta_causal_lm, unit_classes

__all__ = ["float8_linears", "folder_module"]


def float8_linears(module: CausalLM) -> list[str]:
    """The linears ``--precision fp8`` converts: those of the decoder layers fit for FP8.

    The attention and MLP projections (q/k/v/o, gate/up/down in a Llama) whose
    two dimensions divide by 16 (``converts_to_float8``). The LM head and the
    embeddings stay in high precision, as torchtitan keeps them: the logits feed
    the loss directly, and an embedding is a lookup, not a matmul.
    """
    units = tuple(unit_classes(module.lm))
    return [
        f"{name}.{inner}"
        for name, layer in module.named_modules()
        if isinstance(layer, units)
        for inner, linear in layer.named_modules()
        if inner and converts_to_float8(linear, inner)
    ]


def _layers_to_float8(module: CausalLM, options: TrainOptions) -> None:
    """Swap ``float8_linears`` for torchao's ``Float8Linear`` (on the meta device).

    FP8 weight gathering under ZeRO-3, as for the presets (``FSDP_FLOAT8_ALL_GATHER``).
    """
    chosen = set(float8_linears(module))

    def picked(_: nn.Module, fqn: str) -> bool:
        return fqn in chosen

    gathers_fp8 = FSDP_FLOAT8_ALL_GATHER and options.zero == 3
    convert_gpt_to_float8(module, fsdp_float8_all_gather=gathers_fp8, module_filter=picked)


def folder_module(
    options: TrainOptions, folder: ModelFolder, device: torch.device
) -> tuple[CausalLM, list[torch.optim.Optimizer]]:
    """The folder's model on the meta device as the run trains it, and its optimizers.

    With ``--lora-rank``: peft's adapters added, the rest frozen (``--base-dtype
    nf4``: the targets' bases NF4, left out of the state dict), and one AdamW over
    the adapters. Buffers live on ``device``; under ``--cp`` it attends through SDPA.
    """
    module = meta_causal_lm(folder, device, "sdpa" if options.cp > 1 else None)
    if options.lora_rank is None:
        if options.precision == "fp8":  # before the optimizers: FP8 gathering swaps the weights
            _layers_to_float8(module, options)
        return module, build_optimizers(options.optimizer, module, options.lr, weight_decay=0.1)
    from mf.train.adapters.lora import add_adapters

    add_adapters(module.lm, options)
    if options.base_dtype == "nf4":
        from mf.train.sources.nf4_bases import leave_out_of_state_dict, make_bases_nf4

        make_bases_nf4(module.lm, device)
        leave_out_of_state_dict(module)
    trainable = [p for p in module.parameters() if p.requires_grad]
    return module, [torch.optim.AdamW(trainable, lr=options.lr, weight_decay=0.1)]
