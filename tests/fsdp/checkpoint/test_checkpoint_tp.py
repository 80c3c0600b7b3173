"""Checkpoints of mf-tp layers sharded by FSDP on a (dp_shard=2, tp=2) mesh (4 ranks).

The tp ranks hold different slices of a partitioned weight; the checkpoint
stores every parameter in its full (tp-gathered) shape, each rank writing its
own box of it, so nothing is overwritten: a ZeRO-3 save loads into ZeRO-1
bit-exact, and the offline full state dict holds the tp-gathered weights
(column- and row-parallel), which a plain model loads.

A checkpoint of ``mf.models.GPTTensorParallel`` (vocab-parallel embedding,
fused qkv of partition stride 3) saved at tp 2 x dp 2 resumes at tp 1 x dp 2
and tp 2 x dp 1 with the same losses (1e-6, test_checkpoint's tolerance).
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
from mf.models import GPTTensorParallel, TensorParallelBlock
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import full_params, make_model
from tests.fsdp.checkpoint.test_checkpoint import MORE, SAVE_AT, _check, _local_batch, _optimizer

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


# ---------------------------------------------------------------- resharding across tp sizes
def _gpt_tp(tp_size: int, dp_size: int, opt_name: str, seed: int):
    """The TP GPT on a (dp, tp) mesh, ZeRO-3, weights of the plain GPT of ``seed``."""
    mesh = cpu_mesh((dp_size, tp_size), ("dp", "tp"))
    plain = make_model(seed)
    module = GPTTensorParallel(plain.config, mesh.get_group("tp"))
    module.load_full_weights(plain.state_dict())
    model, opt = mf_fsdp.fully_shard(
        module,
        _optimizer(opt_name, module.parameters()),
        device_mesh=mesh,
        dp_shard_dim="dp",
        tp_dim="tp",
        fsdp_unit_modules=[TensorParallelBlock],
    )
    return model, opt, mesh.get_local_rank("dp"), dp_size


def _train_tp(model, opt, dp_rank: int, dp_size: int, steps: range) -> list[float]:
    """Each dp rank its slice of the global batch (all tp ranks of a dp rank alike)."""
    losses = []
    for step in steps:
        loss = model(*_local_batch(step, dp_rank, dp_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # the dp ranks' mean is compared by the caller
    return losses


def _mean_over_dp(losses: list[float]) -> list[float]:
    """The mean over all ranks: every tp rank of a dp rank has that dp rank's loss."""
    total = torch.tensor(losses)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def _rank_tp_save(rank: int, world: int, root: str) -> None:
    for opt_name in ("sgd", "adam"):
        model, opt, dp_rank, dp_size = _gpt_tp(2, 2, opt_name, seed=0)
        _train_tp(model, opt, dp_rank, dp_size, range(SAVE_AT))
        mf_fsdp.save_checkpoint(Path(root) / opt_name, model, opt, step=SAVE_AT)
        losses = _train_tp(model, opt, dp_rank, dp_size, range(SAVE_AT, SAVE_AT + MORE))
        expected = (_mean_over_dp(losses), full_params(model))
        if rank == 0:
            torch.save(expected, Path(root) / f"{opt_name}.expected.pt")


def _rank_tp_load(rank: int, world: int, root: str, tp_size: int) -> None:
    for opt_name in ("sgd", "adam"):
        ref_losses, ref_params = torch.load(Path(root) / f"{opt_name}.expected.pt")
        model, opt, dp_rank, dp_size = _gpt_tp(tp_size, world // tp_size, opt_name, seed=1)
        path = mf_fsdp.latest_checkpoint(Path(root) / opt_name)
        assert mf_fsdp.load_checkpoint(path, model, opt) == {"step": SAVE_AT}
        losses = _train_tp(model, opt, dp_rank, dp_size, range(SAVE_AT, SAVE_AT + MORE))
        got = _mean_over_dp(losses), full_params(model)
        _check(got, (ref_losses, ref_params), f"{opt_name} tp2 x dp2 -> tp{tp_size} x dp{dp_size}")


@pytest.mark.multiprocess
def test_gpt_tensor_parallel_checkpoint_reshards_across_tp_sizes(tmp_path: Path) -> None:
    """A tp 2 x dp 2 save of GPTTensorParallel (fused qkv of stride 3) resumes at tp 1 and tp 2."""
    run_on_ranks(_rank_tp_save, 4, str(tmp_path), timeout=180)
    run_on_ranks(_rank_tp_load, 2, str(tmp_path), 1, timeout=180)  # tp 1 x dp 2
    run_on_ranks(_rank_tp_load, 2, str(tmp_path), 2, timeout=180)  # tp 2 x dp 1
