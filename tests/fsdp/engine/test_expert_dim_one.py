"""Stacked expert weights cut along dim 1 when their experts do not split over the ranks.

See [Note: stacked weights are spread] in ``mf_fsdp/buckets/units.py``. A tiny model
of plain grouped weights (``up`` [E, F, D], ``down`` [E, D, F], every expert applied
to every token) at world 2, 3 experts, so whole experts would give one rank twice the
other's bytes. ``up``'s dim 1 (5 rows) does not split evenly: the ranks hold 3 and 2
rows. Each ZeRO strategy (and ZeRO-3 with the optimizer state on the host) trains 3
steps equal to one process (SGD and AdamW, 1e-5 fp32); the sharded parameters say
``Shard(1)`` and hold ``[E, F_r, D]``; DSD's full
state dict loads into the plain model strictly. ``cut_dim``'s choices are checked on
their own, without processes. HSDP at world 4 (dp_outer 2 x dp_shard 2, replicated or
sharded across dp_outer) trains alike. mf's MoE GPT with 3 experts at world 4 (ep 1, ZeRO-3,
grads clipped) trains equal to one process with its grouped experts on the strided views.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import mf_fsdp
from mf.models.moe_gpt import MOE_PRESETS, MoEBlock, MoEGPT
from mf_fsdp.buckets.units import cut_dim
from mf_utils import set_tensor_model_parallel_attributes
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    batch,
    full_params,
    global_batch_run,
    make_optimizer,
    optimizer_step,
    reference_run,
)

EXPERTS, ROWS, WIDTH, STEPS = 3, 5, 4, 3
RTOL, ATOL = 1e-5, 1e-6
# (ZeRO, optimizer, offload_optimizer_state)
CASES = (
    (0, "sgd", False),
    (1, "adamw", False),
    (2, "sgd", False),
    (3, "sgd", False),
    (3, "adamw", False),
    (3, "adamw", True),
)


class Experts(nn.Module):
    """Grouped weights as transformers and torchtitan store them; each expert sees every token."""

    def __init__(self, experts: int, rows: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, rows, WIDTH) * 0.4)
        self.down = nn.Parameter(torch.randn(experts, WIDTH, rows) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.einsum("nd,efd->nef", x, self.up).tanh()
        return x + torch.einsum("nef,edf->nd", hidden, self.down)


class Net(nn.Module):
    def __init__(self, experts: int = EXPERTS, rows: int = ROWS) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Experts(experts, rows) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11 * step + rank)
    x = torch.randn(6, WIDTH, generator=generator)
    return (model(x) - x.flip(1)).square().mean()


def _reference(opt_name: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's losses and final parameters on the global batch of ``world`` ranks."""
    reference = Net()
    optimizer = make_optimizer(opt_name, reference.parameters())
    return global_batch_run(reference, optimizer, STEPS, world, _loss)


def _rank_trains_exactly(rank: int, world: int) -> None:
    for zero, opt_name, offload in CASES:
        ref_losses, ref_params = _reference(opt_name, world)
        module = Net()
        model, opt = mf_fsdp.fully_shard(
            module,
            make_optimizer(opt_name, module.parameters()),
            fsdp_unit_modules=[Experts],
            zero_dp_strategy=zero,
            offload_optimizer_state=offload,
        )
        if zero:  # ZeRO-0 keeps whole parameters
            for name, param in model.named_parameters():
                if name.endswith(("up", "down")):
                    assert param.placements == (Shard(1),), (name, param.placements)
                    rows = param.shape[1]
                    mine = (rows + 1) // 2 if rank == 0 else rows // 2
                    want = (EXPERTS, mine, param.shape[2])
                    assert tuple(param.to_local().shape) == want, (name, want)
        losses = [optimizer_step(_loss(model, step, rank), opt, world) for step in range(STEPS)]
        label = f"zero {zero} {opt_name} offload {offload}"
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, label, RTOL, ATOL
        )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = Net()
    plain.load_state_dict(full, strict=True)
    for name, value in plain.named_parameters():
        torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL)


