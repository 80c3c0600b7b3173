"""``offload_optimizer_state``: main weights, grads' copy and optimizer state in host memory.

On the CPU host and device are one memory, so every check reads where the
engine keeps each tensor: the sharded parameters (what the optimizer steps)
are views of a host main-weight buffer of their own, their ``.grad`` views of
the host grads, the optimizer state tensors alike, and the device keeps the
compute weights only (ZeRO-3: its compute-dtype shard; ZeRO-1/2: the whole
bucket) plus the gradients being reduced.

Parity: the tiny GPT trained 5 steps with the option (ZeRO-1/2/3, world 2;
ZeRO-3 HSDP at world 4) against plain PyTorch on the global batch for SGD,
SGD with momentum, Adam and AdamW, with and without ``no_sync``
accumulation: losses and every weight at 1e-6, and bitwise equal to the same
run without the option. The same with ``optimizer_step_in_backward``, with
``clip_grad_norm_`` (SGD: the host grads the step reads are the clipped ones),
and for expert-parallel buckets; with bf16 compute (the host weights cast into
the device's bf16 ones), bitwise equal to the run without the option.
Memory: after the backward, with bf16 compute, the device holds 2 bytes per
param / N of model state and the engine's report agrees with every live CPU
tensor. Checkpoints round-trip (``save_checkpoint`` / ``load_checkpoint``, and
torch's DSD + DCP into a model with and without the option).
Inside the backward the host steps run on a worker thread, and a step that raises
there raises from the backward, the next backward starting clean.
Errors: ZeRO-0, a non-bool, tensor parallelism, shape-aware optimizers.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import mf_fsdp
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    full_params,
    make_model,
    reference_run,
    train_micro_batches,
    wrapped_model,
)
from tests.fsdp.buckets.test_memory_held import settled_live_cpu_bytes

RTOL = ATOL = 1e-6
"""Against one process (fp32). Accumulation runs SGD: Adam normalises each element by its
own gradient scale, so where a gradient is zero up to rounding it turns another summation
order into a step of ``lr`` (see test_step_in_backward); every run is also checked bitwise
against the same engine without the option."""
STEPS = 5
MICRO = 2


def _build(strategy: int, opt_name: str, on: bool, **options):
    return wrapped_model(strategy, opt_name, offload_optimizer_state=on, **options)


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


def assert_offloaded(model: mf_fsdp.MegatronFSDP, opt: torch.optim.Optimizer) -> None:
    """The optimizer's tensors are the host buffers, none of them the device's."""
    for group in model.groups:
        weights = group.weights
        main, kept = weights.main, weights.kept()
        assert kept is not None, f"{group.name}: no compute weights kept on the device"
        assert main.device.type == "cpu", group.name
        assert _storage(main) != _storage(kept), group.name
        assert main.dtype is torch.float32, group.name
        if group.requires_grad:
            assert group.host_grads is not None, group.name
            assert group.host_grads.device.type == "cpu", group.name
            assert _storage(group.host_grads) != _storage(group.grad_store), group.name
        for fp in group.fsdp_params:
            assert _storage(fp.sharded) == _storage(main), fp.fqn
            if fp.sharded.grad is not None:
                assert _storage(fp.sharded.grad) == _storage(group.host_grads), fp.fqn
            for value in opt.state.get(fp.sharded, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert value.device.type == "cpu", fp.fqn
                    assert _storage(value) not in {_storage(kept), _storage(group.grad_store)}


def _train(model, opt, rank: int, world: int, micro: int) -> tuple[list[float], list[int]]:
    """Train ``STEPS`` steps; the losses, and the device grad bytes after each last backward."""

    def check_first(step: int) -> None:
        if step == 0 and model.offloads_optimizer_state:
            assert_offloaded(model, opt)

    return train_micro_batches(model, opt, rank, world, micro, STEPS, check_first)


def _rank_parity(rank: int, world: int, cases: list[tuple[int, str, int]], options: dict) -> None:
    for strategy, opt_name, micro in cases:
        label = f"z{strategy} {opt_name} micro={micro} {options}"
        ref = reference_run(opt_name, world, STEPS, micro=micro)
        model, opt = _build(strategy, opt_name, True, **options)
        losses, held = _train(model, opt, rank, world, micro)
        params = full_params(model)
        if options.get("optimizer_step_in_backward"):
            assert held == [0] * STEPS, f"{label}: grad bytes held after the backward: {held}"
        # Without the option: the same arithmetic on the device's buffers.
        model, opt = _build(strategy, opt_name, False, **options)
        off_losses, _ = _train(model, opt, rank, world, micro)
        assert_matches_reference(off_losses, full_params(model), losses, params, label, 0, 0)
        assert_matches_reference(losses, params, *ref, label, RTOL, ATOL)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_zero3_world2() -> None:
    cases = [(3, "sgd", 1), (3, "adam", 1), (3, "adamw", 1), (3, "momentum", MICRO)]
    run_on_ranks(_rank_parity, 2, cases, {}, timeout=360)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_zero1_zero2_world2() -> None:
    cases = [(2, "sgd", MICRO), (2, "adamw", 1), (1, "adam", 1), (1, "momentum", MICRO)]
    run_on_ranks(_rank_parity, 2, cases, {}, timeout=360)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_with_step_in_backward_world2() -> None:
    cases = [(3, "adam", 1), (3, "sgd", MICRO), (2, "adamw", 1)]
    run_on_ranks(_rank_parity, 2, cases, {"optimizer_step_in_backward": True}, timeout=360)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_world1() -> None:
    """World 1, where ZeRO-1/2/3 reduce fp32 grads where autograd put them."""
    cases = [(3, "adam", 1), (1, "sgd", MICRO)]
    run_on_ranks(_rank_parity, 1, cases, {}, timeout=360)
    run_on_ranks(_rank_parity, 1, [(2, "momentum", MICRO)], {"optimizer_step_in_backward": True})


def _rank_worker(rank: int, world: int) -> None:
    model, opt = _build(3, "adamw", True, optimizer_step_in_backward=True)
    threads: list[str] = []
    hook = opt.register_step_pre_hook(lambda *_: threads.append(threading.current_thread().name))
    model(*batch(0, rank)).backward()
    hook.remove()
    assert threads, "no bucket stepped inside the backward"
    assert all(name.startswith("mf-fsdp-host-step") for name in threads), threads
    opt.step()
    opt.zero_grad()

    def fail(*_) -> None:
        if threading.current_thread().name.startswith("mf-fsdp-host-step"):
            raise RuntimeError("host step failed")

    hook = opt.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="host step failed"):
        model(*batch(1, rank)).backward()
    hook.remove()
    opt.zero_grad()
    loss = model(*batch(2, rank))
    loss.backward()
    opt.step()
    assert math.isfinite(model(*batch(3, rank)).item())


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_host_steps_in_the_backward_run_on_a_worker_and_raise_from_it() -> None:
    run_on_ranks(_rank_worker, 2, timeout=150)


def _rank_one_fails(rank: int, world: int) -> None:
    model, opt = _build(2, "sgd", True, optimizer_step_in_backward=True)

    def fail(*_) -> None:
        if rank == 1 and threading.current_thread().name.startswith("mf-fsdp-host-step"):
            raise RuntimeError("host step failed on rank 1")

    hook = opt.register_step_pre_hook(fail)
    loss = model(*batch(0, rank))
    if rank == 1:
        with pytest.raises(RuntimeError, match="host step failed on rank 1"):
            loss.backward()
    else:  # its install all-gather is matched by rank 1's
        loss.backward()
    hook.remove()
    opt.step()
    opt.zero_grad()
    model(*batch(1, rank)).backward()  # the ranks go on together
    opt.step()
    mine = torch.cat([value.flatten() for value in full_params(model).values()])
    theirs = mine.clone()
    dist.broadcast(theirs, src=0)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)  # one model on every rank


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_host_step_failing_on_one_rank_raises_there_and_hangs_no_other() -> None:
    """ZeRO-2: the failing rank still joins the install's all-gather, then raises."""
    run_on_ranks(_rank_one_fails, 2, timeout=150)


