"""Every rank holds a share of every grouped expert weight ([Note: stacked weights are spread]).

transformers' Qwen3-MoE (tiny, built in code, 4 experts) under ``mf_fsdp.fully_shard``
ZeRO-3, data parallel at world 2: each rank reports the bytes it holds of every
expert weight (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) and none may
be at zero or above 1.5x the mean. Before the stacked weights had buckets of
their own, rank 0 held all of ``gate_up_proj`` and rank 1 three quarters of
``down_proj``. The same run trains 3 steps equal to one process (SGD and
AdamW, 1e-5 fp32: only the order of the ranks' sums differs), and its
checkpoint (mf's DCP save), saved at world 2, loads at world 1 and whole into
the plain model (``strict=True``), as does torch DSD's full state dict.

Fewer experts than the ranks sharding them (torchtitan's ``efsdp x ep > E``): 2
experts at ep 2 x edp 2 (world 4), one expert per EP rank shared by 2 edp ranks,
which each hold half of its dim 1; before, one of them held it whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

import mf_fsdp
import mf_tp
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    full_params,
    global_batch_run,
    make_optimizer,
    optimizer_step,
)

VOCAB, BATCH, SEQ, STEPS, EXPERTS = 64, 2, 8, 3, 4
RTOL, ATOL = 1e-5, 1e-6  # fp32: the ranks' gradients are summed in another order
MOST = 1.5  # no rank above 1.5x the mean bytes of a weight


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    """``make_optimizer``'s, with AdamW's ``eps`` at 1e-6 (torchtitan's MoE tests' too).

    A few expert elements get gradients near zero, whose sign follows the order of
    the ranks' fp32 sums; at the default 1e-8 AdamW turns that into whole steps of
    opposite sign (1.5e-5 apart on some CPUs). Above the rounding, 1e-6 keeps them
    small and the comparison tight.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)
    return make_optimizer(name, params)


def _make(experts: int = EXPERTS) -> nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return Qwen3MoeForCausalLM(config)


def _tokens(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _reference(
    opt_name: str, world: int, experts: int = EXPERTS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(experts)
    opt = _optimizer(opt_name, model.parameters())
    return global_batch_run(
        model, opt, STEPS, world, lambda m, step, rank: _loss(m, _tokens(step, rank))
    )


def _sharded(opt_name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    module = _make()
    opt = _optimizer(opt_name, module.parameters())
    return mf_fsdp.fully_shard(
        module, opt, fsdp_unit_modules=[Qwen3MoeDecoderLayer], zero_dp_strategy=3
    )


def expert_bytes(model: nn.Module) -> dict[str, list[int]]:
    """Every rank's bytes of every grouped expert weight (a collective: call on every rank)."""
    mine = {
        name: param.to_local().numel() * param.element_size()
        for name, param in model.named_parameters()
        if ".experts." in name
    }
    every: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: [ranks[name] for ranks in every if ranks is not None] for name in mine}


def assert_balanced(per_rank: dict[str, list[int]], label: str) -> None:
    """No rank without a share of a weight, none above ``MOST`` times the mean."""
    assert per_rank, f"{label}: no expert weights found"
    for name, held in per_rank.items():
        mean = sum(held) / len(held)
        message = (
            f"{label}: {name} bytes per rank {held} (mean {mean:.0f}): expected every rank "
            f"above 0 and none above {MOST}x the mean"
        )
        assert min(held) > 0, message
        assert max(held) <= MOST * mean, message


def _rank_balanced_and_exact(rank: int, world: int, root: str) -> None:
    for opt_name in ("sgd", "adamw"):
        ref_losses, ref_params = _reference(opt_name, world)
        model, opt = _sharded(opt_name)
        per_rank = expert_bytes(model)
        if rank == 0 and opt_name == "sgd":
            for name, held in per_rank.items():
                print(f"world {world} {name}: bytes per rank {held}")
        assert_balanced(per_rank, f"Qwen3-MoE ZeRO-3 world {world}")
        losses = [
            optimizer_step(_loss(model, _tokens(step, rank)), opt, world) for step in range(STEPS)
        ]
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, f"qwen3_moe {opt_name}", RTOL, ATOL
        )
    mf_fsdp.save_checkpoint(f"{root}/ckpt", model, opt, step=STEPS)
    # torch's DSD: a full state dict parameter-shaped, every expert, the plain model loads it.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if rank == 0:
        plain = _make()
        plain.load_state_dict(full, strict=True)
        for name, value in plain.named_parameters():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL)


