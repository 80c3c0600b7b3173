"""Expert tensor parallelism under mf-fsdp: experts split over (ep, etp), sharded over edp.

The MoE GPT with every expert's FFN split over an ETP group (``fc`` by columns, ``out``
by rows, the partial outputs summed over ETP) and its experts on the expert mesh
``(dp, ep, etp)`` must train like one process holding every whole expert, on the same
global batch: losses, and the parameters gathered to their full ``[E, ...]`` shapes, to
1e-5 after several steps, with SGD (a wrong gradient scale shows at O(1)) and Adam,
gradients clipped so the norm (each expert piece counted once) matters. The ETP ranks
are data-parallel for the dense part of the model, so every rank draws its own batch.

One launch per world size runs several configurations (a launch costs more than a step).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import mf_fsdp
import mf_rng
from mf.models.moe_gpt import MoEBlock, MoEGPT, MoEGPTConfig, MoEGPTTensorParallel
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import reference_run
from tests.fsdp.engine.test_expert_balance import assert_balanced, expert_bytes
from tests.fsdp.engine.test_experts import (
    ATOL,
    CLIP,
    CONFIG,
    RTOL,
    STEPS,
    _check,
    _full,
    _train,
    make_moe,
    make_optimizer,
)


def _group(mesh, name: str) -> dist.ProcessGroup | None:
    return mesh[name].get_group() if mesh[name].size() > 1 else None


def _sharded(
    world: int,
    ep: int,
    etp: int,
    opt_name: str,
    zero: int,
    outer: int = 1,
    config: MoEGPTConfig = CONFIG,
):
    """The ETP MoE GPT under mf-fsdp: dense mesh ``(dp_outer, dp)``, experts ``(.., ep, etp)``."""
    edp = world // (outer * ep * etp)
    if outer == 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        expert_mesh = init_device_mesh("cpu", (edp, ep, etp), mesh_dim_names=("dp", "ep", "etp"))
        hsdp = {}
    else:
        mesh = init_device_mesh("cpu", (outer, world // outer), mesh_dim_names=("dp_outer", "dp"))
        expert_mesh = init_device_mesh(
            "cpu", (outer, edp, ep, etp), mesh_dim_names=("dp_outer", "dp", "ep", "etp")
        )
        hsdp = {"dp_outer_dim": "dp_outer"}
    torch.manual_seed(0)
    module = MoEGPT(config, _group(expert_mesh, "ep"), _group(expert_mesh, "etp"))
    out_weight = module.blocks[0].moe.experts.out_weight  # [E, H, F] over (ep, etp)
    if ep * etp > 1:
        local = out_weight.to_local().shape
        assert (local[0], local[2]) == (config.num_experts // ep, config.expert_ffn_size // etp)
        assert out_weight.full_tensor().shape[0] == config.num_experts
    if ep > 1 and etp > 1:  # row-wise: F is out_weight's dim 2
        assert out_weight.placements == (Shard(0), Shard(2)), out_weight.placements
    opt = make_optimizer(opt_name, module.parameters())
    model, opt = mf_fsdp.fully_shard(
        module,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp",
        expt_device_mesh=expert_mesh,
        fsdp_unit_modules=[MoEBlock],
        zero_dp_strategy=zero,
        **hsdp,
    )
    return model, opt


def _rank_parity(rank: int, world: int, configs: list[tuple[int, int, int, int, str]]) -> None:
    """``configs``: (ep, etp, dp_outer, zero, optimizer) each trained against one process."""
    references = {}
    for ep, etp, outer, zero, opt_name in configs:
        if opt_name not in references:
            references[opt_name] = reference_run(
                opt_name, world, STEPS, clip=CLIP, make=make_moe, optimizer=make_optimizer
            )
        model, opt = _sharded(world, ep, etp, opt_name, zero, outer)
        losses = _train(model, opt, rank, world, STEPS)
        label = f"ep{ep} etp{etp} outer{outer} zero{zero} {opt_name}"
        _check(losses, _full(model), *references[opt_name], label)


@pytest.mark.multiprocess
def test_etp2_world2_zero1_to_3_match_one_process():
    configs = [(1, 2, 1, zero, opt) for opt in ("sgd", "adam") for zero in (1, 2, 3)]
    run_on_ranks(_rank_parity, 2, configs, timeout=300)


@pytest.mark.multiprocess
def test_ep2_etp2_and_etp2_edp2_and_hsdp_world4_match_one_process_with_expert_rng(tmp_path):
    configs = [
        (2, 2, 1, 3, "sgd"),  # (ep, etp, edp) = (2, 2, 1)
        (2, 2, 1, 1, "adam"),
        (1, 2, 1, 3, "adam"),  # (1, 2, 2): ETP 2, the experts sharded over edp 2
        (1, 2, 2, 3, "sgd"),  # HSDP: dp_outer 2 x (ep, etp, edp) = (1, 2, 1)
    ]
    run_on_ranks(_rank_world4, 4, configs, str(tmp_path), timeout=400)


def _rank_checkpoint(rank: int, world: int, root: str) -> None:
    save_at, more = 2, 2
    model, opt = _sharded(world, 2, 2, "adam", 3)
    _train(model, opt, rank, world, save_at)
    path = mf_fsdp.save_checkpoint(f"{root}/ep2etp2", model, opt, step=save_at)
    uninterrupted = _train(model, opt, rank, world, more, first_step=save_at)
    model, opt = _sharded(world, 1, 1, "adam", 3)  # whole experts, sharded over edp 4
    assert mf_fsdp.load_checkpoint(path, model, opt)["step"] == save_at
    resumed = _train(model, opt, rank, world, more, first_step=save_at)
    torch.testing.assert_close(
        torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-5, atol=1e-6
    )
    if rank == 0:  # every expert, whole: the plain model loads it strictly
        full = mf_fsdp.checkpoint_to_full_state_dict(path)
        assert full["blocks.0.moe.experts.out_weight"].shape == (
            CONFIG.num_experts,
            CONFIG.d_model,
            CONFIG.expert_ffn_size,
        )
        MoEGPT(CONFIG).load_state_dict(full, strict=True)
    dist.barrier()


@pytest.mark.multiprocess
def test_checkpoint_at_ep2_etp2_loads_at_ep1_etp1_and_into_the_plain_model(tmp_path):
    run_on_ranks(_rank_checkpoint, 4, str(tmp_path), timeout=300)


def _rank_expert_rng(rank: int, world: int) -> None:
    """mf-rng's expert state at (ep, etp, edp) = (2, 2, 1) and (1, 2, 2).

    Expert dropout (mf-rng's expert-parallel tracker, seeded by the ``ep`` and ``etp``
    ranks) must draw the same mask on ranks holding the same expert shares (the edp
    replicas) and other masks on ranks holding other shares.
    """
    for shape in ((1, 2, 2), (2, 1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep", "etp"))
        mf_rng.register_model_parallel_group("ep", mesh["ep"].get_group())
        mf_rng.register_model_parallel_group("etp", mesh["etp"].get_group())
        try:
            mf_rng.model_parallel_cuda_manual_seed(1234)
            with mf_rng.get_cuda_rng_tracker().fork(mf_rng.get_expert_parallel_rng_tracker_name()):
                mask = torch.rand(64)
        finally:
            mf_rng.register_model_parallel_group("ep", None)
            mf_rng.register_model_parallel_group("etp", None)
        masks = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(masks, mask)
        share = (mesh["ep"].get_local_rank(), mesh["etp"].get_local_rank())
        shares: list[tuple[int, int] | None] = [None] * world
        dist.all_gather_object(shares, share)
        for other in range(world):
            same = torch.equal(masks[other], mask)
            assert same == (shares[other] == share), (shape, rank, other, shares)


def _rank_tp_etp(rank: int, world: int) -> None:
    """Attention TP 2 x dp 2, the experts ETP 2 over the dp ranks of each TP rank (separate)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expert_mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "etp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    ref_losses, ref_params = reference_run(
        "sgd", 2, STEPS, clip=CLIP, make=make_moe, optimizer=make_optimizer
    )
    module = MoEGPTTensorParallel(
        CONFIG, mesh["tp"].get_group(), etp_group=expert_mesh["etp"].get_group()
    )
    module.load_full_weights(make_moe().state_dict())
    opt = make_optimizer("sgd", module.parameters())
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
    _check(losses, _full(model), ref_losses, ref_params, "tp2 x etp2 sgd")


