"""Shared pieces of the mf_fsdp tests: the tiny GPT, rank-dependent data, a reference run."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import mf_fsdp
from mf.models import GPT, PRESETS, Block, GPTConfig

CONFIG: GPTConfig = PRESETS["tiny"]
BATCH, SEQ = 2, 16


def make_model(seed: int = 0, config: GPTConfig = CONFIG) -> GPT:
    """The same tiny GPT on every rank for a given seed."""
    torch.manual_seed(seed)
    return GPT(config)


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent tokens and targets (deterministic)."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """SGD exposes any gradient-scale error; Adam is the usual choice.

    Also ``"momentum"`` (SGD with momentum and dampening: state beside the grads)
    and ``"adamw"``.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.Adam(params, lr=1e-2)


def reference_run(
    opt_name: str,
    world: int,
    steps: int,
    micro: int = 1,
    clip: float | None = None,
    per_token: bool = False,
    make: Callable[[], torch.nn.Module] = make_model,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    call_kwargs: Callable[[int, int, int], dict] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch: losses and final parameters.

    With ``per_token`` the ranks' losses are summed, not averaged (the contract of
    ``calculate_per_token_loss``); ``make`` builds the model (the tiny GPT by default),
    ``optimizer(opt_name, params)`` the optimizer (``make_optimizer`` by default);
    ``call_kwargs(step, rank, micro)`` extra keyword arguments of each rank's forward.
    """
    model = make()
    opt = (optimizer or make_optimizer)(opt_name, model.parameters())
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            for r in range(world):
                tokens, targets = batch(step, r, m)
                extra = {} if call_kwargs is None else call_kwargs(step, r, m)
                loss = model(tokens, targets, **extra) / ((1 if per_token else world) * micro)
                loss.backward()
                total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def global_batch_run(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    world: int,
    loss_of: Callable[[torch.nn.Module, int, int], torch.Tensor],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process over every rank's batch: ``loss_of(model, step, rank) / world`` summed.

    The reference a data-parallel run must equal (gradients averaged over the ranks'
    batches, then one optimizer step): its losses and final parameters.
    """
    losses = []
    for step in range(steps):
        total = 0.0
        for rank in range(world):
            loss = loss_of(model, step, rank) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    world: int,
    before_step: Callable[[], object] | None = None,
) -> float:
    """Backward ``loss``, step and zero the optimizer; return the loss averaged over ranks.

    ``before_step`` runs between the backward and the step (e.g. gradient clipping).
    """
    loss.backward()
    if before_step is not None:
        before_step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    optimizer.step()
    optimizer.zero_grad()
    return total.item() / world


def full_params(model: mf_fsdp.MegatronFSDP) -> dict[str, torch.Tensor]:
    """Every parameter's full value through the torch contract (collective).

    ``model.named_parameters()`` holds the sharded, parameter-shaped DTensors
    between passes; DTensor's own ``full_tensor()`` gathers each.
    """
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in model.named_parameters()
    }


def unit_classes() -> list[type]:
    return [Block]


def assert_losses_match(
    losses: list[float], ref_losses: list[float], label: str, rtol: float, atol: float
) -> None:
    """The sharded run's per-step losses equal the reference run's."""
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{label} losses: {m}",
    )


