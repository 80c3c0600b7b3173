"""A graph kept by ``retain_graph=True`` and run backward again reduces each backward's grads.

A gradient penalty takes the input grads of the loss first
(``torch.autograd.grad(loss, inputs=[x], retain_graph=True)``), then runs
``loss.backward()`` through the same graph; a loss may also be run backward
twice. FSDP2 reduces what each backward accumulates. mf's end of a backward
used to forget which units the forward had run, so the next backward through
the retained graph accumulated into the units' buffers and never reduced them:
the step went on with the grads of the root's parameters alone (a silent wrong
result, step-2 loss 0.1202 against one process's 0.0440 here).

Checked at world 2 against one process running the same program on the global
batch (each rank's loss the mean over its half, so the grads average), 3 SGD
steps, losses and final weights to 1e-5: ZeRO 0-3 through ``mf_fsdp.fully_shard``
with every ``Linear`` a unit, and the FSDP2 front end with and without
``reshard_after_forward``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mf_fsdp
from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks

STEPS, WORLD, ROWS = 3, 2, 4
RTOL, ATOL = 1e-5, 1e-6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _batch(step: int) -> torch.Tensor:
    return torch.randn(WORLD * ROWS, 8, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rows: slice, program: str) -> list[float]:
    losses = []
    for step in range(STEPS):
        x = _batch(step)[rows].requires_grad_(True)
        loss = model(x).square().mean()
        if program == "penalty":
            torch.autograd.grad(loss, inputs=[x], retain_graph=True)
            loss.backward()
        else:  # the same graph backward twice: the grads count twice
            loss.backward(retain_graph=True)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(program: str) -> tuple[list[float], list[torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = _train(model, opt, slice(None), program)
    return losses, [p.detach().clone() for p in model.parameters()]


def _full(param: torch.Tensor) -> torch.Tensor:
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach()


def _compare(losses: list[float], params: list[torch.Tensor], program: str, label: str) -> None:
    local = torch.tensor(losses)
    dist.all_reduce(local)
    ref_losses, ref_params = _reference(program)
    torch.testing.assert_close(local / WORLD, torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for param, ref in zip(params, ref_params, strict=True):
        torch.testing.assert_close(param, ref, rtol=RTOL, atol=ATOL, msg=label)


def _rank_native(rank: int, world: int, program: str) -> None:
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    for strategy in (0, 1, 2, 3):
        module = _model()
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=[nn.Linear], zero_dp_strategy=strategy
        )
        losses = _train(model, opt, rows, program)
        params = [_full(p) for p in model.parameters()]
        _compare(losses, params, program, f"{program} ZeRO-{strategy}")


def _rank_fsdp2(rank: int, world: int, program: str) -> None:
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    for reshard in (True, False):
        model = _model()
        for index in (0, 2, 4):
            fsdp2.fully_shard(model[index], reshard_after_forward=reshard)
        fsdp2.fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = _train(model, opt, rows, program)
        params = [_full(p) for p in model.parameters()]
        _compare(losses, params, program, f"{program} fsdp2 reshard={reshard}")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("program", ["penalty", "twice"])
def test_retained_graph_backward_again_matches_one_process(program: str) -> None:
    run_on_ranks(_rank_native, WORLD, program, timeout=130)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("program", ["penalty", "twice"])
def test_retained_graph_through_fsdp2_matches_one_process(program: str) -> None:
    run_on_ranks(_rank_fsdp2, WORLD, program, timeout=130)