def _few_experts(experts: int) -> MoEGPTConfig:
    return dataclasses.replace(CONFIG, num_experts=experts, top_k=min(CONFIG.top_k, experts))


def _make_few(experts: int) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(_few_experts(experts))


def _rank_experts_that_do_not_split_over_edp(
    rank: int, world: int, experts: int, optimizers: tuple[str, ...], root: str | None
) -> None:
    """(ep, etp, edp) = (1, 2, 2) with ``experts`` (3, or 1) that do not split over edp 2.

    Each grouped weight is cut along the dim ETP leaves whole (``fc_weight``
    ``[E, F / 2, H]`` along H, ``out_weight`` ``[E, H, F / 2]`` along H), so every
    rank holds a share of every expert and the same bytes; whole experts gave one
    edp rank 2 of 3 experts and the other 1 (and one expert was refused). Trains
    equal to one process; with ``root``, its checkpoint loads at (1, 1, 4) and,
    through DSD's full state dict, into the plain model strictly.
    """
    config, make = _few_experts(experts), functools.partial(_make_few, experts)
    for opt_name in optimizers:
        ref_losses, ref_params = reference_run(
            opt_name, world, STEPS, clip=CLIP, make=make, optimizer=make_optimizer
        )
        model, opt = _sharded(world, 1, 2, opt_name, 3, config=config)
        label = f"{experts} experts ep1 etp2 edp2 {opt_name}"
        stacked = {n: p for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3}
        per_rank = expert_bytes(model)
        assert_balanced({n: per_rank[n] for n in stacked}, label)
        for name, param in stacked.items():
            held = param.to_local().shape[0]
            assert held == experts, f"{label}: {name} holds a share of {held} of {experts} experts"
            etp_dim = 1 if name.endswith("fc_weight") else 2  # column- / row-wise
            assert param.placements == (Shard(3 - etp_dim), Shard(etp_dim)), param.placements
        if rank == 0 and opt_name == optimizers[0]:
            for name in stacked:
                print(f"{label}: {name} bytes per rank {per_rank[name]}")
        losses = _train(model, opt, rank, world, STEPS)
        _check(losses, _full(model), ref_losses, ref_params, label)
    if root is None:
        return
    path = mf_fsdp.save_checkpoint(f"{root}/few", model, opt, step=STEPS)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        make().load_state_dict(full, strict=True)
    model, opt = _sharded(world, 1, 1, optimizers[-1], 3, config=config)  # over edp 4
    assert mf_fsdp.load_checkpoint(path, model, opt)["step"] == STEPS
    for name, value in _full(model).items():
        torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL)


def _rank_world4(
    rank: int, world: int, configs: list[tuple[int, int, int, int, str]], root: str
) -> None:
    _rank_expert_rng(rank, world)
    _rank_tp_etp(rank, world)
    _rank_parity(rank, world, configs)
    _rank_experts_that_do_not_split_over_edp(rank, world, 3, ("sgd", "adam"), root)
    _rank_experts_that_do_not_split_over_edp(rank, world, 1, ("sgd",), None)
