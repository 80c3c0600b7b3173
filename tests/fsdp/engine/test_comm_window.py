"""The communication window: small units share collectives, and nothing else changes.

With ``suggested_communication_unit_size`` (the default), the tiny GPT's root
and blocks fit in one window: a ZeRO-3 step gathers once in forward, keeps
the blocks gathered into backward and reduces once, where each unit alone
(window 0) takes a collective per bucket and pass. Both runs must give the
same bits (packing changes no sum), in every strategy, with SGD and Adam;
the parity suites check the default against one process. What a forward
leaves gathered for its backward (the root, the units the backward starts
with) must never be used with stale weights when that backward never comes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mf_fsdp
from mf.bench.comm_counter import CommCounter
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    CONFIG,
    batch,
    full_params,
    make_model,
    make_optimizer,
    unit_classes,
)

STEPS = 3


def _train(strategy: int, optimizer: str, window: int, rank: int, config=CONFIG, probe=None):
    """Train STEPS steps; the model, losses, full params and the last step's collectives.

    ``probe(model)`` runs before every block's forward.
    """
    module = make_model(config=config)
    if probe is not None:
        for block in module.blocks:
            block.register_forward_pre_hook(lambda *_: probe(model))
    model, opt = mf_fsdp.fully_shard(
        module,
        make_optimizer(optimizer, module.parameters()),
        fsdp_unit_modules=unit_classes(),
        zero_dp_strategy=strategy,
        suggested_communication_unit_size=window,
    )
    counter = CommCounter()
    losses = []
    with counter.installed():
        for step in range(STEPS):
            counter.reset()
            counter.enabled = True
            loss = model(*batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            counter.enabled = False
            losses.append(loss.item())
    return model, losses, full_params(model), dict(counter.calls)


def _rank_same_bits_fewer_collectives(rank: int, world: int) -> None:
    for strategy in range(4):
        for optimizer in ("sgd", "adam"):
            model, alone, alone_params, alone_calls = _train(strategy, optimizer, 0, rank)
            buckets = len(model.groups)
            default = mf_fsdp.DEFAULT_COMMUNICATION_UNIT_SIZE
            assert sum(g.layout.padded_numel for g in model.groups) < default
            _, packed, packed_params, packed_calls = _train(strategy, optimizer, default, rank)
            label = f"ZeRO-{strategy} {optimizer}"
            assert packed == alone, label
            for name, value in alone_params.items():
                assert torch.equal(packed_params[name], value), (label, name)
            # Collectives of a steady step (the last): one per bucket and pass alone
            # (ZeRO-3: the last block is gathered once, it stays gathered into its
            # backward), one per pass when the whole model fits in the window (on gloo a
            # packed reduce-scatter is an all-reduce of the pack, see coalescing._run_pack).
            if strategy == 0:
                alone_want, packed_want = {"all_reduce": buckets}, {"all_reduce": 1}
            elif strategy in (1, 2):
                alone_want = {"reduce_scatter_single": buckets, "all_gather_single": buckets}
                packed_want = {"all_reduce": 1, "all_gather_single": 1}
            else:
                gathers = 2 * buckets - 2  # the root once, the last block once
                alone_want = {"reduce_scatter_single": buckets, "all_gather_single": gathers}
                packed_want = {"all_reduce": 1, "all_gather_single": 1}
            assert alone_calls == alone_want, (label, alone_calls)
            assert packed_calls == packed_want, (label, packed_calls)


def _rank_small_units_gather_in_chunks(rank: int, world: int) -> None:
    # 8 blocks and a window of 4: sliding one block ahead per block run, the window
    # would take in one block at a time, a collective each (9 all-gathers a step).
    config = dataclasses.replace(CONFIG, n_layers=8)
    model, alone, alone_params, _ = _train(3, "sgd", 0, rank, config)
    root, block = (group.layout.padded_numel for group in model.groups[:2])
    window = 4 * block
    held: list[int] = []

    def probe(model: mf_fsdp.MegatronFSDP) -> None:
        held.append(sum(g.layout.padded_numel for g in model.groups if not g.released))

    model, chunked, chunked_params, calls = _train(3, "sgd", window, rank, config, probe)
    assert chunked == alone
    for name, value in alone_params.items():
        assert torch.equal(chunked_params[name], value), name
    # Forward: the root with blocks 0-2, then 3-5 (due at block 1, when half the
    # window is released), then 6-7 (at block 3); the backward walks back alike.
    assert calls["all_gather_single"] == 6, calls
    # Never more than the window ahead: the root, the running block and the window.
    assert len(model.groups) == 9
    assert max(held) <= root + block + window, (max(held), window)


def _rank_kept_units_never_go_stale(rank: int, world: int) -> None:
    module = make_model()
    model, opt = mf_fsdp.fully_shard(
        module, make_optimizer("sgd", module.parameters()), fsdp_unit_modules=unit_classes()
    )
    model(*batch(0, rank)).backward()  # records the order: the blocks are kept from now on
    opt.zero_grad()
    tokens, targets = batch(1, rank)
    model(tokens, targets)  # a forward with grad whose backward never comes
    assert any(g.gathered for g in model.groups), "the root and the last units stay gathered"
    with torch.no_grad():  # the weights change under the kept units
        for param in opt.param_groups[0]["params"]:
            param.to_local().mul_(0.5)
        got = model(tokens, targets)
    assert not any(g.gathered for g in model.groups), "a forward without backward keeps none"
    reference = make_model()
    with torch.no_grad():
        for param in reference.parameters():
            param.mul_(0.5)
        expected = reference(tokens, targets)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Training goes on from there as usual.
    model(tokens, targets).backward()
    opt.step()
    assert not any(g.gathered for g in model.groups)


@pytest.mark.multiprocess
def test_packed_collectives_give_the_same_bits_in_fewer_calls() -> None:
    run_on_ranks(_rank_same_bits_fewer_collectives, 2, timeout=240)


@pytest.mark.multiprocess
def test_small_units_gather_in_chunks_of_half_a_window() -> None:
    run_on_ranks(_rank_small_units_gather_in_chunks, 2, timeout=240)


@pytest.mark.multiprocess
def test_units_kept_gathered_after_forward_never_go_stale() -> None:
    run_on_ranks(_rank_kept_units_never_go_stale, 2, timeout=120)


def test_the_window_is_validated() -> None:
    for bad in (-1, 1.5, True, "big"):
        with pytest.raises(ValueError, match="suggested_communication_unit_size"):
            mf_fsdp.DistributedDataParallelConfig(suggested_communication_unit_size=bad)
