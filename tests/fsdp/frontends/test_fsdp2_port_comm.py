"""torch's FSDP2 tests of gradient reduction (``test_fully_shard_comm.py``, HSDP training).

Each scenario is a function of the ``fully_shard`` it is given and runs once
per engine in the same two gloo ranks (``on_both``) against torch's own
reference (hand-reduced gradients, or ``replicate``), with torch's assertions
(``check_sharded_parity`` cutting the reference in each engine's layout); the
two engines' losses are compared as well. torch runs these at 4 or 8 GPUs: the
meshes are world 2's (1-D, and the HSDP ``(1, 2)`` and ``(2, 1)``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.distributed._tensor.common_dtensor import (
    ModelArgs,
    Transformer,
    TransformerBlock,
)

from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._fsdp2_conformance import (
    RANK_MODULES,
    WORLD,
    check_sharded_parity,
    replicated_reference,
    torch_case,
)
from tests.fsdp._fsdp2_port_common import on_both

preload_in_ranks(*RANK_MODULES)

_MESH_SHAPES = ((WORLD,), (1, WORLD), (WORLD, 1))
"""1-D, and both HSDP meshes of two ranks (one shard group of 2; two replicas of 1)."""


def _mesh(shape: tuple[int, ...]):
    names = ("outer",) if len(shape) == 1 else ("outer", "inner")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _set_reduce_scatter_divide_factor(
    fully_shard, case: TestCase, factor: float, shape: tuple[int, ...]
) -> list:
    """The root's factor divides the root's own gradients; the blocks keep the mean.

    FSDP2's ``set_gradient_divide_factor`` sets the factor of the module's own
    parameter group: called on the root, the blocks (units of their own) still
    average over the ranks. The reference sums each gradient over the ranks after
    dividing it by the factor its parameter's unit uses.
    """
    torch.manual_seed(42)
    args = ModelArgs(dropout_p=0.0, weight_tying=False)
    model = Transformer(args)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    mesh = _mesh(shape)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, reshard_after_forward=False, mesh=mesh)
    fully_shard(model, reshard_after_forward=False, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.set_gradient_divide_factor(factor)
    if fully_shard is torch_fully_shard:
        # gloo has no PREMUL_SUM, FSDP2's op for a factor: sum, then scale.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    block_params = {
        param
        for module in ref_model.modules()
        if isinstance(module, TransformerBlock)
        for param in module.parameters()
    }
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, args.vocab_size, (2, 16))
    losses = []
    for _ in range(3):
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        for param in ref_model.parameters():
            param.grad.mul_(1.0 / (WORLD if param in block_params else factor))
            dist.all_reduce(param.grad)
        loss = model(inp).sum()
        loss.backward()
        ref_optim.step()
        optim.step()
        case.assertEqual(ref_loss, loss)
        check_sharded_parity(case, ref_model, model)
        ref_optim.zero_grad()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _train_parity_hsdp(
    fully_shard,
    case: TestCase,
    reshard_after_forward: bool,
    checkpointed: bool,
    mlp_dim: int,
    sync_at_last: bool,
    offload: bool,
) -> list:
    """HSDP over two replicas of one rank (torch's shape at world 2) against ``replicate``.

    Three micro-batches per step, with the gradient sync off until the last one
    when ``sync_at_last``; parity after the backwards and after each step.
    """
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(42)
    model = nn.Sequential(
        nn.LayerNorm(mlp_dim, bias=False),
        MLP(mlp_dim, dim_multiplier=3),
        MLP(mlp_dim),
        MLP(mlp_dim, dim_multiplier=3),
    )
    ref_model = replicated_reference(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": policy,
    }
    for mlp in model:
        if checkpointed:
            checkpoint(mlp)
        fully_shard(mlp, **kwargs)
    fully_shard(model, **kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    check_sharded_parity(case, ref_model, model)
    torch.manual_seed(42 + dist.get_rank() + 1)
    losses = []
    for iter_idx in range(3):
        for micro in range(3):
            if sync_at_last:
                model.set_requires_gradient_sync(micro == 2)
            inp = torch.randn((8, mlp_dim))
            pair = [one(inp).sum() for one in (ref_model, model)]
            for loss in pair:
                loss.backward()
            case.assertEqual(pair[0], pair[1])
            losses.append(pair[1].detach())
        check_sharded_parity(case, ref_model, model)
        for one in (ref_optim, optim):
            one.step()
            one.zero_grad(set_to_none=iter_idx % 2 == 0)
        check_sharded_parity(case, ref_model, model)
    return losses


def _rank_divide_factor(rank: int, world: int) -> None:
    case = torch_case()
    for factor, shape in ((WORLD * 2, _MESH_SHAPES[0]), (WORLD, _MESH_SHAPES[1])):
        on_both(case, _set_reduce_scatter_divide_factor, case, factor, shape)
    # Two replicas of one rank: torch's FSDP2 on gloo (summing, then scaling, for
    # want of PREMUL_SUM) misses torch's own reference here, so mf runs alone.
    on_both(
        case, _set_reduce_scatter_divide_factor, case, WORLD * 2, _MESH_SHAPES[2], torch_runs=False
    )


def _rank_hsdp(rank: int, world: int) -> None:
    case = torch_case()
    subtests = (
        (True, False, 3, True, False),
        (False, True, 17, False, False),
        (True, False, 16, False, True),
    )
    for subtest in subtests:
        on_both(case, _train_parity_hsdp, case, *subtest)


@pytest.mark.multiprocess
def test_set_reduce_scatter_divide_factor_matches_torch() -> None:
    """``TestFullyShardCommunication::test_set_reduce_scatter_divide_factor`` on both engines."""
    run_on_ranks(_rank_divide_factor, WORLD)


@pytest.mark.multiprocess
def test_train_parity_hsdp_matches_torch() -> None:
    """``TestFullyShardHSDPTraining::test_train_parity_hsdp`` (3 of its subtests) on both."""
    run_on_ranks(_rank_hsdp, WORLD)