def assert_matches_reference(
    losses: list[float],
    params: dict[str, torch.Tensor],
    ref_losses: list[float],
    ref_params: dict[str, torch.Tensor],
    label: str,
    rtol: float,
    atol: float,
) -> None:
    """The sharded run's losses and every parameter it holds equal the reference run's.

    ``params`` may be a subset of ``ref_params`` (an expert-parallel rank holds only
    its experts); each of its names must be a reference parameter.
    """
    assert_losses_match(losses, ref_losses, label, rtol, atol)
    assert params.keys() <= ref_params.keys(), sorted(params.keys() - ref_params.keys())
    for name, value in params.items():
        torch.testing.assert_close(
            value, ref_params[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


BF16_LOSS_RTOL = 2e-2
"""bf16 keeps 8 mantissa bits (~0.4% per rounding): over 10 steps the loss stays within
2% of fp32. A loss check alone cannot fail a run that does not train (the tiny GPT at
lr=0 stays within 1.96% of the trained one over 5 steps at world 2), so bf16 tests also
check the parameters (``assert_bf16_trained``)."""

BF16_PARAM_RTOL = {"sgd": 0.05, "adam": 0.9}
"""How far a bf16 run's parameter may end from the fp32 run's, as a fraction of how far
the fp32 run moved it from its initial value. Measured on the tiny GPT over 10 steps (5
for the FSDP2 front end): SGD at most 0.012 (with the gradients doubled: up to 6.3, 1.8
on average); Adam at most 0.76 (a qkv bias whose gradient is near zero, where bf16 flips
the sign of Adam's step now and then; torch's FSDP2 under the same policy: the same). A
parameter the optimizer never moved (a lost update) is at 1.0."""

BF16_MODEL_RTOL = {"sgd": 0.05, "adam": 0.25}
"""The same fraction over the whole model (all parameters as one vector). Measured as
above: SGD at most 0.009, Adam at most 0.12 (a model that never moved: 1.0). Adam
normalises its step, so a wrong gradient scale barely moves it (doubled gradients: 0.11):
SGD is what shows a wrong scale."""


def assert_losses_close(
    losses: list[float], reference: list[float], label: str, rtol: float
) -> None:
    """Losses against a reference run's, within ``rtol`` of each (no absolute slack)."""
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(reference),
        rtol=rtol,
        atol=0.0,
        msg=lambda m: f"{label}: {m}",
    )


def assert_bf16_trained(
    losses: list[float],
    params: dict[str, torch.Tensor],
    fp32_losses: list[float],
    fp32_params: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    label: str,
    opt_name: str,
) -> None:
    """A bf16-compute run trained as the fp32 run of the same steps did.

    Its losses are within ``BF16_LOSS_RTOL`` of the fp32 run's, and its (fp32 main)
    parameters ended near the fp32 run's: each within ``BF16_PARAM_RTOL[opt_name]``,
    and the whole model within ``BF16_MODEL_RTOL[opt_name]``, of how far the fp32 run
    moved them from ``initial``. A run that lost updates, or scaled its gradients
    wrongly under SGD, ends further away.
    """
    assert_losses_close(losses, fp32_losses, label, BF16_LOSS_RTOL)
    assert params.keys() == fp32_params.keys(), sorted(params.keys() ^ fp32_params.keys())
    off, moved = {}, {}
    for name, value in params.items():
        off[name] = (value.float() - fp32_params[name]).norm().item()
        moved[name] = (fp32_params[name] - initial[name]).norm().item()
        assert moved[name] > 0.0, f"{label}: the fp32 run never moved {name}"
    ratios = {name: off[name] / moved[name] for name in params}
    worst = max(ratios, key=ratios.__getitem__)
    assert ratios[worst] <= BF16_PARAM_RTOL[opt_name], (
        f"{label}: {worst} ended {ratios[worst]:.3f} of the fp32 run's distance from its "
        f"initial value away from the fp32 run's value (at most {BF16_PARAM_RTOL[opt_name]})"
    )
    whole = math.sqrt(sum(v * v for v in off.values())) / math.sqrt(
        sum(v * v for v in moved.values())
    )
    assert whole <= BF16_MODEL_RTOL[opt_name], (
        f"{label}: the model ended {whole:.3f} of the fp32 run's distance from its initial "
        f"values away from the fp32 run's (at most {BF16_MODEL_RTOL[opt_name]})"
    )


def initial_params(make: Callable[[], torch.nn.Module] = make_model) -> dict[str, torch.Tensor]:
    """The parameters a run starts from (``make()``'s, before any step)."""
    return {n: p.detach().clone() for n, p in make().named_parameters()}


def train_micro_batches(
    model: mf_fsdp.MegatronFSDP,
    opt: torch.optim.Optimizer,
    rank: int,
    world: int,
    micro: int,
    steps: int,
    after_step: Callable[[int], object] | None = None,
) -> tuple[list[float], list[int]]:
    """``steps`` steps of ``micro`` micro-batches (all but the last in ``no_sync``).

    Returns the losses averaged over ranks, and the grad bytes the engine held after
    each step's last backward. ``after_step(step)`` runs after each ``opt.step()``.
    """
    losses, held = [], []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(micro):
            tokens, targets = batch(step, rank, m)
            last = m == micro - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(tokens, targets) / micro
                loss.backward()
            total += loss.detach()
        held.append(model.memory_footprint()["grads"])
        dist.all_reduce(total)
        opt.step()
        if after_step is not None:
            after_step(step)
        opt.zero_grad()
        losses.append(total.item() / world)
    return losses, held


def wrapped_model(
    strategy: int, opt_name: str, **options: object
) -> tuple[mf_fsdp.MegatronFSDP, torch.optim.Optimizer]:
    """The tiny GPT and ``make_optimizer(opt_name)`` through ``mf_fsdp.fully_shard``."""
    module = make_model()
    opt = make_optimizer(opt_name, module.parameters())
    return mf_fsdp.fully_shard(
        module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy, **options
    )
