"""Training parity: every strategy at world 2 (ZeRO-3 also at 4) against one process.

Tolerance: 1e-5 relative (fp32). The sharded run sums the same per-sample
gradients in a different order (collective vs. one backward over the global
batch), so results differ only by float rounding, far below 1e-5 after 10
steps; any scaling error (the contract) shows up at O(1) with SGD.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mf_fsdp
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    full_params,
    make_model,
    make_optimizer,
    reference_run,
    unit_classes,
)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 10


def _train(model, opt, rank: int, world: int, steps: int, micro: int = 1, no_sync: bool = False):
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(micro):
            tokens, targets = batch(step, rank, m)
            last = m == micro - 1
            if no_sync and not last:
                with model.no_sync():
                    loss = model(tokens, targets) / micro
                    loss.backward()
            else:
                loss = model(tokens, targets) / micro
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    return losses


def _check(losses, params, ref_losses, ref_params, label: str) -> None:
    assert params.keys() == ref_params.keys(), label
    assert_matches_reference(losses, params, ref_losses, ref_params, label, RTOL, ATOL)


def _rank_parity(rank: int, world: int, strategies: list[int], optimizers: list[str]) -> None:
    for opt_name in optimizers:
        ref_losses, ref_params = reference_run(opt_name, world, STEPS)
        for strategy in strategies:
            module = make_model()
            opt = make_optimizer(opt_name, module.parameters())
            model, opt = mf_fsdp.fully_shard(
                module, opt, fsdp_unit_modules=unit_classes(), zero_dp_strategy=strategy
            )
            losses = _train(model, opt, rank, world, STEPS)
            _check(losses, full_params(model), ref_losses, ref_params, f"{opt_name} z{strategy}")
    # Options that change scheduling or grouping, never the result: a dotted unit
    # path with synchronous collectives, and one bucket for the whole model.
    ref_losses, ref_params = reference_run("sgd", world, STEPS)
    for options in (
        {"overlap_grad_reduce": False, "overlap_param_gather": False},
        {"disable_bucketing": True},
    ):
        module = make_model()
        opt = make_optimizer("sgd", module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module, opt, fsdp_unit_modules=["mf.models.gpt.Block"], **options
        )
        assert len(model.bucket_stats()) == (1 if options.get("disable_bucketing") else 3)
        losses = _train(model, opt, rank, world, STEPS)
        _check(losses, full_params(model), ref_losses, ref_params, f"z3 {options}")


@pytest.mark.multiprocess
def test_parity_all_strategies_world2() -> None:
    run_on_ranks(_rank_parity, 2, [0, 1, 2, 3], ["sgd", "adam"], timeout=240)


@pytest.mark.multiprocess
def test_parity_zero3_world4() -> None:
    # World 4 puts several ranks' shard boundaries inside one tensor and leaves some
    # pieces empty.
    run_on_ranks(_rank_parity, 4, [3], ["sgd"], timeout=240)
