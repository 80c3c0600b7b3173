"""The model a ``--model PATH`` run trains, on the meta device, and its optimizers.

One home for what ``mf.train.setup`` wraps and what a ``--resume`` verifies its
checkpoint against (``mf.train.resume``): the folder's model, with LoRA's
adapters and NF4 bases as the options say.
"""

from __future__ import annotations

import torch

from mf.models import build_optimizers
from mf.train.model_folder import CausalLM, ModelFolder, meta_causal_lm
from mf.train.settings import TrainOptions

__all__ = ["folder_module"]


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
        return module, build_optimizers(options.optimizer, module, options.lr, weight_decay=0.1)
    from mf.train.lora import add_adapters

    add_adapters(module.lm, options)
    if options.base_dtype == "nf4":
        from mf.train.nf4_bases import leave_out_of_state_dict, make_bases_nf4

        make_bases_nf4(module.lm, device)
        leave_out_of_state_dict(module)
    trainable = [p for p in module.parameters() if p.requires_grad]
    return module, [torch.optim.AdamW(trainable, lr=options.lr, weight_decay=0.1)]
