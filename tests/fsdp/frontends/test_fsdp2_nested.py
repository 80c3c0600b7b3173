"""Nested units on ``mf_fsdp.fsdp2``: attention and MLP units inside layer units inside the root.

FSDP2's order of calls (``fully_shard(layer.attn)``, ``fully_shard(layer.mlp)``,
``fully_shard(layer)``, then the root): the layer unit holds its norms and its scale,
and is gathered around its inner units in the forward and in the backward. Trained
on 2 gloo ranks, the losses and final weights equal one process over both ranks'
batches, with SGD and AdamW, ``reshard_after_forward`` True and False, with and
without activation checkpointing of the layers, with the layer's call before its inner
units' (mf builds its units at the first use, whatever the calls' order), and with ranks
that skip different units (a whole layer on one rank, a layer's MLP on the other), each
unit gathered in a collective of its own. A layer called by itself (outside the root's
forward) gets the mean of the ranks' gradients. The engine itself (``MegatronFSDP`` with
nested ``unit_modules``) trains the same at ZeRO-0 and ZeRO-2.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import mf_fsdp
from mf_fsdp.fsdp2 import fully_shard
from mf_fsdp.fsdp2.records import record_of
from tests._multiprocess import run_on_ranks
from tests.fsdp._fsdp2_port_common import full
from tests.fsdp._helpers import global_batch_run

WORLD = 2
STEPS = 3


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Layer(nn.Module):
    """Own parameters before, between and after its inner units."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(8), _Attn()
        self.norm2, self.mlp = nn.LayerNorm(8), _Mlp()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor, skip_mlp: bool = False) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        if not skip_mlp:
            h = h + self.mlp(self.norm2(h))
        return h * self.scale


class _Model(nn.Module):
    def __init__(self, ac: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.ac = ac

    def forward(self, x: torch.Tensor, skip: tuple[int, int] = (-1, -1)) -> torch.Tensor:
        """``skip``: (a layer not run, a layer run without its MLP)."""
        h = self.inp(x)
        for index, layer in enumerate(self.layers):
            if index == skip[0]:
                continue
            if self.ac:
                h = checkpoint(layer, h, index == skip[1], use_reentrant=False)
            else:
                h = layer(h, index == skip[1])
        return self.head(h)


def _skips(rank: int, skipping: bool) -> tuple[int, int]:
    if not skipping:
        return (-1, -1)
    return (1, -1) if rank == 1 else (-1, 2)


def _loss(model: nn.Module, step: int, rank: int, skipping: bool) -> torch.Tensor:
    torch.manual_seed(100 * step + rank)
    return model(torch.randn(4, 4), _skips(rank, skipping)).pow(2).mean()


def _train(
    rank: int, opt_name: str, reshard: bool, ac: bool, skipping: bool, outer_first: bool = False
) -> None:
    torch.manual_seed(0)
    model = _Model(ac)
    ref = copy.deepcopy(model)
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
    }[opt_name]
    for layer in model.layers:
        calls = [layer.attn, layer.mlp, layer]
        for module in calls[::-1] if outer_first else calls:
            fully_shard(module, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = make(model.parameters())
    # One unit per gather (a window of one): a unit gathered out of the agreed order
    # would pair with another unit's collective instead of sharing a window with it.
    record_of(model).engine.ddp_config.suggested_communication_unit_size = 1
    losses = []
    for step in range(STEPS):
        loss = _loss(model, step, rank, skipping)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone() / WORLD
        dist.all_reduce(total)
        losses.append(total.item())
    ref_losses, ref_weights = global_batch_run(
        ref, make(ref.parameters()), STEPS, WORLD, lambda m, s, r: _loss(m, s, r, skipping)
    )
    where = f"{opt_name}, reshard={reshard}, ac={ac}, skipping={skipping}, outer={outer_first}"
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=where)
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            full(param), ref_weights[name], rtol=1e-5, atol=1e-6, msg=f"{name}, {where}"
        )


def _layer_by_itself(rank: int) -> None:
    """A layer unit called outside the root's forward, its inner units inside it."""
    torch.manual_seed(0)
    model = _Model(False)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        for module in (layer.attn, layer.mlp, layer):
            fully_shard(module)
    fully_shard(model)
    torch.manual_seed(rank)
    x = torch.randn(4, 8)
    out = model.layers[1](x).sum()
    out.backward()
    torch.testing.assert_close(out, ref.layers[1](x).sum())
    grads = {name: torch.zeros_like(p) for name, p in ref.layers[1].named_parameters()}
    for other in range(WORLD):  # the reference: the mean of both ranks' grads
        torch.manual_seed(other)
        ref.zero_grad()
        (ref.layers[1](torch.randn(4, 8)).sum() / WORLD).backward()
        for name, p in ref.layers[1].named_parameters():
            grads[name] += p.grad
    for name, param in model.layers[1].named_parameters():
        torch.testing.assert_close(full(param.grad), grads[name], msg=name)


def _rank_nested(rank: int, world: int) -> None:
    for opt_name, reshard, ac in itertools.product(("sgd", "adamw"), (True, False), (False, True)):
        _train(rank, opt_name, reshard, ac, skipping=False)
    _train(rank, "adamw", True, False, skipping=True)
    _train(rank, "sgd", True, True, skipping=True)
    _train(rank, "sgd", False, False, skipping=False, outer_first=True)
    _layer_by_itself(rank)


@pytest.mark.multiprocess
def test_nested_units_train_equal_to_one_process() -> None:
    run_on_ranks(_rank_nested, WORLD)


def _rank_engine(rank: int, world: int) -> None:
    """``MegatronFSDP(unit_modules=...)`` with nested units, ZeRO-0 and 2, ranks skipping."""
    mesh = dist.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for strategy, ac in itertools.product((0, 2), (False, True)):
        torch.manual_seed(0)
        module = _Model(ac)
        ref = copy.deepcopy(module)
        config = mf_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, suggested_communication_unit_size=1
        )
        units = [(m,) for layer in module.layers for m in (layer, layer.attn, layer.mlp)]
        model = mf_fsdp.MegatronFSDP(
            module,
            mf_fsdp.FSDPDistributedIndex(mesh),
            config,
            unit_modules=units,
            sync_model_each_microbatch=True,
        )
        opt = mf_fsdp.fully_shard_optimizer(torch.optim.AdamW(module.parameters(), lr=0.02))
        losses = []
        for step in range(STEPS):
            loss = _loss(model, step, rank, skipping=True)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach() / world
            dist.all_reduce(total)
            losses.append(total.item())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
        ref_losses, ref_weights = global_batch_run(
            ref, ref_opt, STEPS, world, lambda m, s, r: _loss(m, s, r, skipping=True)
        )
        where = f"z{strategy}, ac={ac}"
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=where)
        for name, param in module.named_parameters():
            torch.testing.assert_close(
                full(param), ref_weights[name], rtol=1e-5, atol=1e-6, msg=f"{name}, {where}"
            )


@pytest.mark.multiprocess
def test_nested_units_on_the_engine_at_zero_0_and_2() -> None:
    """The engine's other strategies: ZeRO-0/1 thread every unit's inputs (its backward
    ends at its own identity), ZeRO-2 shards grads only; ZeRO-1 differs from 0 only in the
    optimizer step, ZeRO-3 is the front end's (above)."""
    run_on_ranks(_rank_engine, WORLD)
