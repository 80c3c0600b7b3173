"""Mixture-of-experts under mf-fsdp: expert parameters on the expert-data-parallel group.

Every configuration trains the MoE GPT for several steps and must match one
process holding every expert (``MoEGPT(config)``, the same seed, each rank's
batch run separately and the losses averaged) to 1e-5, with SGD (a wrong
gradient scale shows at O(1)) and Adam, gradients clipped so the norm
(each expert counted once) matters. Expert gradients reach their owner
through the dispatch all-to-all and are then reduced over the
expert-data-parallel group only; dense ones over the whole dp group.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import mf_fsdp
from mf.models.moe_gpt import (
    MOE_PRESETS,
    MoEBlock,
    MoEGPT,
    MoEGPTTensorParallel,
)
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    optimizer_step,
    reference_run,
)

CONFIG = MOE_PRESETS["moe-tiny"]
RTOL, ATOL = 1e-5, 1e-5  # the 1e-5; Adam turns rounding in near-zero grads into ~1e-6
STEPS = 5
CLIP = 0.5


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """SGD as everywhere; Adam with eps 1e-4, as the HSDP checkpoint tests use.

    Elements whose gradient is (nearly) zero, attention's key bias and rare
    tokens' embedding rows, differ only by rounding between layouts, and Adam at
    eps 1e-8 divides that rounding by itself into full-size steps.
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def make_moe(seed: int = 0, ep_group: dist.ProcessGroup | None = None) -> MoEGPT:
    """The MoE GPT with this seed: every expert without a group, this rank's with one."""
    torch.manual_seed(seed)
    return MoEGPT(CONFIG, ep_group)


def _meshes(world: int, ep: int):
    """The dense mesh ("dp") and the expert mesh ("dp" = expert-data-parallel, "ep")."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    return mesh, expert_mesh


def _sharded_moe(world: int, ep: int, opt_name: str, zero: int, **options):
    mesh, expert_mesh = _meshes(world, ep)
    module = make_moe(ep_group=expert_mesh["ep"].get_group())
    opt = make_optimizer(opt_name, module.parameters())
    model, opt = mf_fsdp.fully_shard(
        module,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp",
        expt_device_mesh=expert_mesh,
        fsdp_unit_modules=[MoEBlock],
        zero_dp_strategy=zero,
        **options,
    )
    return model, opt, expert_mesh


def _train(model, opt, rank: int, world: int, steps: int, first_step: int = 0) -> list[float]:
    losses = []
    for step in range(first_step, first_step + steps):
        tokens, targets = batch(step, rank)
        clip = functools.partial(mf_fsdp.clip_grad_norm_, model, CLIP)
        losses.append(optimizer_step(model(tokens, targets), opt, world, clip))
    return losses


def _full(model) -> dict[str, torch.Tensor]:
    """The parameters, gathered to their full shapes (the experts: all ``E`` of them)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
        for name, p in model.named_parameters()
    }


def _check(losses, params, ref_losses, ref_params, label: str) -> None:
    assert_matches_reference(losses, params, ref_losses, ref_params, label, RTOL, ATOL)


def _rank_parity(rank: int, world: int, ep: int, zeros: list[int]) -> None:
    for opt_name in ("sgd", "adam"):
        ref_losses, ref_params = reference_run(
            opt_name, world, STEPS, clip=CLIP, make=make_moe, optimizer=make_optimizer
        )
        for zero in zeros:
            model, opt, _ = _sharded_moe(world, ep, opt_name, zero)
            experts = model.module.blocks[0].moe.experts
            assert experts.num_local_experts == CONFIG.num_experts // ep
            full = experts.fc_weight.full_tensor()  # parameter-shaped over every expert
            assert full.shape[0] == CONFIG.num_experts, full.shape
            losses = _train(model, opt, rank, world, STEPS)
            _check(losses, _full(model), ref_losses, ref_params, f"ep{ep} {opt_name} z{zero}")
    # Averaging inside the collective: over the expert-data-parallel group it divides by
    # fewer ranks than the dp replicas, which the pre-scale makes up for.
    ref_losses, ref_params = reference_run(
        "sgd", world, STEPS, clip=CLIP, make=make_moe, optimizer=make_optimizer
    )
    model, opt, _ = _sharded_moe(world, ep, "sgd", zeros[-1], average_in_collective=True)
    losses = _train(model, opt, rank, world, STEPS)
    _check(losses, _full(model), ref_losses, ref_params, f"ep{ep} sgd avg-in-collective")