def _rank_hsdp(rank: int, world: int) -> None:
    mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    dims = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"}
    _rank_parity(rank, world, [(3, "sgd", MICRO)], dims)
    _rank_parity(rank, world, [(3, "momentum", 1)], {**dims, "outer_dp_sharding_strategy": 1})


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_hsdp_world4() -> None:
    run_on_ranks(_rank_hsdp, 4, timeout=360)


def _rank_memory(rank: int, world: int) -> None:
    """bf16 compute, ZeRO-3: after the backward the device holds the bf16 shard and grads."""
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    before = settled_live_cpu_bytes()
    model, opt = _build(3, "adam", True, mixed_precision_policy=policy)
    numel = sum(p.numel() for p in model.parameters())
    per = numel / world
    for step in range(2):
        model(*batch(step, rank)).backward()
        if step == 1:
            report = model.memory_footprint(opt)
            held = settled_live_cpu_bytes() - before
        opt.step()
        opt.zero_grad()
    # The device: the compute shard, and in flight the reduced grads and idle temporaries.
    device = report["params"] + report["grads"] + report["pool"]
    host = report["main_params"] + report["host_grads"] + report["optimizer_state"]
    assert report["params"] <= 2 * per * 1.05, ("bf16 compute shard", report, per)
    assert report["grads"] <= 4 * per * 1.05, ("fp32 grads in flight", report, per)
    assert host >= (4 + 4 + 8) * per * 0.95, ("fp32 main, grads' copy, Adam state", report)
    # Every live tensor is one of these (the model's other objects are small).
    assert device + host == pytest.approx(held, rel=0.01), (report, held)
    assert_offloaded(model, opt)
    # Without the option ZeRO-3 keeps no bf16 shard, but fp32 main weights and state
    # on the device: 12 bytes per param / N of model state instead of 2.
    del model, opt
    model, opt = _build(3, "adam", False, mixed_precision_policy=policy)
    model(*batch(0, rank)).backward()
    off = model.memory_footprint(opt)
    assert "host_grads" not in off
    assert off["params"] == 0
    assert off["main_params"] + off["optimizer_state"] >= 12 * per * 0.95, off


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_device_holds_compute_shard_and_grads_world2() -> None:
    run_on_ranks(_rank_memory, 2)


