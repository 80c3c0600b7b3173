"""FSDP2's interface on mf's engine (``mf_fsdp.fsdp2.fully_shard``), against one process.

The tiny GPT is wrapped as torchtitan wraps a model: every ``Block``, then the
final norm and LM head as one unit (``fully_shard([ln_f, lm_head])``; the LM
head's weight is tied to the token embedding, so it stays the root's), then the
root; the optimizer is built afterwards on ``model.parameters()``. At world 2:

- 5 steps of SGD and Adam in fp32 give the losses and final weights of one
  process on the global batch (1e-5: the ranks' halves are reduced in another
  order than one process sums them); the optimizer, built on
  ``model.parameters()`` and never bound by ``fully_shard_optimizer``, takes mf's
  step path (multi-tensor, on the local pieces) from its first step;
- bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``)
  gives torch's own FSDP2 losses under the same policy (same casts, same world)
  within 1e-2, and trains as the fp32 reference does (``assert_bf16_trained``: losses
  and every parameter, as torch's FSDP2 does under the same check);
- ``set_requires_gradient_sync(False)`` for the first of 2 micro-batches equals
  one process stepping on the whole;
- DSD's ``get_state_dict`` / ``set_state_dict`` round trip into a fresh model;
- every option and ``FSDPModule`` method mf cannot honour raises naming itself.
"""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_param_group
from torch.distributed.tensor import DTensor

from mf_fsdp import fsdp2
from mf_fsdp.fsdp2.entry import reshard_flag
from mf_fsdp.fsdp2.module import UNSUPPORTED
from mf_fsdp.fsdp2.records import record_of
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_bf16_trained,
    assert_matches_reference,
    batch,
    full_params,
    initial_params,
    make_model,
    make_optimizer,
    optimizer_step,
    reference_run,
)
from tests.fsdp._issued import REDUCTIONS, spy_collectives

WORLD = 2
STEPS = 5
TOL = {"rtol": 1e-5, "atol": 1e-5}


def shard_like_torchtitan(
    model: torch.nn.Module, shard=fsdp2.fully_shard, head_unit: bool = True, **options
) -> None:
    """Blocks, then ``[ln_f, lm_head]`` as one unit, then the root (torchtitan's order).

    ``head_unit=False`` leaves the head to the root: torch's FSDP2 refuses a unit
    whose weight is tied to one outside it (mf gives such a weight to the root).
    """
    for block in model.blocks:
        shard(block, **options)
    if head_unit:
        shard([model.ln_f, model.lm_head], **options)
    shard(model, **options)


def _train(model, opt, rank: int, steps: int = STEPS) -> list[float]:
    return [optimizer_step(model(*batch(step, rank)), opt, WORLD) for step in range(steps)]


