"""The attention mask that keeps the examples of a packed row apart.

A packed row (``mf.train.data.packing``) holds several examples whose positions
restart at 0. Token ``q`` may attend to token ``k`` when ``k <= q`` and both lie
in the same example, the one a position of 0 opened last: a block-diagonal causal
mask [B, 1, S, S], which transformers' models take as it is (a 4-D mask is not
rebuilt: ``transformers.masking_utils``). SDPA reads it as booleans, True where
attention goes; the eager attention adds it to the scores, so it gets 0 and the
float32 minimum instead. Other implementations (flash, flex) want their own
form and are refused rather than handed a mask they would misread.

Memory: S * S bytes per sequence as booleans (4 MiB at ``--seq-len 2048``).
"""

from __future__ import annotations

import torch

__all__ = ["example_mask"]


def example_mask(positions: torch.Tensor, implementation: str) -> torch.Tensor:
    """The block-diagonal causal mask [B, 1, S, S] of rows whose ``positions`` [B, S] restart.

    Raises:
        ValueError: ``implementation`` (the model's attention) is neither sdpa nor eager.
    """
    example = (positions == 0).cumsum(-1)
    same = example[:, :, None] == example[:, None, :]
    length = positions.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    allowed = (same & causal)[:, None]
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        blocked = torch.finfo(torch.float32).min
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, blocked)
    raise ValueError(
        f"packed examples need the sdpa or eager attention, the model runs {implementation!r}; "
        "pass --no-pack"
    )
