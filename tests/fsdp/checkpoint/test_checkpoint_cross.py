"""Checkpoints across features: HSDP, hybrid-sharded HSDP and DTensor tensor parallelism.

- HSDP (ZeRO-3 inside dp_shard, replicas across dp_outer) and hybrid-sharded
  HSDP (``outer_dp_sharding_strategy="optim"``) on a 2x2 (dp_outer, dp_shard)
  mesh, SGD-momentum and Adam: train 6 steps, save, train 4 more; a fresh model
  and optimizer load step 6 (in the same mode and in the other one) and train
  the same 4 steps. The hybrid-sharded checkpoint then loads on 2 ranks into
  plain 1-D ZeRO-3 and ZeRO-1 (another world size and layout) and continues
  with the same losses.
- torch DTensor TP (``parallelize_module``) x FSDP on a (dp=2, tp=2) mesh,
  test_tensor_parallel's model, data and optimizers (plain SGD, Adam): the same
  resume into ZeRO-3 and ZeRO-1 of a fresh model whose weights were changed
  first; the offline full state dict of the step-10 save is the single-process
  reference model's weights (1e-5, test_tensor_parallel's tolerance). A tp split
  of an indivisible dim is refused when wrapping.
- mf-tp layers x hybrid-sharded HSDP on a (dp_outer=2, dp=1, tp=2) mesh (both
  replicas see the same batch, test_tensor_parallel's data follows the dp dim):
  the same resume, then the step-10 save loads bit-exact into a (dp=2, tp=2)
  ZeRO-1 layout.

Tolerance: 1e-6 (fp32), as in test_checkpoint (same arithmetic on the same
values; another layout only reorders sums; the HSDP tests' Adam uses
``eps=1e-4``, see there). Per-test wall time on the shared 2-core machine:
about 14 s, 6 s and 4 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import mf_fsdp
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import full_params
from tests.fsdp.buckets import test_tensor_parallel as tp
from tests.fsdp.checkpoint.test_checkpoint import MORE, SAVE_AT, TOL, _check, _resume, _train, _wrap

MODES = {"hsdp": 0, "hfsdp": "optim"}  # outer_dp_sharding_strategy


def _hsdp_kwargs(mesh, outer) -> dict:
    return {
        "device_mesh": mesh,
        "dp_shard_dim": "dp_shard",
        "dp_outer_dim": "dp_outer",
        "outer_dp_sharding_strategy": outer,
    }


def _rank_hsdp_save(rank: int, world: int, root: str) -> None:
    mesh = cpu_mesh((2, 2), ("dp_outer", "dp_shard"))
    for opt_name in ("sgd", "adam"):
        for mode, outer in MODES.items():
            kwargs = _hsdp_kwargs(mesh, outer)
            model, opt = _wrap(opt_name, 3, **kwargs)
            _train(model, opt, rank, world, range(SAVE_AT))
            path = mf_fsdp.save_checkpoint(
                Path(root) / f"{mode}-{opt_name}", model, opt, step=SAVE_AT, extra={"opt": opt_name}
            )
            expected = (_train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + MORE)),)
            expected += (full_params(model),)
            if rank == 0:
                torch.save(expected, Path(root) / f"{mode}-{opt_name}.expected.pt")
            for into, into_outer in MODES.items():  # same mode, and the other one
                result = _resume(path, opt_name, 3, rank, world, **_hsdp_kwargs(mesh, into_outer))
                _check(result, expected, f"{opt_name} {mode} -> {into}")


def _rank_hsdp_load(rank: int, world: int, root: str) -> None:
    for opt_name in ("sgd", "adam"):
        expected = torch.load(Path(root) / f"hfsdp-{opt_name}.expected.pt")
        path = mf_fsdp.latest_checkpoint(Path(root) / f"hfsdp-{opt_name}")
        for strategy in (3, 1):
            result = _resume(path, opt_name, strategy, rank, world)
            _check(result, expected, f"{opt_name} hfsdp 2x2 -> {world} ranks z{strategy}")


@pytest.mark.multiprocess
def test_hsdp_resume_parity(tmp_path: Path) -> None:
    run_on_ranks(_rank_hsdp_save, 4, str(tmp_path), timeout=240)
    run_on_ranks(_rank_hsdp_load, 2, str(tmp_path), timeout=120)


# ---------------------------------------------------------------- tensor parallel
def _scramble(model: mf_fsdp.MegatronFSDP) -> None:
    """Change every weight, so that only a load can bring back the saved values."""
    with torch.no_grad():
        for _, param in model.optimizer_named_parameters():
            _local(param).add_(0.25)
    model.install_optimized_model_weights()


def _tp_resume(root: Path, build, unit, mesh, opt_name: str, strategies, label: str, **kw):
    """ZeRO-3 trains 6 steps, saves, trains 4; scrambled fresh models load step 6 and match.

    Returns the path of a save after the 10 steps.
    """
    model, opt = tp._wrap(build, mesh, unit, opt_name, zero_dp_strategy=3, **kw)
    tp._train(model, opt, mesh, 1, steps=range(SAVE_AT))
    path = mf_fsdp.save_checkpoint(root, model, opt, step=SAVE_AT)
    losses, _ = tp._train(model, opt, mesh, 1, steps=range(SAVE_AT, SAVE_AT + MORE))
    expected = full_params(model)
    for strategy in strategies:
        other, other_opt = tp._wrap(build, mesh, unit, opt_name, zero_dp_strategy=strategy, **kw)
        _scramble(other)
        assert mf_fsdp.load_checkpoint(path, other, other_opt) == {"step": SAVE_AT}
        resumed, _ = tp._train(other, other_opt, mesh, 1, steps=range(SAVE_AT, SAVE_AT + MORE))
        where = f"{label} z3 -> z{strategy}"
        torch.testing.assert_close(
            torch.tensor(resumed),
            torch.tensor(losses),
            **TOL,
            msg=lambda m, w=where: f"{w} loss {m}",
        )
        for name, value in full_params(other).items():
            torch.testing.assert_close(
                _local(value),
                _local(expected[name]),
                **TOL,
                msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
            )
    return mf_fsdp.save_checkpoint(root, model, opt, step=SAVE_AT + MORE)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _rank_tp(rank: int, world: int, root: str) -> None:
    mesh = cpu_mesh((tp.DP, tp.TP), ("dp", "tp"))
    # Uneven tp slices (3 rows over 2 tp ranks) have no parameter-shaped form: refused.
    uneven = parallelize_module(nn.Linear(tp.H, 3), mesh["tp"], ColwiseParallel())
    with pytest.raises(ValueError, match=r"'weight': DTensor of shape \(3, 16\) is split unevenly"):
        mf_fsdp.fully_shard_model(uneven, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp")
    for opt_name in ("sgd", "adam"):
        where = Path(root) / opt_name
        path = _tp_resume(where, tp.dtensor_model, tp.Block, mesh, opt_name, (3, 1), opt_name)
        # The offline full state dict of the step-10 save is the reference model's.
        _, ref_params, _ = tp.reference_run(opt_name, 1)
        full = mf_fsdp.checkpoint_to_full_state_dict(path)
        assert sorted(full) == sorted(ref_params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                full[name], ref, rtol=tp.RTOL, atol=tp.ATOL, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.multiprocess
def test_dtensor_tp_checkpoint(tmp_path: Path) -> None:
    run_on_ranks(_rank_tp, tp.DP * tp.TP, str(tmp_path), timeout=240)


def _rank_mf_tp_hybrid(rank: int, world: int, root: str) -> None:
    mesh = cpu_mesh((2, 1, tp.TP), ("dp_outer", "dp", "tp"))
    kwargs = {"dp_outer_dim": "dp_outer", "outer_dp_sharding_strategy": "optim"}
    path = _tp_resume(
        Path(root), tp.mf_tp_model, tp.TPBlock, mesh, "adam", (3,), "mf-tp hfsdp", **kwargs
    )
    # Into another dp layout with the same tp size: each rank gets its tp slice back.
    flat = cpu_mesh((tp.DP, tp.TP), ("dp", "tp"))
    other, other_opt = tp._wrap(tp.mf_tp_model, flat, tp.TPBlock, "adam", zero_dp_strategy=1)
    _scramble(other)
    mf_fsdp.load_checkpoint(path, other, other_opt)
    full = mf_fsdp.checkpoint_to_full_state_dict(path)
    for name, value in full_params(other).items():
        assert torch.equal(value, full[name]), name


@pytest.mark.multiprocess
def test_mf_tp_hybrid_sharded_checkpoint(tmp_path: Path) -> None:
    run_on_ranks(_rank_mf_tp_hybrid, 4, str(tmp_path), timeout=180)
