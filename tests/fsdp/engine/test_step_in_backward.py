"""``optimizer_step_in_backward``: each bucket stepped once reduced, against one process.

Parity: the tiny GPT trained 5 steps with the option on (ZeRO-2 and 3, world 2;
ZeRO-3 HSDP at world 4) against plain PyTorch on the global batch (same init,
same batches) for SGD, SGD with momentum and dampening (its first step differs
from the later ones), Adam and AdamW, with and without ``no_sync``
accumulation: losses and every weight at 1e-6, and bitwise equal to the same
run without the option (bf16 compute too). Memory: at the backward's end the
engine reports no gradient bytes with the option on, against ``4 / N`` bytes
per parameter without it (the sharded fp32 grads FSDP2 keeps until the step),
and every live CPU tensor counted agrees. Post-accumulate-grad hooks run per bucket before its step
and see the reduced grads they see without the option. Errors: ZeRO-0/1, global-norm
clipping, shape-aware optimizers and a model without a bound optimizer.
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
    reference_run,
    train_micro_batches,
    unit_classes,
    wrapped_model,
)
from tests.fsdp.buckets.test_memory_held import settled_live_cpu_bytes

RTOL = ATOL = 1e-6
"""Against one process (fp32). Accumulation runs SGD: Adam normalises each element by its
own gradient scale, so on an element whose gradient is zero up to rounding (the attention's
key bias) it turns a different summation order into a step of ``lr``; there the run is
checked bitwise against the same engine without the option instead."""
STEPS = 5
MICRO = 2


def _train(model, opt, rank: int, world: int, micro: int) -> tuple[list[float], list[int]]:
    """Train ``STEPS`` steps; the losses, and the grad bytes held after each last backward."""
    return train_micro_batches(model, opt, rank, world, micro, STEPS)


def _build(strategy: int, opt_name: str, on: bool, **options):
    return wrapped_model(strategy, opt_name, optimizer_step_in_backward=on, **options)


def _rank_parity(rank: int, world: int, cases: list[tuple[int, str, int]], options: dict) -> None:
    for strategy, opt_name, micro in cases:
        label = f"z{strategy} {opt_name} micro={micro} {options}"
        ref = reference_run(opt_name, world, STEPS, micro=micro)
        model, opt = _build(strategy, opt_name, True, **options)
        numel = sum(p.numel() for p in model.parameters())
        losses, held = _train(model, opt, rank, world, micro)
        params = full_params(model)
        assert held == [0] * STEPS, f"{label}: grad bytes held after the backward: {held}"
        # Without the option: the same arithmetic, with the sharded fp32 grads held
        # from the backward until the step.
        model, opt = _build(strategy, opt_name, False, **options)
        off_losses, held = _train(model, opt, rank, world, micro)
        assert_matches_reference(off_losses, full_params(model), losses, params, label, 0, 0)
        assert min(held) >= 4 * numel / world * 0.95, f"{label}: option off held {held}"
        assert_matches_reference(losses, params, *ref, label, RTOL, ATOL)


@pytest.mark.multiprocess
def test_zero3_sgd_adam_world2() -> None:
    cases = [(3, "sgd", 1), (3, "adam", 1), (3, "momentum", MICRO), (3, "adamw", 1)]
    run_on_ranks(_rank_parity, 2, cases, {}, timeout=300)


@pytest.mark.multiprocess
def test_world1() -> None:
    """Over a group of one ZeRO-2/3 keep fp32 grads in one buffer (the store is the
    local grads): a bucket stepped in the backward releases it all the same."""
    cases = [(3, "adam", 1), (2, "momentum", MICRO)]
    run_on_ranks(_rank_parity, 1, cases, {}, timeout=300)


@pytest.mark.multiprocess
def test_zero2_world2() -> None:
    cases = [(2, "sgd", MICRO), (2, "momentum", 1), (2, "adam", 1), (2, "adamw", 1)]
    run_on_ranks(_rank_parity, 2, cases, {}, timeout=300)


@pytest.mark.multiprocess
def test_synchronous_reductions_and_one_bucket_world2() -> None:
    # Reductions finished at once (no overlap), and the root holding every parameter.
    cases = [(3, "adam", 1)]
    run_on_ranks(
        _rank_parity, 2, cases, {"overlap_grad_reduce": False, "overlap_param_gather": False}
    )
    run_on_ranks(_rank_parity, 2, [(2, "momentum", 1)], {"disable_bucketing": True})


def _rank_hsdp(rank: int, world: int) -> None:
    mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    dims = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"}
    _rank_parity(rank, world, [(3, "sgd", 1), (3, "momentum", MICRO)], dims)
    # Hybrid-sharded: the dp_outer reduce-scatter, then the sub-shards' all-gather.
    _rank_parity(
        rank,
        world,
        [(3, "momentum", 1), (3, "sgd", MICRO)],
        {**dims, "outer_dp_sharding_strategy": 1},
    )


@pytest.mark.multiprocess
def test_hsdp_world4() -> None:
    run_on_ranks(_rank_hsdp, 4, timeout=300)


def _rank_bf16(rank: int, world: int) -> None:
    # bf16 compute, fp32 main weights: ZeRO-3 keeps only the fp32 shard (the gather
    # casts it), ZeRO-2 all-gathers the stepped shards into the bf16 weights.
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for strategy in (2, 3):
        runs = []
        for on in (True, False):
            model, opt = _build(strategy, "adam", on, mixed_precision_policy=policy)
            losses, held = _train(model, opt, rank, world, 1)
            runs.append((losses, full_params(model), held))
        (losses, params, held), (off_losses, off_params, _) = runs
        assert held == [0] * STEPS, f"z{strategy} bf16: grad bytes held: {held}"
        assert_matches_reference(off_losses, off_params, losses, params, f"z{strategy} bf16", 0, 0)


@pytest.mark.multiprocess
def test_bf16_same_as_without_the_option_world2() -> None:
    run_on_ranks(_rank_bf16, 2, timeout=240)


def _rank_live_bytes(rank: int, world: int, strategy: int) -> None:
    """Every live CPU tensor counted after a backward: the option drops 4 / N bytes per param."""
    held = {}
    for on in (True, False):
        model, opt = _build(strategy, "adam", on)
        numel = sum(p.numel() for p in model.parameters())
        for step in range(2):
            model(*batch(step, rank)).backward()
            if step == 1:
                held[on] = settled_live_cpu_bytes()
            opt.step()
            opt.zero_grad()
        del model, opt
    saved = (held[False] - held[True]) / (numel / world)
    assert 3.5 <= saved <= 4.5, f"z{strategy}: {saved:.2f} bytes per param/N saved, expected 4"


@pytest.mark.multiprocess
def test_live_bytes_after_backward_world2() -> None:
    run_on_ranks(_rank_live_bytes, 2, 3)
    run_on_ranks(_rank_live_bytes, 2, 2)


def _hooked_grads(strategy: int, on: bool, **options) -> list[list[torch.Tensor | None]]:
    """Each step's grads as post-accumulate-grad hooks saw them (one hook per parameter)."""
    model, opt = _build(strategy, "momentum", on, **options)
    params = list(model.parameters())
    seen: list[list[torch.Tensor | None]] = [[None] * len(params) for _ in range(STEPS)]
    step = [0]
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(
            lambda p, i=index: seen[step[0]].__setitem__(i, p.grad.detach().clone())
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    train_micro_batches(model, opt, rank, world, 1, STEPS, lambda s: step.__setitem__(0, s + 1))
    return seen


def _rank_post_accumulate_hooks(rank: int, world: int) -> None:
    for strategy, options in ((2, {}), (3, {}), (3, {"offload_optimizer_state": True})):
        off = _hooked_grads(strategy, False, **options)
        on = _hooked_grads(strategy, True, **options)
        assert all(g is not None for grads in off for g in grads), "every hook runs (option off)"
        assert all(g is not None for grads in on for g in grads), f"z{strategy}: hooks not run"
        torch.testing.assert_close(on, off, rtol=0, atol=0)  # the reduced grad, before the step


@pytest.mark.multiprocess
def test_post_accumulate_grad_hooks_see_the_reduced_grad_world2() -> None:
    """FSDP2 runs them once a parameter's reduced grad is in place: with the option, per
    bucket before its step (host steps: once the grads are copied to the host); the grads
    they see equal those seen without the option."""
    run_on_ranks(_rank_post_accumulate_hooks, 2, timeout=300)


def _rank_errors(rank: int, world: int) -> None:
    for strategy in (0, 1):
        with pytest.raises(ValueError, match=r"optimizer_step_in_backward=True needs .* got '"):
            _build(strategy, "sgd", True)
    model, _opt = _build(3, "adam", True)  # the engine holds its optimizers weakly
    model(*batch(0, rank)).backward()
    with pytest.raises(RuntimeError, match="clip_grad_norm_: .*optimizer_step_in_backward"):
        mf_fsdp.clip_grad_norm_(model, 1.0)
    with pytest.raises(RuntimeError, match="optimizer_step_in_backward"):
        mf_fsdp.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="get_grad_norm: .*optimizer_step_in_backward"):
        mf_fsdp.get_grad_norm(model)  # its grads are freed: the norm would be a silent 0
    # No optimizer bound: the first backward says so.
    model = mf_fsdp.fully_shard_model(
        make_model(), fsdp_unit_modules=unit_classes(), optimizer_step_in_backward=True
    )
    with pytest.raises(RuntimeError, match="no optimizer is bound"):
        model(*batch(0, rank)).backward()
    # A shape-aware optimizer (one step reads whole matrices) is refused by name.
    for cls in (getattr(torch.optim, "Adafactor", None), getattr(torch.optim, "Muon", None)):
        if cls is None:
            continue
        module = make_model()
        params = [p for p in module.parameters() if p.dim() == 2]
        with pytest.raises(ValueError, match=f"{cls.__qualname__} is not elementwise"):
            mf_fsdp.fully_shard(
                module, cls(params, lr=1e-2), zero_dp_strategy=3, optimizer_step_in_backward=True
            )
    with pytest.raises(TypeError, match="optimizer_step_in_backward: expected a bool"):
        mf_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=3,
            optimizer_step_in_backward=1,  # type: ignore[arg-type]
        )


@pytest.mark.multiprocess
def test_errors() -> None:
    run_on_ranks(_rank_errors, 2)
