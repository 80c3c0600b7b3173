"""Optimizer recipes for the reference models, shared by ``mf-train`` and ``mf-bench``.

- ``adamw``: ``torch.optim.AdamW`` on every parameter.
- ``muon``: torch's Muon recipe, ``torch.optim.Muon`` on the hidden weight
  matrices (the 2-D parameters inside the transformer blocks) and AdamW on the
  rest (embeddings, the tied head, norms, biases). Muon's learning rate is
  scaled as Moonshot's ``match_rms_adamw`` does, so one learning rate and
  weight decay serve both.

The recipes return plain torch optimizers built on the module's parameters
(before or after wrapping: the names are the module's either way).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OPTIMIZER_RECIPES", "build_optimizers", "hidden_matrices"]

OPTIMIZER_RECIPES = ("adamw", "muon")


def hidden_matrices(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(matrices, rest)``: the 2-D parameters inside the blocks, and all others."""
    matrices: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, param in module.named_parameters():
        (matrices if param.ndim == 2 and name.startswith("blocks.") else rest).append(param)
    return matrices, rest


def build_optimizers(
    recipe: str, module: nn.Module, lr: float, weight_decay: float = 0.1
) -> list[torch.optim.Optimizer]:
    """The optimizers of ``recipe`` for ``module``, in the order they step.

    Raises:
        ValueError: if ``recipe`` is not one of ``OPTIMIZER_RECIPES``.
    """
    if recipe == "adamw":
        return [torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)]
    if recipe == "muon":
        matrices, rest = hidden_matrices(module)
        return [
            torch.optim.Muon(
                matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay),
        ]
    raise ValueError(f"recipe: expected one of {OPTIMIZER_RECIPES}, got {recipe!r}")
