"""Checkpoints of mf-tp layers sharded by FSDP on a (dp_shard=2, tp=2) mesh (4 ranks).

The tp ranks hold different slices of a partitioned weight; the checkpoint
stores every parameter in its full (tp-gathered) shape, each rank writing its
own box of it, so nothing is overwritten: a ZeRO-3 save loads into ZeRO-1
bit-exact, and the offline full state dict holds the tp-gathered weights
(column- and row-parallel), which a plain model loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mf_fsdp
import mf_tp
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import full_params

H, FFN = 8, 16


def _init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, std=0.5)


class _TPMLP(nn.Module):
    def __init__(self, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        config = mf_tp.ModelParallelConfig(
            tensor_model_parallel_size=2, use_cpu_initialization=True
        )
        self.norm = nn.LayerNorm(H)
        self.fc1 = mf_tp.ColumnParallelLinear(
            H,
            FFN,
            config=config,
            init_method=_init,
            keep_master_weight_for_test=True,
            tp_group=tp_group,
        )
        self.fc2 = mf_tp.RowParallelLinear(
            FFN,
            H,
            config=config,
            init_method=_init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            keep_master_weight_for_test=True,
            tp_group=tp_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(self.norm(x))
        out, _ = self.fc2(F.gelu(hidden))
        return out.square().mean()


def _plain_forward(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    hidden = F.linear(
        F.layer_norm(x, (H,), state["norm.weight"], state["norm.bias"]),
        state["fc1.weight"],
        state["fc1.bias"],
    )
    out = F.linear(F.gelu(hidden), state["fc2.weight"], state["fc2.bias"])
    return out.square().mean()


def _wrap(mesh, strategy: int, seed: int):
    torch.manual_seed(seed)
    module = _TPMLP(mesh.get_group("tp"))
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    model, opt = mf_fsdp.fully_shard(
        module,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        zero_dp_strategy=strategy,
    )
    return module, model, opt


def _step(model, opt, dp_rank: int, step: int) -> torch.Tensor:
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(10 * step + dp_rank))
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _rank_tp(rank: int, world: int, root: str) -> None:
    mesh = cpu_mesh((2, 2), ("dp_shard", "tp"))
    dp_rank = mesh.get_local_rank("dp_shard")
    module, model, opt = _wrap(mesh, 3, seed=0)
    masters = {"fc1.weight": module.fc1.master_weight, "fc2.weight": module.fc2.master_weight}
    path0 = mf_fsdp.save_checkpoint(root, model, opt, step=0)
    full0 = mf_fsdp.checkpoint_to_full_state_dict(path0)
    for name, master in masters.items():
        assert torch.equal(full0[name], master), name  # tp ranks kept apart, gathered right
    _step(model, opt, dp_rank, 0)
    path1 = mf_fsdp.save_checkpoint(root, model, opt, step=1)
    saved = full_params(model)
    _, other, other_opt = _wrap(mesh, 1, seed=5)
    assert mf_fsdp.load_checkpoint(path1, other, other_opt) == {"step": 1}
    for name, value in full_params(other).items():
        assert torch.equal(value, saved[name]), name
    # The offline full state dict is the plain (tp-gathered) model: same loss.
    full1 = mf_fsdp.checkpoint_to_full_state_dict(path1)
    assert full1["fc1.weight"].shape == (FFN, H)
    assert full1["fc2.weight"].shape == (H, FFN)
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        sharded_loss = other(x)
    torch.testing.assert_close(_plain_forward(full1, x), sharded_loss, rtol=1e-6, atol=1e-6)
    # The tp-gathered full state dict also loads directly (each tp rank takes its slice).
    _, third, _ = _wrap(mesh, 3, seed=7)
    mf_fsdp.set_model_state_dict(third, full1)
    for name, value in full_params(third).items():
        assert torch.equal(value, saved[name]), name
    # Both continue identically (the optimizer state came back too).
    torch.testing.assert_close(_step(other, other_opt, dp_rank, 1), _step(model, opt, dp_rank, 1))
    expected = full_params(model)
    for name, value in full_params(other).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6)
    dist.barrier()


@pytest.mark.multiprocess
def test_tensor_parallel_checkpoint(tmp_path: Path) -> None:
    run_on_ranks(_rank_tp, 4, str(tmp_path), timeout=180)
