"""Every transition of the gradient-sync tables, driven and checked.

``buckets/grad_state.py`` and ``engine/sync_policy.py`` each carry a table: the per-bucket
gradient states and what the engine does at each point of a step. The unit
tests walk them without a process group; the multi-rank test drives a real
engine through ``no_sync`` accumulation, a deferred reduction, accumulating
after a reduction, ``sync()``, the HSDP dp_outer stage (once per step),
``zero_grad`` in each state and ``set_model_auto_sync`` both ways, asserting the
states and the gradients against one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import mf_fsdp
from mf_fsdp.buckets.grad_state import GradState, Local, Reduced, check_invariant
from mf_fsdp.engine.sync_policy import SyncPolicy
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp.engine.test_accumulation import count_collectives

CLEAN_NONE = {(Local.CLEAN, Reduced.NONE)}


def test_grad_state_transitions_and_refusals() -> None:
    state = GradState(3, "the bucket of 'w'")
    state.accumulate()
    state.accumulate()  # more micro-batches
    state.launch()
    state.land(outer_due=True, hybrid=False)
    assert (state.local, state.reduced) == (Local.CLEAN, Reduced.INNER)
    state.reduce_outer()
    assert state.reduced is Reduced.FULL
    state.set_aside()
    assert state.reduced is Reduced.NONE
    state.accumulate()
    state.launch()
    state.land(outer_due=False, hybrid=True)  # hybrid: the result waits in pending
    assert (state.local, state.reduced) == (Local.CLEAN, Reduced.NONE)
    state.reduce_outer()
    assert state.reduced is Reduced.FULL
    state.reset()
    assert (state.local, state.reduced) == (Local.CLEAN, Reduced.NONE)
    refused = [
        (state.launch, "launch with local grads clean and store none"),
        (state.set_aside, "set_aside with local grads clean and store none"),
    ]
    state.accumulate()
    state.launch()
    refused_in_flight = [
        (state.accumulate, "accumulate with local grads reducing"),
        (state.reset, "reset with local grads reducing"),
        (state.reduce_outer, "reduce_outer with local grads reducing"),
    ]
    for call, message in refused_in_flight:
        with pytest.raises(RuntimeError, match=rf"on rank 3, the bucket of 'w': {message}"):
            call()
    state.land(outer_due=False, hybrid=False)
    state.reset()
    for call, message in refused:
        with pytest.raises(RuntimeError, match=f"internal error on rank 3, .*: {message}"):
            call()
    with pytest.raises(RuntimeError, match="mf_fsdp internal error on rank 1, b: broken"):
        check_invariant(False, 1, "b", "broken")


@pytest.mark.parametrize("shards_grads", [False, True])
def test_sync_policy_table(shards_grads: bool) -> None:
    policy = SyncPolicy(shards_grads=shards_grads, auto_sync=False)
    # A plain micro-batch: ZeRO-2/3 reduce at every unit end, ZeRO-0/1 accumulate.
    assert policy.reduce_at_unit_end() is shards_grads
    assert not policy.wait_at_backward_end()
    with policy.no_sync():
        assert not policy.reduce_at_unit_end()  # nothing, for every strategy
        assert not policy.last_microbatch
    assert policy.last_microbatch  # the backward after no_sync is the last one
    assert policy.reduce_at_unit_end()
    assert policy.outer_at_backward_end()
    with policy.sync():
        assert policy.wait_at_backward_end()
        with policy.no_sync():
            assert not policy.wait_at_backward_end()
    assert not policy.auto_sync
    policy.backward_ended()
    assert policy.microbatch_count == 1
    policy.step_finished()
    assert (policy.microbatch_count, policy.last_microbatch) == (0, False)
    assert not policy.outer_at_backward_end()


def _inputs(micro: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * micro + rank))


# The scaled case: the per-token sum over ranks, times gradient_scaling_factor. Its
# reductions do not leave a reduced value unchanged when it is reduced again, so
# it shows that accumulating after a reduction never re-reduces the reduced part.
SCALED = {"calculate_per_token_loss": True, "gradient_scaling_factor": 0.5}


def _reference_grads(module: nn.Module, micros: list[int], world: int, scaled: bool) -> dict:
    """Grads of the mean (scaled: 0.5 x the sum) over ranks of the losses, over ``micros``."""
    reference = copy.deepcopy(module)
    factor = 0.5 if scaled else 1 / world
    for micro in micros:
        for rank in range(world):
            (reference(_inputs(micro, rank)).pow(2).sum() * factor).backward()
    return {name: p.grad.clone() for name, p in reference.named_parameters()}


def _grads(model: mf_fsdp.MegatronFSDP) -> dict:
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        for name, p in model.named_parameters()
    }


def _check_grads(model, module, micros, world, label, scaled) -> None:
    expected = _reference_grads(module, micros, world, scaled)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=label)


def _rank_drive(rank: int, world: int, level: int, hsdp: bool, scaled: bool) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    original = copy.deepcopy(module)
    mesh = cpu_mesh((world, 1), ("dp_outer", "dp_shard")) if hsdp else None
    model = mf_fsdp.fully_shard_model(
        module,
        device_mesh=mesh,
        dp_shard_dim="dp_shard" if hsdp else None,
        dp_outer_dim="dp_outer" if hsdp else None,
        zero_dp_strategy=level,
        sync_model_each_microbatch=False,
        **(SCALED if scaled else {}),
    )
    groups = [g for g in model.groups if g.requires_grad]
    outer = model.get_distributed_index().get_outer_fsdp_group()

    def states() -> set:
        return {(g.grads.local, g.grads.reduced) for g in groups}

    def backward(micro: int) -> None:
        model(_inputs(micro, rank)).pow(2).sum().backward()

    # no_sync: grads accumulate locally, nothing is reduced (ZeRO-3 still gathers weights).
    with count_collectives() as counts, model.no_sync():
        backward(0)
    assert counts["all_reduce"] + counts["reduce_scatter_into"] == 0, counts
    assert states() == {(Local.ACCUMULATED, Reduced.NONE)}
    # The last micro-batch reduces; without auto-sync the wait comes before the step.
    with count_collectives(outer) as outer_counts:
        backward(1)
        assert Reduced.FULL not in {r for _, r in states()} or outer is None
        model.finish_grad_sync()
        model.finish_grad_sync()  # idempotent: the dp_outer stage runs once per step
    assert states() == {(Local.CLEAN, Reduced.FULL)}
    if outer is not None:
        assert outer_counts["all_reduce"] == len(groups), outer_counts
    _check_grads(model, original, [0, 1], world, "no_sync then the last micro-batch", scaled)
    # Accumulating after a reduction (no zero_grad): the reduced grads keep their value.
    backward(2)
    model.finish_grad_sync()
    assert states() == {(Local.CLEAN, Reduced.FULL)}
    _check_grads(model, original, [0, 1, 2], world, "accumulating after a reduction", scaled)
    # zero_grad with reduced grads, then sync(): each backward ends fully reduced.
    model.zero_grad()
    assert states() == CLEAN_NONE
    with model.sync(), model.no_sync():
        backward(3)
    with model.sync():
        backward(4)  # the last micro-batch: waits and runs dp_outer at the backward's end
        assert states() == {(Local.CLEAN, Reduced.FULL)}
    model.finish_grad_sync()
    _check_grads(model, original, [3, 4], world, "sync()", scaled)
    # zero_grad with local grads accumulated, and with a reduction in flight.
    model.zero_grad()
    with model.no_sync():
        backward(5)
    model.zero_grad()
    assert states() == CLEAN_NONE
    with model.no_sync():
        backward(6)
    model.start_grad_sync()
    assert states() == {(Local.REDUCING, Reduced.NONE)}
    model.zero_grad()
    assert states() == CLEAN_NONE
    for group in groups:
        assert not group.grad_store.any()
    backward(7)
    model.finish_grad_sync()
    _check_grads(model, original, [7], world, "after zero_grad in flight", scaled)
    # set_model_auto_sync, the reference's switch: on, the last micro-batch's backward
    # ends with every reduction landed (HSDP: the dp_outer stage too), before any
    # finish_grad_sync; off again, the wait moves back to the step.
    model.zero_grad()
    model.set_model_auto_sync(True)
    assert model.model_auto_sync
    with model.no_sync():
        backward(8)
    backward(9)
    assert states() == {(Local.CLEAN, Reduced.FULL)}
    _check_grads(model, original, [8, 9], world, "set_model_auto_sync(True)", scaled)
    model.set_model_auto_sync(False)
    assert not model.model_auto_sync
    model.zero_grad()
    with model.no_sync():
        backward(10)
    backward(11)
    assert states() == {(Local.REDUCING, Reduced.NONE)}
    model.finish_grad_sync()
    _check_grads(model, original, [10, 11], world, "set_model_auto_sync(False)", scaled)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("level", "scaled"), [(0, False), (1, False), (2, False), (3, False), (0, True), (1, True)]
)
def test_every_sync_transition_on_ranks(level: int, scaled: bool) -> None:
    run_on_ranks(_rank_drive, 2, level, False, scaled, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("level", [0, 3])
def test_every_sync_transition_with_hsdp(level: int) -> None:
    """Replicated HSDP: the dp_outer all-reduce once per step, fully reduced grads kept
    aside while newer ones are reduced (scaled, so a second outer pass would show)."""
    run_on_ranks(_rank_drive, 2, level, True, True, timeout=120)