@pytest.mark.multiprocess
def test_ep2_edp1_zero1_and_zero3_match_one_process():
    run_on_ranks(_rank_parity, 2, 2, [1, 3], timeout=300)


@pytest.mark.multiprocess
def test_ep2_edp2_matches_one_process():
    run_on_ranks(_rank_parity, 4, 2, [3], timeout=300)


def _rank_ep_tp_parity(rank: int, world: int) -> None:
    # (dp 2, tp 2) dense; experts (dp 1, ep 2, tp 2): each EP group holds the two dp
    # ranks of one TP rank, whose experts are whole (expert-TP 1) and equal across TP.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expert_mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    for opt_name in ("sgd", "adam"):
        ref_losses, ref_params = reference_run(
            opt_name, 2, STEPS, clip=CLIP, make=make_moe, optimizer=make_optimizer
        )
        full = make_moe().state_dict()
        module = MoEGPTTensorParallel(CONFIG, mesh["tp"].get_group(), expert_mesh["ep"].get_group())
        module.load_full_weights(full)
        opt = make_optimizer(opt_name, module.parameters())
        model, opt = mf_fsdp.fully_shard(
            module,
            opt,
            device_mesh=mesh,
            dp_shard_dim="dp",
            tp_dim="tp",
            expt_device_mesh=expert_mesh,
            fsdp_unit_modules=[MoEBlock],
        )
        losses = _train(model, opt, dp_rank, world, STEPS)  # TP ranks share their dp batch
        _check(losses, _full(model), ref_losses, ref_params, f"ep2 x tp2 {opt_name}")


@pytest.mark.multiprocess
def test_ep2_tp2_matches_one_process():
    run_on_ranks(_rank_ep_tp_parity, 4, timeout=300)


def _rank_collective_groups(rank: int, world: int, ep: int) -> None:
    model, opt, expert_mesh = _sharded_moe(world, ep, "sgd", 3)
    edp = dist.get_process_group_ranks(expert_mesh["dp"].get_group())
    everyone = list(range(world))
    calls: list[tuple[str, tuple[int, ...]]] = []
    originals = {}
    for name, position in (("all_gather_into", 2), ("reduce_scatter_into", 3), ("all_reduce", 2)):
        original = originals[name] = getattr(mf_fsdp.buckets.collectives, name)

        def counted(*args, _name=name, _original=original, _at=position, **kwargs):
            group = kwargs.get("group", args[_at] if len(args) > _at else None)
            calls.append((_name, tuple(dist.get_process_group_ranks(group))))
            return _original(*args, **kwargs)

        setattr(mf_fsdp.buckets.collectives, name, counted)
    try:
        _train(model, opt, rank, world, 1)  # warm: the first step allocates
        calls.clear()
        _train(model, opt, rank, world, 1)
    finally:
        for name, original in originals.items():
            setattr(mf_fsdp.buckets.collectives, name, original)
    expert_buckets = sum(1 for g in model.groups if g.dist_index is model.dist_index.expert_index)
    dense_buckets = len(model.groups) - expert_buckets
    # Per layer, one bucket per grouped expert weight ([Note: stacked weights are
    # spread]) and one of the experts' biases.
    stacked = sum(1 for p in model.module.parameters() if p.dim() == 3)
    assert stacked > 0
    assert expert_buckets == stacked + CONFIG.n_layers, (expert_buckets, stacked)
    reduces = [ranks for name, ranks in calls if name == "reduce_scatter_into"]
    assert reduces.count(tuple(edp)) == expert_buckets, (edp, calls)
    assert reduces.count(tuple(everyone)) == dense_buckets, calls
    gathers = [ranks for name, ranks in calls if name == "all_gather_into"]
    assert set(gathers) == {tuple(edp), tuple(everyone)}, calls
    assert len(reduces) == len(model.groups), calls