def _rank_checkpoint(rank: int, world: int, root: str) -> None:
    runs, saved = [], None
    for resume in (False, True):
        model, opt = _build(3, "adamw", True)
        losses = []
        for step in range(4):
            if resume and step == 2:
                mf_fsdp.load_checkpoint(saved, model, opt)
                assert_offloaded(model, opt)
            if resume and step < 2:
                continue
            model(*batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            losses.append(model(*batch(9, rank)).item())
            if not resume and step == 1:
                saved = mf_fsdp.save_checkpoint(root, model, opt, step=2)
        runs.append((losses[-2:], full_params(model), opt.state_dict()["state"]))
    (a, pa, sa), (b, pb, sb) = runs
    assert a == b, (a, b)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    for key in sa:  # parameter-shaped state, on the host
        for name, value in sa[key].items():
            other = sb[key][name]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert torch.equal(value.full_tensor(), other.full_tensor()), (key, name)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_checkpoint_round_trip_world2(tmp_path) -> None:
    run_on_ranks(_rank_checkpoint, 2, str(tmp_path))


def _rank_errors(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=r"offload_optimizer_state=True needs .* got 'no_shard'"):
        _build(0, "sgd", True)
    with pytest.raises(TypeError, match="offload_optimizer_state: expected a bool"):
        mf_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=3,
            offload_optimizer_state="yes",  # type: ignore[arg-type]
        )
    from tests.fsdp.buckets.test_tensor_parallel import mf_tp_model

    mesh = cpu_mesh((1, world), ("dp", "tp"))
    with pytest.raises(ValueError, match="offload_optimizer_state=True is not supported with"):
        mf_fsdp.fully_shard_model(
            mf_tp_model(mesh["tp"]),
            device_mesh=mesh,
            dp_shard_dim="dp",
            tp_dim="tp",
            offload_optimizer_state=True,
        )
    for cls in (getattr(torch.optim, "Adafactor", None), getattr(torch.optim, "Muon", None)):
        if cls is None:
            continue
        module = make_model()
        params = [p for p in module.parameters() if p.dim() == 2]
        with pytest.raises(ValueError, match=f"{cls.__qualname__} is not elementwise.*offload"):
            mf_fsdp.fully_shard(
                module, cls(params, lr=1e-2), zero_dp_strategy=3, offload_optimizer_state=True
            )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_errors() -> None:
    run_on_ranks(_rank_errors, 2)


