"""The optimizer steps flat runs of pieces, with the per-parameter result (see [Note: flat runs]).

- A bound Adam steps one flat tensor per run of consecutive pieces, far fewer
  tensors than parameters; between steps every parameter's state entries are
  parameter-shaped DTensors whose pieces lie end to end in one buffer per run,
  and every parameter's step counter holds the steps taken (a run's counters
  are views of one buffer).
- Parity with one process at 1e-6 over 5 steps, world 2, ZeRO-3, where runs
  must break: two param groups whose members alternate (decayed matrices,
  undecayed vectors and norms), SGD with momentum (state the first step
  creates for a run) and AdamW (state created eagerly, one tensor per
  parameter, moved into run buffers at the first step).
- A state entry replaced between steps (a user resetting one parameter's
  moments) is what the next step reads, as in plain PyTorch; so is a state
  loaded with ``load_state_dict``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mf_fsdp
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    full_params,
    make_model,
    optimizer_step,
    unit_classes,
)

RTOL = ATOL = 1e-6
STEPS = 5


def _groups(opt_name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two param groups whose members alternate in the buckets' order."""
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]
    if opt_name == "momentum":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2)


def _reset_moments(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """What a user may do between steps: give one parameter fresh moments by assignment."""
    state = opt.state[param]
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = torch.zeros_like(state[key])


def _wrapped(opt_name: str):
    module = make_model()
    opt = _groups(opt_name, module)
    return mf_fsdp.fully_shard(module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=3)


def _reference(opt_name: str, world: int, reset_at: int | None):
    model = make_model()
    opt = _groups(opt_name, model)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for r in range(world):
            loss = model(*batch(step, r)) / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if step == reset_at:
            _reset_moments(opt, model.blocks[0].fc.weight)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_parity(rank: int, world: int, opt_name: str, reset_at: int | None) -> None:
    label = f"{opt_name} reset_at={reset_at}"
    ref = _reference(opt_name, world, reset_at)
    model, opt = _wrapped(opt_name)
    stepped: list[int] = []  # tensors per param group during each step (after the swap)
    handle = opt.register_step_pre_hook(
        lambda o, *_: stepped.extend(len(g["params"]) for g in o.param_groups)
    )
    losses = []
    for step in range(STEPS):
        losses.append(optimizer_step(model(*batch(step, rank)), opt, world))
        if step == reset_at:
            _reset_moments(opt, dict(model.named_parameters())["blocks.0.fc.weight"])
    handle.remove()
    assert_matches_reference(losses, full_params(model), *ref, label, RTOL, ATOL)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert sum(stepped[:2]) < len(params), f"{label}: tensors stepped {stepped[:2]}"
    # Between steps: parameter-shaped state, each run's pieces in one buffer; every
    # parameter's counter holds the steps taken, the counters of a run in one buffer.
    buffers, counters = set(), set()
    for param in params:
        for key, value in opt.state[param].items():
            if value.dim():
                assert value.shape == param.shape, (key, value.shape, param.shape)
                buffers.add(value.to_local().untyped_storage().data_ptr())
            else:
                assert value.item() == STEPS, (label, key, value)
                counters.add(value.untyped_storage().data_ptr())
    assert len(buffers) < len(params), f"{label}: {len(buffers)} state buffers"
    assert len(counters) < len(params) or opt_name == "momentum", f"{label}: {len(counters)}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("opt_name", "reset_at"), [("momentum", None), ("adamw", 2)])
def test_runs_across_alternating_groups_match_one_process(opt_name, reset_at) -> None:
    run_on_ranks(_rank_parity, 2, opt_name, reset_at, timeout=300)


def _rank_load(rank: int, world: int) -> None:
    """A state loaded over a trained one is what the next steps read."""
    model, opt = _wrapped("adamw")
    for step in range(2):
        optimizer_step(model(*batch(step, rank)), opt, world)
    twin, twin_opt = _wrapped("adamw")
    optimizer_step(twin(*batch(7, rank)), twin_opt, world)  # runs built on other state
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    losses = [optimizer_step(model(*batch(s, rank)), opt, world) for s in range(2, STEPS)]
    twin_losses = [optimizer_step(twin(*batch(s, rank)), twin_opt, world) for s in range(2, STEPS)]
    assert_matches_reference(
        twin_losses, full_params(twin), losses, full_params(model), "load", 0, 0
    )


@pytest.mark.multiprocess
def test_a_loaded_state_replaces_the_runs() -> None:
    run_on_ranks(_rank_load, 2, timeout=300)


def _rank_plans_kept(rank: int, world: int) -> None:
    """What a step swaps in is built once and kept: no rebuild per step, options on or off.

    With the step inside the backward, the ``step()`` after it has no grads left to
    step; it must not displace the plan the backward's own step keeps using.
    """
    for options in ({}, {"optimizer_step_in_backward": True}):
        module = make_model()
        opt = _groups("adamw", module)
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=3, **options
        )
        for step in range(2):
            optimizer_step(model(*batch(step, rank)), opt, world)
        plans = dict(opt._mf_fsdp_local_plans)
        for step in range(2, 4):
            optimizer_step(model(*batch(step, rank)), opt, world)
        kept = opt._mf_fsdp_local_plans
        assert kept.keys() == plans.keys(), options
        assert all(kept[key] is plan for key, plan in plans.items()), options


@pytest.mark.multiprocess
def test_the_swap_is_built_once() -> None:
    run_on_ranks(_rank_plans_kept, 2, timeout=300)


def _rank_plan_validity(rank: int, world: int) -> None:
    """A kept swap stands while what it was built from stands, object for object.

    Replacing a grad, a state value, a parameter's state dict, or adding state
    for another tensor rebuilds it; changing values in place does not.
    """
    model, opt = _wrapped("adamw")
    for step in range(2):
        optimizer_step(model(*batch(step, rank)), opt, world)
    model(*batch(2, rank)).backward()  # grads handed out; the kept plan was built with them
    [plan] = opt._mf_fsdp_local_plans.values()
    state = opt.state
    param = opt.param_groups[0]["params"][1]
    entry = state[param]
    assert plan.valid(state)
    entry["exp_avg"].add_(0.0)  # in place: the swap's views see it
    assert plan.valid(state)
    for key in ("exp_avg", "step"):
        kept = entry[key]
        entry[key] = kept.clone()
        assert not plan.valid(state), key
        entry[key] = kept
        assert plan.valid(state), key
    grad = param.grad
    param.grad = grad.clone()
    assert not plan.valid(state)
    param.grad = grad
    state[param] = dict(entry)
    assert not plan.valid(state)
    state[param] = entry
    assert plan.valid(state)
    other = torch.zeros(1)
    state[other] = {}
    assert not plan.valid(state)
    del state[other]
    assert plan.valid(state)
    assert not plan.valid(copy.copy(state))
    opt.step()
    opt.zero_grad()


@pytest.mark.multiprocess
def test_a_kept_swap_is_rebuilt_when_what_it_was_built_from_is_replaced() -> None:
    run_on_ranks(_rank_plan_validity, 1)