def _rank_loads(rank: int, world: int, root: str, experts: int, trained_at: int) -> None:
    """The checkpoint trained at ``trained_at`` ranks loads here and into the plain model."""
    (path,) = Path(root, "ckpt").glob("step_*")
    before = _reference("adamw", trained_at, experts)[1]  # what that run trained to
    module = _make(experts)
    model, opt = mf_fsdp.fully_shard(
        module,
        _optimizer("adamw", module.parameters()),
        fsdp_unit_modules=[Qwen3MoeDecoderLayer],
        zero_dp_strategy=3,
    )
    assert mf_fsdp.load_checkpoint(str(path), model, opt)["step"] == STEPS
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, before[name], rtol=RTOL, atol=ATOL)
    plain = _make(experts)  # the checkpoint is parameter-shaped: the plain model loads it whole
    plain.load_state_dict(mf_fsdp.checkpoint_to_full_state_dict(str(path)), strict=True)
    for name, value in plain.named_parameters():
        torch.testing.assert_close(value, before[name], rtol=RTOL, atol=ATOL)


def _rank_fewer_experts_than_ranks(
    rank: int,
    world: int,
    experts: int,
    ep: int,
    root: str | None = None,
    optimizers: tuple[str, ...] = ("sgd", "adamw"),
) -> None:
    """``experts`` experts at ep ``ep`` x edp ``world // ep``: E/ep per EP rank over the edp ranks.

    With ``root``, the last run's checkpoint (mf's DCP) is saved there, and torch
    DSD's full state dict loads into the plain model strictly.
    """
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    label = f"Qwen3-MoE ep {ep} x edp {world // ep}, {experts} experts"
    for opt_name in optimizers:
        ref_losses, ref_params = _reference(opt_name, world, experts)
        module = _make(experts)
        if ep > 1:
            for layer in module.model.layers:
                mf_tp.expert_parallel(layer.mlp.experts, expert_mesh["ep"].get_group())
        model, opt = mf_fsdp.fully_shard(
            module,
            _optimizer(opt_name, module.parameters()),
            device_mesh=mesh,
            dp_shard_dim="dp",
            expt_device_mesh=expert_mesh if ep > 1 else None,
            fsdp_unit_modules=[Qwen3MoeDecoderLayer],
            zero_dp_strategy=3,
        )
        per_rank = expert_bytes(model)
        if rank == 0 and opt_name == "sgd":
            for name, held in per_rank.items():
                print(f"world {world}, {label}, {name}: bytes per rank {held}")
        assert_balanced(per_rank, label)
        for name, param in model.named_parameters():  # DSD/DCP read the placement
            if ".experts." in name:
                assert param.placements[0] == Shard(1), (name, param.placements)
        losses = [
            optimizer_step(_loss(model, _tokens(step, rank)), opt, world) for step in range(STEPS)
        ]
        # AdamW: a gate_up_proj element whose gradient is near zero moves 1.6e-6 (of
        # Adam's 1e-2 a step) with the order of the sums (``_optimizer``).
        atol = 1e-5 if opt_name == "adamw" else ATOL
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, f"{label} {opt_name}", RTOL, atol
        )
    if root is None:
        return
    mf_fsdp.save_checkpoint(f"{root}/ckpt", model, opt, step=STEPS)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        plain = _make(experts)
        plain.load_state_dict(full, strict=True)
        for name, value in plain.named_parameters():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL)


@pytest.mark.multiprocess
def test_fewer_experts_than_ranks_still_gives_every_rank_a_share() -> None:
    """One expert per EP rank: 2 experts at ep 2 x edp 2 (world 4)."""
    run_on_ranks(_rank_fewer_experts_than_ranks, 4, 2, 2, timeout=300)


@pytest.mark.multiprocess
def test_experts_that_do_not_split_over_the_ranks_are_cut_along_dim_one(tmp_path) -> None:
    """3 experts over 4 data-parallel ranks, and 6 at ep 2 x edp 2 (3 per EP rank over 2).

    Whole experts left one rank of 4 without any of each weight (3 over 4) and
    gave one of 2 edp ranks two experts of 3 (2x the other's bytes); cut along
    dim 1, every rank holds ``[E, F / world, D]``. The 3-expert checkpoint loads
    at world 2 (where 3 experts over 2 ranks are cut along dim 1 again) and into
    the plain model. The EP case runs SGD only (the gradient scale; AdamW is run by
    the first case and by test_expert_dim_one.py).
    """
    run_on_ranks(_rank_fewer_experts_than_ranks, 4, 3, 1, str(tmp_path), timeout=300)
    run_on_ranks(_rank_loads, 2, str(tmp_path), 3, 4, timeout=120)
    run_on_ranks(_rank_fewer_experts_than_ranks, 4, 6, 2, None, ("sgd",), timeout=300)


@pytest.mark.multiprocess
def test_every_rank_holds_a_share_of_every_expert_weight_and_trains_exactly(tmp_path) -> None:
    run_on_ranks(_rank_balanced_and_exact, 2, str(tmp_path), timeout=240)
    run_on_ranks(_rank_loads, 1, str(tmp_path), EXPERTS, 2, timeout=120)
