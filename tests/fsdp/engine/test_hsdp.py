"""HSDP (replicate across dp_outer) and hybrid-sharded HSDP on a 2x2 (dp_outer, dp_shard) mesh.

Every configuration trains 10 steps and must reproduce one process on the
global batch (loss and final parameters to 1e-5 relative, fp32): plain SGD
exposes any gradient-scale error (the reference's hybrid-sharded mode is off
by the data-parallel size), Adam is the usual choice. While training, the
collectives whose group is the dp_outer group are counted: exactly one per
bucket per optimizer step (HSDP: all-reduce; hybrid-sharded: reduce-scatter
plus the all-gather of updated weights), with or without 4-micro-batch
accumulation, whatever the inner strategy. The mesh has no tp dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

import mf_fsdp
from mf_dtensor import UnevenDTensor
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import (
    CONFIG,
    assert_losses_match,
    batch,
    full_params,
    make_model,
    make_optimizer,
    reference_run,
    unit_classes,
)
from tests.fsdp.engine.test_accumulation import COUNTED, count_collectives

RTOL, ATOL = 1e-5, 1e-6
STEPS, WORLD = 10, 4
MESH = ((2, 2), ("dp_outer", "dp_shard"))


@dataclass(frozen=True)
class Case:
    """One training configuration; ``ref`` picks the single-process reference."""

    inner: int
    outer: int = 0
    opt: str = "sgd"
    micro: int = 1
    no_sync: bool = True
    auto_sync: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict)
    fp64: bool = False

    @property
    def ref(self) -> tuple[str, int, bool, bool]:
        per_token = bool(self.kwargs.get("calculate_per_token_loss"))
        return self.opt, self.micro, per_token, self.fp64

    def __str__(self) -> str:
        mode = "hfsdp" if self.outer else "hsdp"
        sync = "no_sync" if self.no_sync else "plain"
        return (
            f"{mode} z{self.inner} {self.opt} micro={self.micro} {sync} "
            f"auto_sync={self.auto_sync} {self.kwargs}{' fp64' if self.fp64 else ''}"
        )


# Every inner strategy under HSDP, SGD and Adam, micro 1 and 4 (accumulated inside
# no_sync, or by plain backwards: ZeRO-2/3 then reduce inside dp_shard every
# backward, ZeRO-0/1 with auto-sync too), auto-sync both ways; hybrid-sharded
# likewise, plus its scaling options. Adam with 4 micro-batches runs in fp64: it
# reorders a 16-term sum, which Adam amplifies past 1e-5 in fp32 (1.4e-5 measured
# on the CI machine's CPU).
HSDP_CASES = [
    Case(0, 0, "sgd", 4, True, False),
    Case(0, 0, "sgd", 4, False, True),
    Case(0, 0, "adam", 1, True, True),
    Case(1, 0, "sgd", 1, True, False),
    Case(1, 0, "sgd", 4, False, True),
    Case(1, 0, "adam", 4, True, True, fp64=True),
    Case(2, 0, "sgd", 4, False, False),
    Case(2, 0, "adam", 4, True, False, fp64=True),
    Case(3, 0, "sgd", 4, False, True),
    Case(3, 0, "adam", 1, True, False),
    Case(3, 0, "sgd", 4, True, True, {"calculate_per_token_loss": True}),
]
HFSDP_CASES = [
    Case(3, 1, "sgd", 1, True, True),
    Case(3, 1, "sgd", 4, True, False),
    Case(3, 1, "sgd", 4, False, True),
    Case(3, 1, "adam", 1, True, False),
    Case(3, 1, "adam", 4, True, True, fp64=True),
    Case(3, 1, "sgd", 1, True, False, {"average_in_collective": True}),
    Case(3, 1, "sgd", 4, False, False, {"calculate_per_token_loss": True}),
    Case(3, 1, "adam", 4, False, True, fp64=True),
]


@contextlib.contextmanager
def _default_dtype(fp64: bool) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if fp64 else previous)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build(mesh, case: Case, opt_name: str | None = None, **extra):
    with _default_dtype(case.fp64):
        module = make_model()
    if case.fp64:
        extra["mixed_precision_policy"] = mf_fsdp.MixedPrecisionPolicy(main_params_dtype=None)
    opt = make_optimizer(opt_name or case.opt, module.parameters())
    return mf_fsdp.fully_shard(
        module,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        dp_outer_dim="dp_outer",
        fsdp_unit_modules=unit_classes(),
        zero_dp_strategy=case.inner,
        outer_dp_sharding_strategy=case.outer,
        sync_model_each_microbatch=case.auto_sync,
        **case.kwargs,
        **extra,
    )


def _train(model, opt, rank: int, case: Case) -> list[float]:
    """Train STEPS steps; assert one outer collective per bucket per step."""
    outer = model.get_distributed_index().get_outer_fsdp_group()
    per_token = bool(case.kwargs.get("calculate_per_token_loss"))
    buckets = len(model.groups)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        with count_collectives(outer) as counts:
            for m in range(case.micro):
                quiet = case.no_sync and m < case.micro - 1
                with model.no_sync() if quiet else contextlib.nullcontext():
                    loss = model(*batch(step, rank, m)) / case.micro
                    loss.backward()
                total += loss.detach()
            opt.step()
        if case.outer:
            expected = {"reduce_scatter_into": buckets, "all_gather_into": buckets}
        else:
            expected = {"all_reduce": buckets}
        expected = {name: expected.get(name, 0) for name in COUNTED}
        assert counts == expected, f"{case} step {step}: outer collectives {counts}"
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / (1 if per_token else WORLD))
    return losses


def _check(model, losses, ref, label: str, adam: bool) -> None:
    """Losses and final parameters against the reference, to 1e-5 relative.

    SGD and fp64: element-wise. fp32 Adam: per tensor, ``|p - ref| / |ref|``, because
    Adam divides by the gradient's own size, so elements with near-zero gradients
    turn the summation-order rounding of 4 ranks into visible, loss-neutral
    differences. The key bias is left out for Adam: its true gradient is exactly
    zero (softmax is shift-invariant), so Adam steps it by lr along rounding noise.
    """
    ref_losses, ref_params = ref
    assert_losses_match(losses, ref_losses, label, RTOL, ATOL)
    params = full_params(model)
    for name, value in ref_params.items():
        got = params[name]
        if not adam:
            torch.testing.assert_close(
                got, value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{label} {n}: {m}"
            )
            continue
        if name.endswith("attn.qkv.bias"):
            keep = torch.ones_like(value, dtype=torch.bool)
            keep[CONFIG.d_model : 2 * CONFIG.d_model] = False
            got, value = got[keep], value[keep]
        error = ((got - value).norm() / value.norm()).item()
        assert error <= RTOL, f"{label} {name}: relative error {error:.2e} > {RTOL}"


def _references(cases: list[Case]) -> dict[tuple[str, int, bool, bool], Any]:
    """The single-process runs the cases need (one thread: the CPU is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {}
        for key in {case.ref for case in cases}:
            with _default_dtype(key[3]):
                refs[key] = reference_run(key[0], WORLD, STEPS, micro=key[1], per_token=key[2])
        return refs
    finally:
        torch.set_num_threads(threads)


def _rank_parity(rank: int, world: int, cases: list[Case], refs: dict) -> None:
    mesh = cpu_mesh(*MESH)
    for case in cases:
        model, opt = _build(mesh, case)
        losses = _train(model, opt, rank, case)
        adam = case.opt == "adam" and not case.fp64
        _check(model, losses, refs[case.ref], str(case), adam)


@pytest.mark.multiprocess
def test_hsdp_replicate_parity_and_one_outer_reduce_per_step() -> None:
    run_on_ranks(_rank_parity, WORLD, HSDP_CASES, _references(HSDP_CASES), timeout=600)


@pytest.mark.multiprocess
def test_hybrid_sharded_parity_and_outer_collectives() -> None:
    run_on_ranks(_rank_parity, WORLD, HFSDP_CASES, _references(HFSDP_CASES), timeout=600)


def _dtensors(tree: Any) -> list[DTensor]:
    """Every DTensor of a nested state dict, in traversal order."""
    if isinstance(tree, DTensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _dtensors(value)]
    if isinstance(tree, list | tuple):
        return [t for value in tree for t in _dtensors(value)]
    return []


def _rank_layout_and_features(rank: int, world: int, ckpt_dir: str, ref: Any) -> None:
    mesh = cpu_mesh(*MESH)
    outer, inner = divmod(rank, 2)
    hybrid = Case(3, 1)

    index = mf_fsdp.FSDPDistributedIndex(
        mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hsdp_outer_dp_shard=True
    )
    assert index.get_logical_hybrid_fsdp_rank() == inner * 2 + outer
    assert tuple(index.dp_mesh().get_coordinate()) == (inner, outer)
    with_tp = cpu_mesh((2, 2, 1), ("dp_outer", "dp_shard", "tp"))  # a tp dim is optional
    tp_index = mf_fsdp.FSDPDistributedIndex(
        with_tp, "dp_shard", "dp_outer", "tp", hsdp_outer_dp_shard=True
    )
    assert tuple(tp_index.dp_mesh().get_coordinate()) == (inner, outer)
    with pytest.raises(ValueError, match="hsdp_outer_dp_shard=True .* needs dp_outer_dim"):
        mf_fsdp.FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", hsdp_outer_dp_shard=True)
    config = mf_fsdp.DistributedDataParallelConfig(3, outer_dp_sharding_strategy="optim")
    with pytest.raises(ValueError, match="hsdp_outer_dp_shard=True, got False"):
        mf_fsdp.MegatronFSDP(make_model(), mf_fsdp.FSDPDistributedIndex(mesh, "dp_shard"), config)

    # Hybrid-sharded: every sharded parameter has its module shape, its rows sit at
    # the logical-rank offset of the layout, and the pieces of all 4 ranks tile it once.
    model, opt = _build(mesh, hybrid, "adam")
    model(*batch(0, rank)).backward()
    opt.step()
    params = full_params(model)
    covered = torch.zeros(1, dtype=torch.long)
    logical = inner * 2 + outer
    for group in model.groups:
        for fp in group.fsdp_params:
            piece = fp.sharded
            assert isinstance(piece, UnevenDTensor)
            assert piece.placements == (Shard(0), Shard(0))
            assert piece.shape == params[fp.fqn].shape
            begin, end = group.main_layout.local_rows(fp.index, logical)
            (box,) = piece.local_boxes() or (None,)
            if box is not None:
                assert box.offsets[0] == begin
                assert box.sizes[0] == end - begin
            torch.testing.assert_close(piece.to_local(), params[fp.fqn][begin:end])
            covered += piece.to_local().numel()
    dist.all_reduce(covered)
    assert covered.item() == sum(p.numel() for p in params.values())

    # Main weights, grads and optimizer state at 1 / (outer x inner) of each bucket.
    replicate, ropt = _build(mesh, Case(3, 0), "adam")
    replicate(*batch(0, rank)).backward()
    ropt.step()
    mine, theirs = model.memory_footprint(opt), replicate.memory_footprint(ropt)
    assert mine["grads"] == sum(4 * g.layout.padded_numel // world for g in model.groups)
    assert mine["grads"] <= 0.51 * theirs["grads"]
    assert mine["optimizer_state"] <= 0.51 * theirs["optimizer_state"]
    bf16 = mf_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    footprints = [
        _build(mesh, case, mixed_precision_policy=bf16)[0].memory_footprint()
        for case in (hybrid, Case(3, 0))
    ]
    assert footprints[0]["main_params"] <= 0.51 * footprints[1]["main_params"]

    # Separate (fp32) main weights under bf16 compute: hybrid-sharded trains exactly like
    # replicated ZeRO-3 (the same bf16 grads, sums of two, the same fp32 updates).
    runs = []
    for case in (hybrid, Case(3, 0)):
        bf16_model, bf16_opt = _build(mesh, case, "sgd", mixed_precision_policy=bf16)
        for step in range(3):
            bf16_model(*batch(step, rank)).backward()
            bf16_opt.step()
            bf16_opt.zero_grad()
        runs.append(full_params(bf16_model))
    for name, value in runs[1].items():
        torch.testing.assert_close(runs[0][name], value, rtol=0, atol=0, msg=f"bf16 {name}")

    # load_state_dict of full tensors lands every piece at its logical-rank offset.
    keys = list(model.state_dict())
    model.load_state_dict(
        {k: torch.full_like(params[k.replace("lm_head", "wte")], 0.25) for k in keys}
    )
    assert all(bool((v == 0.25).all()) for v in full_params(model).values())
    model.load_state_dict({k: params[k.replace("lm_head", "wte")] for k in keys})

    # DCP round trip of model.state_dict() and optimizer.state_dict() as torch gives them
    # (Adam's state was created by torch from the sharded parameters, so it carries
    # their pieces too).
    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    saved = [t.to_local().clone() for t in _dtensors(state())]
    dcp.save(state(), checkpoint_id=ckpt_dir)
    with torch.no_grad():
        for value in _dtensors(state()):
            value.to_local().zero_()
    dcp.load(state(), checkpoint_id=ckpt_dir)
    for value, before in zip(_dtensors(state()), saved, strict=True):
        torch.testing.assert_close(value.to_local(), before, rtol=0, atol=0)
    full = dict(model.named_parameters())["wte.weight"].full_tensor()
    torch.testing.assert_close(full, params["wte.weight"], rtol=0, atol=0)

    # Gradient norm, clipping and scale_gradients on hybrid-sharded and replicated grads;
    # broadcast_params makes every replica equal to rank 0's weights.
    for case in (hybrid, Case(3, 0), Case(1, 0)):
        model, opt = _build(mesh, case, "sgd")
        model(*batch(0, rank)).backward()
        norm = mf_fsdp.get_grad_norm(model)
        torch.testing.assert_close(norm, ref["norm"], rtol=1e-5, atol=0, msg=str(case))
        model.scale_gradients(0.5)
        torch.testing.assert_close(mf_fsdp.get_grad_norm(model), ref["norm"] / 2, rtol=1e-5, atol=0)
        clipped = mf_fsdp.clip_grad_norm_(model, max_norm=ref["norm"].item() / 4)
        torch.testing.assert_close(clipped, ref["norm"] / 2, rtol=1e-5, atol=0)
        torch.testing.assert_close(mf_fsdp.get_grad_norm(model), ref["norm"] / 4, rtol=1e-4, atol=0)
        opt.zero_grad()
        assert mf_fsdp.get_grad_norm(model).item() == 0.0
        with torch.no_grad():  # make the replicas differ, then restore rank 0's copy
            for group in model.groups:
                weights = group.weights.kept()
                weights.add_(float(rank))
        model.broadcast_params()
        flat = torch.cat([p.reshape(-1) for p in full_params(model).values()])
        root = flat.clone()
        dist.broadcast(root, src=0)
        assert torch.equal(flat, root), f"{case}: replicas differ after broadcast_params"


@pytest.mark.multiprocess
def test_hybrid_layout_dcp_memory_norm_broadcast(tmp_path) -> None:
    model = make_model()
    for r in range(WORLD):
        (model(*batch(0, r)) / WORLD).backward()
    ref = {"norm": torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])}
    run_on_ranks(_rank_layout_and_features, WORLD, str(tmp_path), ref, timeout=300)


def test_bad_outer_strategies_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy: 2 is not supported"):
        mf_fsdp.normalize_outer_strategy(2)
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy: unknown strategy 'hybrid'"):
        mf_fsdp.DistributedDataParallelConfig(3, outer_dp_sharding_strategy="hybrid")
    with pytest.raises(ValueError, match=r"'optim' .* needs data_parallel_sharding_strategy 3"):
        mf_fsdp.DistributedDataParallelConfig(1, outer_dp_sharding_strategy=1)
    with pytest.raises(ValueError, match=r"'optim' .* but dp_outer_dim is None"):
        mf_fsdp.fully_shard_model(make_model(), outer_dp_sharding_strategy="optim")
    with pytest.raises(ValueError, match=r"needs data_parallel_sharding_strategy 3.*'optim_grads'"):
        mf_fsdp.fully_shard_model(make_model(), zero_dp_strategy=2, outer_dp_sharding_strategy=1)
    assert mf_fsdp.normalize_outer_strategy("optim") is mf_fsdp.ZeroDPStrategy.OPTIM
    assert mf_fsdp.normalize_outer_strategy(0) is mf_fsdp.ZeroDPStrategy.NO_SHARD