CLIP = 0.5
"""Below the tiny GPT's gradient norm in every step: SGD exposes a wrong coefficient."""


def _rank_clip(rank: int, world: int) -> None:
    """``clip_grad_norm_`` scales the host grads the step reads, as one process clips."""
    ref = reference_run("sgd", world, STEPS, clip=CLIP)
    for strategy in (2, 3):
        model, opt = _build(strategy, "sgd", True)
        losses = []
        for step in range(STEPS):
            loss = model(*batch(step, rank))
            loss.backward()
            mf_fsdp.clip_grad_norm_(model, CLIP)
            total = loss.detach()
            dist.all_reduce(total)
            opt.step()
            opt.zero_grad()
            losses.append(total.item() / world)
        assert_matches_reference(losses, full_params(model), *ref, f"z{strategy}", RTOL, ATOL)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_clip_grad_norm_world2() -> None:
    run_on_ranks(_rank_clip, 2)


def _rank_dsd(rank: int, world: int, path: str) -> None:
    """torch's DSD + DCP: saved with the option, loaded with and without it, same next step."""
    model, opt = _build(3, "adam", True)
    for step in range(2):
        model(*batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    runs = []
    for on in (None, True, False):  # None: the saving run itself, going on
        if on is not None:
            model, opt = _build(3, "adam", on)
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        model(*batch(2, rank)).backward()
        opt.step()
        opt.zero_grad()
        if on:
            assert_offloaded(model, opt)
        runs.append((model(*batch(3, rank)).item(), full_params(model)))
    (loss, params), *others = runs
    for other_loss, other_params in others:
        assert other_loss == loss
        for name, value in params.items():
            assert torch.equal(other_params[name], value), name


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_dsd_dcp_round_trip_world2(tmp_path) -> None:
    run_on_ranks(_rank_dsd, 2, str(tmp_path / "dcp"))


def _rank_experts(rank: int, world: int) -> None:
    """Expert-parallel buckets (their own groups and grad-norm grid) offload alike."""
    from tests.fsdp.engine import test_experts as ex

    for opt_name in ("sgd", "adam"):
        ref = reference_run(
            opt_name, world, ex.STEPS, clip=ex.CLIP, make=ex.make_moe, optimizer=ex.make_optimizer
        )
        model, opt, _ = ex._sharded_moe(world, 2, opt_name, 3, offload_optimizer_state=True)
        losses = ex._train(model, opt, rank, world, ex.STEPS)
        assert_offloaded(model, opt)
        ex._check(losses, ex._full(model), *ref, f"ep2 {opt_name} offloaded")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_expert_parallel_world2() -> None:
    run_on_ranks(_rank_experts, 2, timeout=280)


def _rank_bf16(rank: int, world: int) -> None:
    """bf16 compute: the host weights cast into the device's bf16 ones, as without the option."""
    policy = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for strategy, opt_name, micro in ((3, "adam", 1), (3, "sgd", MICRO), (2, "adamw", MICRO)):
        runs = []
        for on in (True, False):
            model, opt = _build(strategy, opt_name, on, mixed_precision_policy=policy)
            losses, _ = _train(model, opt, rank, world, micro)
            runs.append((losses, full_params(model)))
        label = f"z{strategy} bf16 {opt_name} micro={micro}"
        assert_matches_reference(*runs[1], *runs[0], label, 0, 0)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bf16_same_as_without_the_option_world2() -> None:
    run_on_ranks(_rank_bf16, 2, timeout=280)
