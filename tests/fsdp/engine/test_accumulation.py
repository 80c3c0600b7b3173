"""The gradient-reduction contract under accumulation, scaling options and deferred sync.

Every case trains with plain SGD (a wrong gradient scale changes the result at
O(1)) and compares to one process at 1e-5 relative (fp32 rounding only).
Collectives are counted to prove that no_sync micro-batches communicate
nothing and that a never-flagged last micro-batch still gets reduced once,
before the step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import mf_fsdp
from mf_fsdp.buckets import collectives
from tests._multiprocess import cpu_mesh, run_on_ranks
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
STEPS, MICRO = 3, 4
COUNTED = ("all_reduce", "reduce_scatter_into", "all_gather_into")


@contextlib.contextmanager
def count_collectives(group: dist.ProcessGroup | None = None) -> Iterator[dict[str, int]]:
    """Count calls of the engine's collectives (patched on ``mf_fsdp.buckets.collectives``).

    With ``group``, only the calls on exactly that group count.
    """
    counts = dict.fromkeys(COUNTED, 0)
    originals = {name: getattr(collectives, name) for name in COUNTED}

    def wrap(name):
        signature = inspect.signature(originals[name])

        def counted(*args, **kwargs):
            if group is None or signature.bind(*args, **kwargs).arguments["group"] is group:
                counts[name] += 1
            return originals[name](*args, **kwargs)

        return counted

    for name in COUNTED:
        setattr(collectives, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)


def _check(model, losses, ref, label: str) -> None:
    assert_matches_reference(losses, full_params(model), *ref, label, RTOL, ATOL)


def _train(model, opt, rank, world, *, micro, no_sync, per_token=False, check_silent=False):
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(micro):
            tokens, targets = batch(step, rank, m)
            quiet = no_sync and m < micro - 1
            ctx = model.no_sync() if quiet else contextlib.nullcontext()
            with ctx, count_collectives() as counts:
                loss = model(tokens, targets) / micro
                loss.backward()
            reductions = counts["all_reduce"] + counts["reduce_scatter_into"]
            if quiet or check_silent:
                assert reductions == 0, f"micro-batch {m} communicated: {counts}"
            total += loss.detach()
        dist.all_reduce(total)
        with count_collectives() as counts:
            opt.step()
        if check_silent:  # the never-flagged last micro-batch is reduced by step()
            assert counts["all_reduce"] + counts["reduce_scatter_into"] == len(model.groups)
        opt.zero_grad()
        losses.append(total.item() / (1 if per_token else world))
    return losses


def _rank_contract(rank: int, world: int) -> None:
    ref_micro = reference_run("sgd", world, STEPS, micro=MICRO)
    ref_one = reference_run("sgd", world, STEPS)
    ref_sum = reference_run("sgd", world, STEPS, per_token=True)
    mesh = cpu_mesh((world,), ("dp",))
    for strategy in range(4):

        def build(strategy: int = strategy, **kwargs):
            module = make_model()
            opt = make_optimizer("sgd", module.parameters())
            return mf_fsdp.fully_shard(
                module,
                opt,
                device_mesh=mesh,
                fsdp_unit_modules=unit_classes(),
                zero_dp_strategy=strategy,
                **kwargs,
            )

        model, opt = build()
        losses = _train(model, opt, rank, world, micro=MICRO, no_sync=True)
        _check(model, losses, ref_micro, f"z{strategy} no_sync")

        for in_collective in (False, True):
            model, opt = build(average_in_collective=in_collective)
            # Over gloo the mean is taken in the collective either way: no bucket is
            # multiplied by 1/N on the main thread before its reduction.
            assert collectives.divides_after_reduction(dist.group.WORLD)
            spec = [(g.reduce_spec.pre, g.reduce_spec.op) for g in model.groups]
            assert all(pre == 1.0 and op == dist.ReduceOp.AVG for pre, op in spec), spec
            losses = _train(model, opt, rank, world, micro=1, no_sync=False)
            _check(model, losses, ref_one, f"z{strategy} average_in_collective={in_collective}")

        model, opt = build(calculate_per_token_loss=True)
        losses = _train(model, opt, rank, world, micro=1, no_sync=False, per_token=True)
        _check(model, losses, ref_sum, f"z{strategy} per-token sum")

        # MegatronFSDP's own default: no auto-sync; the user never flags the last
        # micro-batch. ZeRO-0/1 defer every reduction; step() must still reduce.
        index = mf_fsdp.FSDPDistributedIndex(mesh)
        config = mf_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        module = make_model()
        opt = make_optimizer("sgd", module.parameters())
        model = mf_fsdp.MegatronFSDP(module, index, config, fsdp_unit_modules=unit_classes())
        opt = mf_fsdp.fully_shard_optimizer(opt)
        losses = _train(
            model, opt, rank, world, micro=MICRO, no_sync=False, check_silent=strategy <= 1
        )
        _check(model, losses, ref_micro, f"z{strategy} never-flagged")


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_reduction_contract_all_strategies(world: int) -> None:
    """World 1 too: there ZeRO-2/3 keep fp32 grads in one buffer (the reduction over a
    group of one is the local grads), and micro-batches must still add up."""
    run_on_ranks(_rank_contract, world, timeout=240)


def _plain_bf16_micro_grads(rank: int, micro: int) -> dict[str, torch.Tensor]:
    """This rank's micro-batch grads of a bf16 copy of the model, summed in fp32."""
    model = make_model().to(torch.bfloat16)
    total: dict[str, torch.Tensor] = {}
    for m in range(micro):
        (model(*batch(0, rank, m)) / micro).backward()
        for name, param in model.named_parameters():
            total[name] = total.get(name, 0) + param.grad.float()
            param.grad = None
    return total


