"""Helpers for ``test_fsdp2_port_*``: one of torch's FSDP2 scenarios run on both engines.

The conformance harness (``tests/fsdp/_fsdp2_conformance.py``) checks mf against
torch's own reference (``replicate`` or hand-reduced gradients). The port files
add the other half of the issue's rule, "torch's FSDP2 and mf on the same
script in the same test": a scenario is a function of the ``fully_shard`` it is
given, it runs once per engine in the same ranks, and each run makes torch's
assertions against the reference. Where a scenario returns values (losses,
whole gradients, whole weights), the two engines' values are compared too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_utils import TestCase

from mf_fsdp import fsdp2

__all__ = ["ENGINES", "full", "on_both", "train_pairs"]

ENGINES: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("torch", torch_fully_shard),
    ("mf", fsdp2.fully_shard),
)
"""Each engine a port runs: torch's FSDP2 first (the scenario's own check), then mf."""


def full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole value of a parameter or gradient, sharded (``full_tensor``) or not."""
    if tensor is None:
        return None
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor.detach().clone()


NEWER_FSDP2 = tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 15)
"""Whether the installed torch's FSDP2 is 2.15's or newer. torch 2.11's fails some ported
scenarios itself (a mixed Tensor/DTensor matmul in a standalone unit, a dtype mismatch in a
recomputed cast, ``jvp`` through its lazy init); there mf runs alone (``torch_runs``)."""


def on_both(
    case: TestCase,
    scenario: Callable[..., Any],
    *args: Any,
    torch_needs: str | None = None,
    torch_runs: bool = True,
) -> None:
    """Run ``scenario(fully_shard, *args)`` once per engine; equal results where it returns any.

    A failure names the engine, so a scenario torch's FSDP2 itself fails is told
    apart from one only mf fails. ``torch_needs``: an ``FSDPModule`` method the
    scenario calls that the installed torch's FSDP2 may lack (newer than torch
    2.11); without it, mf runs alone against the scenario's own reference, as it
    does when ``torch_runs`` is False (a scenario the installed torch's FSDP2 crashes in).
    """
    from torch.distributed.fsdp import FSDPModule

    engines = ENGINES
    if not torch_runs or (torch_needs is not None and not hasattr(FSDPModule, torch_needs)):
        engines = tuple(engine for engine in ENGINES if engine[0] != "torch")
    results = {}
    for name, shard in engines:
        try:
            results[name] = scenario(shard, *args)
        except Exception as error:
            raise AssertionError(f"{name}'s FSDP2 failed {scenario.__name__}{args}") from error
    if results.get("torch") is not None:
        case.assertEqual(results["mf"], results["torch"], msg=f"mf != torch in {scenario.__name__}")


def train_pairs(
    case: TestCase,
    pairs: list[tuple[nn.Module, torch.optim.Optimizer]],
    inputs: Callable[[int], tuple[Any, ...]],
    iters: int,
) -> list[torch.Tensor]:
    """torch's parity loop: zero_grad (to None every other step), forward, backward, step.

    The reference (first pair) and the sharded model have equal losses every step;
    returns the sharded model's losses for the cross-engine comparison.
    """
    losses_out = []
    for iter_idx in range(iters):
        losses = []
        for model, optim in pairs:
            optim.zero_grad(set_to_none=iter_idx % 2 == 0)
            losses.append(model(*inputs(iter_idx)).sum())
            losses[-1].backward()
            optim.step()
        case.assertEqual(losses[0], losses[1])
        losses_out.append(losses[1].detach())
    return losses_out