@pytest.mark.multiprocess
def test_expert_buckets_use_the_expert_group_dense_buckets_the_dp_group():
    run_on_ranks(_rank_collective_groups, 4, 2)


def _rank_resume_across_ep(rank: int, world: int, root: str) -> None:
    save_at, more = 3, 2
    for saved_ep, loaded_ep in ((2, 1), (1, 2)):
        folder = f"{root}/ep{saved_ep}"
        model, opt, _ = _sharded_moe(world, saved_ep, "adam", 3)
        _train(model, opt, rank, world, save_at)
        path = mf_fsdp.save_checkpoint(folder, model, opt, step=save_at)
        uninterrupted = _train(model, opt, rank, world, more, first_step=save_at)
        model, opt, _ = _sharded_moe(world, loaded_ep, "adam", 3)
        assert mf_fsdp.load_checkpoint(path, model, opt)["step"] == save_at
        resumed = _train(model, opt, rank, world, more, first_step=save_at)
        torch.testing.assert_close(
            torch.tensor(resumed),
            torch.tensor(uninterrupted),
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m, s=saved_ep, t=loaded_ep: f"EP {s} -> EP {t}: {m}",
        )
        if rank == 0:  # the checkpoint holds every expert: one process loads it whole
            full = mf_fsdp.checkpoint_to_full_state_dict(path)
            plain = MoEGPT(CONFIG)
            plain.load_state_dict(full, strict=True)
        dist.barrier()


@pytest.mark.multiprocess
def test_checkpoint_resumes_across_ep_sizes(tmp_path):
    run_on_ranks(_rank_resume_across_ep, 2, str(tmp_path), timeout=300)


def _rank_expert_mesh_errors(rank: int, world: int) -> None:
    mesh, expert_mesh = _meshes(world, 2)
    index = mf_fsdp.FSDPDistributedIndex(mesh, "dp", expt_device_mesh=expert_mesh)
    edp = expert_mesh["dp"].get_group()
    assert index.get_fsdp_group(is_expert_parallel=True) is edp
    assert index.get_dp_group(is_expert_parallel=True) is edp
    assert index.get_root_mesh(is_expert_parallel=True) is expert_mesh
    assert index.get_fsdp_group() is mesh.get_group()
    plain = mf_fsdp.FSDPDistributedIndex(mesh, "dp")
    with pytest.raises(ValueError, match="is_expert_parallel=True but no expt_device_mesh"):
        plain.get_fsdp_group(is_expert_parallel=True)
    other_ranks = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"expt_device_mesh covers ranks \[0\] but device_mesh"):
        mf_fsdp.FSDPDistributedIndex(mesh, "dp", expt_device_mesh=other_ranks)
    renamed = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    with pytest.raises(ValueError, match="none named dp_shard_dim='dp'"):
        mf_fsdp.FSDPDistributedIndex(mesh, "dp", expt_device_mesh=renamed)
    with pytest.raises(TypeError, match="expt_device_mesh must be a DeviceMesh or None"):
        mf_fsdp.FSDPDistributedIndex(mesh, "dp", expt_device_mesh="ep")
    module = make_moe(ep_group=expert_mesh["ep"].get_group())
    with pytest.raises(ValueError, match="'blocks.0.moe.experts.*' is an expert parameter"):
        mf_fsdp.fully_shard_model(module, device_mesh=mesh, dp_shard_dim="dp")


@pytest.mark.multiprocess
def test_expert_groups_and_clear_errors_for_a_wrong_expert_mesh():
    run_on_ranks(_rank_expert_mesh_errors, 2)