def _rank_bf16_accumulation(rank: int, world: int) -> None:
    from torch.distributed.tensor import DTensor

    expected = _plain_bf16_micro_grads(rank, MICRO)
    for grad in expected.values():
        dist.all_reduce(grad)
        grad /= world
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for strategy in (1, 2, 3):
        module = make_model()
        model, _ = mf_fsdp.fully_shard(
            module,
            make_optimizer("sgd", module.parameters()),
            fsdp_unit_modules=unit_classes(),
            zero_dp_strategy=strategy,
            mixed_precision_policy=policy,
        )
        label = f"ZeRO-{strategy}"
        for m in range(MICRO):
            sync = contextlib.nullcontext() if m == MICRO - 1 else model.no_sync()
            with sync:
                (model(*batch(0, rank, m)) / MICRO).backward()
        model.finish_grad_sync()
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(
                grad.float(),
                expected[name],
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, where=f"{label} {name}": f"{where}: {m}",
            )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_micro_batches_accumulate_in_the_reduction_dtype(world: int) -> None:
    """bf16 compute: ``no_sync`` micro-batch grads are summed in fp32 (FSDP2's
    ``reduce_dtype``, Megatron's main grads), not in bf16, which rounds away what each
    adds: the reduced grads equal each micro-batch's bf16 grads summed in fp32. At
    world 1 the local grads are cast straight into the store (the reduction over a
    group of one is the identity)."""
    run_on_ranks(_rank_bf16_accumulation, world, timeout=150)


FROZEN = ("blocks.1.attn.qkv.weight", "wte.weight")  # a unit's parameter, a root one


def _freeze(named: dict[str, torch.Tensor]) -> None:
    """Replace the grads of ``FROZEN`` with new zero tensors (gradient surgery)."""
    for name in FROZEN:
        named[name].grad = torch.zeros_like(named[name].grad)


def _rank_replaced_grads(rank: int, world: int) -> None:
    reference = make_model()
    reference_opt = make_optimizer("sgd", reference.parameters())
    for step in range(STEPS):
        for r in range(world):
            (reference(*batch(step, r)) / world).backward()
        _freeze(dict(reference.named_parameters()))
        reference_opt.step()
        reference_opt.zero_grad()
    mesh = cpu_mesh((world,), ("dp",))
    for strategy in range(4):
        module = make_model()
        model, opt = mf_fsdp.fully_shard(
            module,
            make_optimizer("sgd", module.parameters()),
            device_mesh=mesh,
            fsdp_unit_modules=unit_classes(),
            zero_dp_strategy=strategy,
        )
        for step in range(STEPS):
            model(*batch(step, rank)).backward()
            _freeze(dict(model.named_parameters()))
            with count_collectives() as counts:
                opt.step()
            assert counts["all_reduce"] + counts["reduce_scatter_into"] == 0, counts
            opt.zero_grad()
        got = full_params(model)
        for name, expected in reference.named_parameters():
            torch.testing.assert_close(
                got[name], expected.detach(), rtol=RTOL, atol=ATOL, msg=f"z{strategy} {name}"
            )


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_grads_replaced_between_backward_and_step_are_what_the_step_uses(world: int) -> None:
    """Gradient surgery: ``p.grad = new`` after the backward (here zeros for one unit's
    parameter and one root parameter) is what ``step()`` uses, as in torch; the step
    reduces nothing again after a backward that did (SGD: a lost surgery moves them)."""
    run_on_ranks(_rank_replaced_grads, world, timeout=150)