def _rank_parity(rank: int, world: int, opt_name: str) -> None:
    model = make_model()
    shard_like_torchtitan(model)
    assert isinstance(model, TorchFSDPModule)
    assert isinstance(model.blocks[0], TorchFSDPModule)
    opt = make_optimizer(opt_name, model.parameters())
    assert all(isinstance(p, DTensor) for p in model.parameters())
    losses = _train(model, opt, rank)
    # Bound at its first step (never passed to fully_shard_optimizer): mf's step path,
    # multi-tensor kernels on the local pieces, and the sharded parameters given back.
    assert all(group["foreach"] for group in opt.param_groups)
    assert all(isinstance(p, DTensor) for group in opt.param_groups for p in group["params"])
    ref_losses, ref_params = reference_run(opt_name, world, STEPS)
    assert model.state_dict().keys() == make_model().state_dict().keys()
    assert_matches_reference(
        losses, full_params(model), ref_losses, ref_params, f"fsdp2 {opt_name}", **TOL
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_torchtitan_style_wrapping_trains_like_one_process(opt_name: str) -> None:
    run_on_ranks(_rank_parity, WORLD, opt_name, timeout=180)


def _rank_bf16(rank: int, world: int) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs, params = {}, {}
    for name, shard in (("mf", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = make_model()
        shard_like_torchtitan(model, shard, head_unit=False, mp_policy=policy)
        runs[name] = _train(model, make_optimizer("adam", model.parameters()), rank)
        params[name] = full_params(model)
    torch.testing.assert_close(
        torch.tensor(runs["mf"]), torch.tensor(runs["torch"]), rtol=1e-2, atol=0.0
    )
    fp32_losses, fp32_params = reference_run("adam", world, STEPS)
    initial = initial_params()
    for name in ("mf", "torch"):  # torch's FSDP2 shows what the tolerances allow
        label = f"fsdp2 bf16 ({name})"
        assert_bf16_trained(
            runs[name], params[name], fp32_losses, fp32_params, initial, label, "adam"
        )


@pytest.mark.multiprocess
def test_bf16_param_dtype_matches_torch_fsdp2_with_the_same_policy() -> None:
    run_on_ranks(_rank_bf16, WORLD, timeout=240)


def _torch_reduce_dtypes(into: list[torch.dtype]):
    """A stand-in for FSDP2's ``foreach_reduce`` that records the dtype it reduces in.

    Read by name, as the signature moved between torch releases: ``reduce_dtype``,
    or where it is None (torch 2.11), the gradients' own dtype, as FSDP2 then uses.
    """
    original = fsdp_param_group.foreach_reduce
    signature = inspect.signature(original)

    def spy(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        into.append(bound.arguments["reduce_dtype"] or bound.arguments["unsharded_grads"][0].dtype)
        return original(*args, **kwargs)

    return mock.patch.object(fsdp_param_group, "foreach_reduce", spy)


def _rank_default_reduce_dtype(rank: int, world: int) -> None:
    """bf16 compute over fp32 weights, ``reduce_dtype`` left None: torch's FSDP2 picks."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    reduced: dict[str, set[torch.dtype]] = {}
    runs = {}
    for name, shard in (("mf", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = make_model()
        shard_like_torchtitan(model, shard, head_unit=False, mp_policy=policy)
        opt = make_optimizer("sgd", model.parameters())
        torch_dtypes: list[torch.dtype] = []
        losses, mf_dtypes = [], []
        for step in range(STEPS):
            loss = model(*batch(step, rank))
            with spy_collectives() as issued, _torch_reduce_dtypes(torch_dtypes):
                loss.backward()  # only the backward: the loss's own all-reduce is not a grad's
            mf_dtypes += [call.dtype for call in issued if call.kind in REDUCTIONS]
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[name] = losses
        reduced[name] = set(mf_dtypes if name == "mf" else torch_dtypes)
        assert reduced[name], f"{name}: no reduction seen"
    assert reduced["mf"] == reduced["torch"], reduced
    torch.testing.assert_close(
        torch.tensor(runs["mf"]), torch.tensor(runs["torch"]), rtol=1e-2, atol=0.0
    )


@pytest.mark.multiprocess
def test_reduce_dtype_left_none_reduces_in_the_dtype_torch_fsdp2_picks() -> None:
    """torch 2.11 reduces in ``param_dtype``, torch 2.15 in the weights' own dtype."""
    run_on_ranks(_rank_default_reduce_dtype, WORLD, timeout=240)


def _weight_dtype_into(seen: dict[str, torch.dtype], key: str):
    """A forward pre-hook that records the dtype of the weight its module computes with."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault(key, module.weight.dtype)

    return hook


def _rank_policy_per_unit(rank: int, world: int) -> None:
    """The first block in bf16 (back to fp32 at its output), the rest in fp32."""
    bf16 = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    runs, seen = {}, {}
    for name, shard in (("mf", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = make_model()
        shard(model.blocks[0], mp_policy=bf16)
        shard(model.blocks[1])
        shard(model)
        weights: dict[str, torch.dtype] = {}
        for index, block in enumerate(model.blocks):
            block.attn.qkv.register_forward_pre_hook(_weight_dtype_into(weights, f"block {index}"))
        runs[name] = _train(model, make_optimizer("adam", model.parameters()), rank)
        seen[name] = weights
    assert seen["mf"] == seen["torch"] == {"block 0": torch.bfloat16, "block 1": torch.float32}
    torch.testing.assert_close(
        torch.tensor(runs["mf"]), torch.tensor(runs["torch"]), rtol=1e-3, atol=0.0
    )


@pytest.mark.multiprocess
def test_a_policy_per_unit_computes_each_unit_in_its_dtype_as_torch_fsdp2() -> None:
    run_on_ranks(_rank_policy_per_unit, WORLD, timeout=240)


def _rank_cpu_offload(rank: int, world: int) -> None:
    for opt_name in ("sgd", "adam"):
        model = make_model()
        shard_like_torchtitan(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = make_optimizer(opt_name, model.parameters())
        losses = []
        for step in range(STEPS):
            # torch's loop zeroes in place every other step: the engine must see it too.
            opt.zero_grad(set_to_none=step % 2 == 0)
            loss = model(*batch(step, rank))
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        assert record_of(model).engine.offloads_optimizer_state
        ref_losses, ref_params = reference_run(opt_name, world, STEPS)
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, f"{opt_name} offload", **TOL
        )
    model = make_model()
    fsdp2.fully_shard(model.blocks[0], offload_policy=CPUOffloadPolicy())
    fsdp2.fully_shard(model)
    with pytest.raises(NotImplementedError, match="offload_policy differs between calls"):
        model(*batch(0, rank))


@pytest.mark.multiprocess
def test_cpu_offload_policy_runs_mfs_host_side_optimizer_state() -> None:
    """``CPUOffloadPolicy``: mf's ``offload_optimizer_state`` (weights, grads and state on
    the host), one process's losses with SGD and Adam, in-place ``zero_grad`` included."""
    run_on_ranks(_rank_cpu_offload, WORLD, timeout=240)


def _rank_accumulation(rank: int, world: int) -> None:
    model = make_model()
    shard_like_torchtitan(model)
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for step in range(3):
        total = torch.zeros(())
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            loss = model(*batch(step, rank, micro)) / 2
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    ref_losses, ref_params = reference_run("sgd", world, 3, micro=2)
    assert_matches_reference(
        losses, full_params(model), ref_losses, ref_params, "no-sync accumulation", **TOL
    )


@pytest.mark.multiprocess
def test_requires_gradient_sync_false_accumulates_like_one_process() -> None:
    run_on_ranks(_rank_accumulation, WORLD, timeout=180)


def _rank_dsd(rank: int, world: int) -> None:
    model = make_model()
    shard_like_torchtitan(model)
    opt = make_optimizer("adam", model.parameters())
    _train(model, opt, rank, steps=2)
    model_sd, optim_sd = get_state_dict(model, opt)
    assert model_sd.keys() == make_model().state_dict().keys()
    fresh = make_model(seed=1)
    shard_like_torchtitan(fresh)
    fresh_opt = make_optimizer("adam", fresh.parameters())
    set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    expected = full_params(model)
    for name, value in full_params(fresh).items():
        assert torch.equal(value, expected[name]), name
    after = _train(model, opt, rank, steps=1)
    assert _train(fresh, fresh_opt, rank, steps=1) == after  # Adam's state came along


@pytest.mark.multiprocess
def test_dsd_state_dict_round_trip() -> None:
    run_on_ranks(_rank_dsd, WORLD, timeout=180)


def _rank_unsupported(rank: int, world: int) -> None:
    with pytest.raises(TypeError, match="shard_placement_fn must be a callable or None"):
        fsdp2.fully_shard(make_model(), shard_placement_fn=3)
    # An int reshard_after_forward is a group size, as FSDP2's: the shard group's
    # size is True, 1 is False; it must divide the shard group's size.
    for size, flag in ((world, True), (1, False)):
        model = make_model()
        fsdp2.fully_shard(model, reshard_after_forward=size)
        assert record_of(model).reshard_after_forward is flag
    with pytest.raises(ValueError, match="reshard_after_forward=3: an int must divide"):
        fsdp2.fully_shard(make_model(), reshard_after_forward=3)
    with pytest.raises(TypeError, match="mp_policy"):
        fsdp2.fully_shard(make_model(), mp_policy=object())
    model = make_model()
    shard_like_torchtitan(model)
    with pytest.raises(AssertionError, match="already passed to fully_shard"):
        fsdp2.fully_shard(model)
    for name in UNSUPPORTED:
        with pytest.raises(NotImplementedError, match=f"FSDPModule.{name}"):
            getattr(model, name)()
    model.set_requires_gradient_sync(False)  # the whole model: one unit cannot sync alone
    with pytest.raises(NotImplementedError, match=r"set_requires_gradient_sync\(True\) on one"):
        model.blocks[0].set_requires_gradient_sync(True)
    model.set_requires_gradient_sync(True)
    with pytest.raises(NotImplementedError, match="set_modules_to_forward_prefetch on the root"):
        model.set_modules_to_forward_prefetch([model.blocks[0]])
    with pytest.raises(ValueError, match="set_modules_to_backward_prefetch: Linear"):
        model.blocks[1].set_modules_to_backward_prefetch([torch.nn.Linear(1, 1)])
    with pytest.raises(NotImplementedError, match="to\\(\\)"):
        model.to(torch.float64)
    # Every public method of torch's FSDPModule is mf's own (honoured or raising).
    public = {n for n, v in vars(TorchFSDPModule).items() if callable(v) and n[0] != "_"}
    assert all(n in vars(fsdp2.FSDPModule) for n in public)


@pytest.mark.multiprocess
def test_unsupported_options_and_methods_raise_naming_themselves() -> None:
    run_on_ranks(_rank_unsupported, WORLD, timeout=120)


class _ShardMesh:
    """What ``reshard_flag`` reads of a (replicate 2, shard 4) mesh: dims and sizes."""

    ndim = 2

    def size(self, dim: int) -> int:
        return {0: 2, 1: 4}[dim]


def test_int_reshard_after_forward_to_a_smaller_group_raises_naming_it() -> None:
    """FSDP2 reshards to a group of 2 of 4 shard ranks; mf has no such group."""
    assert reshard_flag(4, _ShardMesh()) is True
    assert reshard_flag(1, _ShardMesh()) is False
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2 .* 2 of the 4 shard"):
        reshard_flag(2, _ShardMesh())
    with pytest.raises(TypeError, match="reshard_after_forward must be"):
        reshard_flag(2.0, _ShardMesh())