def _rank_hsdp(rank: int, world: int) -> None:
    """dp_outer 2 x dp_shard 2: replicas across dp_outer (3 experts over 2 ranks), and
    the optimizer's state sharded across it too (hybrid: over 4 ranks)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    for outer, opt_name in ((0, "sgd"), (1, "adamw")):
        ref_losses, ref_params = _reference(opt_name, world)
        module = Net()
        model, opt = mf_fsdp.fully_shard(
            module,
            make_optimizer(opt_name, module.parameters()),
            device_mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            fsdp_unit_modules=[Experts],
            zero_dp_strategy=3,
            outer_dp_sharding_strategy=outer,
        )
        for name, param in model.named_parameters():
            if name.endswith(("up", "down")):
                assert Shard(1) in param.placements, (name, param.placements)
        losses = [optimizer_step(_loss(model, step, rank), opt, world) for step in range(STEPS)]
        label = f"hsdp outer {outer} {opt_name}"
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, label, RTOL, ATOL
        )


@pytest.mark.multiprocess
def test_hsdp_cuts_experts_along_dim_one_and_trains_exactly() -> None:
    run_on_ranks(_rank_hsdp, 4, timeout=240)


def _moe_gpt() -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(dataclasses.replace(MOE_PRESETS["moe-tiny"], num_experts=3))


def _moe_optimizer(name: str, params) -> torch.optim.Optimizer:
    """AdamW at eps 1e-4, as tests/fsdp/engine/test_experts.py: attention's key bias has
    near-zero grads whose rounding differs between layouts, which eps 1e-8 turns into
    full steps (a dense weight, not the experts)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


def _rank_moe_gpt_three_experts_over_four(rank: int, world: int) -> None:
    """mf's MoE GPT (grouped experts, ``torch._grouped_mm`` on strided weights) at ep 1."""
    for opt_name in ("sgd", "adamw"):
        ref_losses, ref_params = reference_run(
            opt_name, world, STEPS, clip=0.5, make=_moe_gpt, optimizer=_moe_optimizer
        )
        module = _moe_gpt()
        model, opt = mf_fsdp.fully_shard(
            module,
            _moe_optimizer(opt_name, module.parameters()),
            device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
            dp_shard_dim="dp",
            expt_device_mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "ep")),
            fsdp_unit_modules=[MoEBlock],
            zero_dp_strategy=3,
        )
        experts = model.module.blocks[0].moe.experts
        for param in experts.parameters():
            if param.dim() == 3:  # every rank a quarter of each expert's rows
                assert param.placements == (Shard(1),), param.placements
                assert param.to_local().shape[1] * world == param.shape[1], param.shape
        losses = []
        for step in range(STEPS):
            tokens, targets = batch(step, rank)
            clip = functools.partial(mf_fsdp.clip_grad_norm_, model, 0.5)
            losses.append(optimizer_step(model(tokens, targets), opt, world, clip))
        assert_matches_reference(
            losses, full_params(model), ref_losses, ref_params, f"moe-gpt {opt_name}", 1e-5, 1e-5
        )


@pytest.mark.multiprocess
def test_moe_gpt_three_experts_over_four_ranks_train_exactly() -> None:
    run_on_ranks(_rank_moe_gpt_three_experts_over_four, 4, timeout=300)


@pytest.mark.multiprocess
def test_three_experts_over_two_ranks_are_cut_along_dim_one_and_train_exactly() -> None:
    run_on_ranks(_rank_trains_exactly, 2, timeout=240)


def test_cut_dim_chooses_the_first_dim_that_spreads_the_experts_and_tp_leaves_whole() -> None:
    def stacked(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(shape, device="meta"))

    assert cut_dim(stacked(3, 5, 4), 2) == 1  # 3 experts over 2 ranks
    assert cut_dim(stacked(3, 16, 8), 4) == 1  # 3 over 4: one rank would hold none
    assert cut_dim(stacked(1, 16, 8), 4) == 1  # one expert
    assert cut_dim(stacked(4, 16, 8), 2) == 0  # whole experts split evenly
    assert cut_dim(stacked(5, 4, 3), 2) == 0  # 3 and 2 experts: within 1.25x, whole rows
    assert cut_dim(stacked(5, 16, 8), 4) == 1  # 2, 1, 1, 1: 1.6x an even share
    assert cut_dim(stacked(3, 5, 4), 1) == 0  # one rank holds everything
    assert cut_dim(stacked(3, 1, 4), 2) == 2  # fewer rows than ranks along dim 1: dim 2
    assert cut_dim(stacked(3, 1, 1), 2) == 0  # no dim spreads it: whole experts
    assert cut_dim(nn.Parameter(torch.empty(3, 5, device="meta")), 2) == 0  # not stacked

    def split(dim: int, *shape: int) -> nn.Parameter:
        param = stacked(*shape)  # tensor parallel along ``dim`` (expert TP)
        set_tensor_model_parallel_attributes(param, True, dim, 1)
        return param

    assert cut_dim(split(1, 3, 5, 4), 2) == 2  # gate/up [E, F / etp, D]: along D
    assert cut_dim(split(2, 3, 4, 5), 2) == 1  # down [E, D, F / etp]: along D
    assert cut_dim(split(1, 1, 8, 4), 4) == 2  # one expert: never the tp dim
    assert cut_dim(split(1, 3, 8, 1), 2) == 0  # the free dim too short: whole experts
