"""Distributed checkpoints: resume parity, resharding, crash safety, wrong model, round trips.

Start with ``test_resume_parity``: a ZeRO-3 run on 2 ranks trains 6 steps,
saves, and trains 4 more; a fresh model and a fresh optimizer (empty state)
load the step-6 checkpoint and train the same 4 steps on 2 ranks (ZeRO-3,
ZeRO-0, ZeRO-1) and on 1 rank. The global batch of a step is the same
whatever the world size (each rank takes its slice of it). A fresh optimizer
already holds its state at its fresh values (``fully_shard`` creates it, see
[Note: eager optimizer state]); it has taken no step.

Tolerance: 1e-6 (fp32). The continuation does the same arithmetic on the same
values; only a different strategy or world size sums gradients in another
order, a rounding-level difference. Adam runs with ``eps=1e-4``: the key bias
of attention has a zero gradient (softmax ignores a constant added to every
score), so its "gradient" is rounding noise, which Adam's default ``eps=1e-8``
normalises into lr-sized steps; on another world size the noise differs and
those entries (only those) then differ by ~1e-4 (measured; 3e-6 with
``eps=1e-6``), a property of Adam, not of the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path
from unittest import mock

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

import mf_fsdp
from mf.models import GPT, GPTConfig
from tests._multiprocess import cpu_mesh, run_on_ranks
from tests.fsdp._helpers import CONFIG, batch, full_params, make_model, unit_classes

TOL = {"rtol": 1e-6, "atol": 1e-6}
SAVE_AT, MORE = 6, 4
GLOBAL_SAMPLES = 4  # batch(step, 0) and batch(step, 1), 2 samples each


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, r) for r in range(2)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = _global_batch(step)
    per = GLOBAL_SAMPLES // world
    return tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":  # momentum: the optimizer state matters
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # eps: see the module docstring (a zero gradient's rounding noise).
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def _wrap(opt_name: str, strategy: int, seed: int = 0, config: GPTConfig = CONFIG, **kwargs):
    """``fully_shard`` of a tiny GPT; ``kwargs`` (e.g. a device mesh) go to ``fully_shard``."""
    module = make_model(seed, config)
    return mf_fsdp.fully_shard(
        module,
        _optimizer(opt_name, module.parameters()),
        fsdp_unit_modules=unit_classes(),
        zero_dp_strategy=strategy,
        **kwargs,
    )


def _train(model, opt, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*_local_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _check(result, expected, label: str) -> None:
    losses, params = result
    ref_losses, ref_params = expected
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), **TOL, msg=lambda m: f"{label}: {m}"
    )
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            params[name], ref, **TOL, msg=lambda m, name=name: f"{label} {name}: {m}"
        )


def _resume(path: Path, opt_name: str, strategy: int, rank: int, world: int, **kwargs):
    # Other weights (seed 1): the load must replace them.
    model, opt = _wrap(opt_name, strategy, seed=1, **kwargs)
    _assert_fresh(opt)
    info = mf_fsdp.load_checkpoint(path, model, opt)
    assert info == {"step": SAVE_AT, "opt": opt_name}
    losses = _train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + MORE))
    return losses, full_params(model)


def _assert_fresh(opt: torch.optim.Optimizer) -> None:
    """State exists for every parameter, at the values a never-stepped optimizer starts from."""
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.state) == len(params)
    for state in opt.state.values():
        assert float(state.get("step", 0)) == 0
        for key, value in state.items():
            if key != "step":
                full = value.full_tensor() if isinstance(value, DTensor) else value
                assert not torch.count_nonzero(full), key


def _rank_resume_save(rank: int, world: int, root: str) -> None:
    for opt_name in ("sgd", "adam"):
        model, opt = _wrap(opt_name, 3)
        _train(model, opt, rank, world, range(SAVE_AT))
        path = mf_fsdp.save_checkpoint(
            Path(root) / opt_name, model, opt, step=SAVE_AT, extra={"opt": opt_name}
        )
        assert path == Path(root) / opt_name / "step_0000006"
        expected = (_train(model, opt, rank, world, range(SAVE_AT, SAVE_AT + MORE)),)
        expected += (full_params(model),)
        if rank == 0:
            torch.save(expected, Path(root) / f"{opt_name}.expected.pt")
        for strategy in (3, 0, 1):
            result = _resume(path, opt_name, strategy, rank, world)
            _check(result, expected, f"{opt_name} world {world} z3 -> z{strategy}")


def _rank_resume_load(rank: int, world: int, root: str) -> None:
    for opt_name in ("sgd", "adam"):
        expected = torch.load(Path(root) / f"{opt_name}.expected.pt")
        path = mf_fsdp.latest_checkpoint(Path(root) / opt_name)
        for strategy in (3, 2):
            result = _resume(path, opt_name, strategy, rank, world)
            _check(result, expected, f"{opt_name} world 2 -> {world} z{strategy}")


@pytest.mark.multiprocess
def test_resume_parity(tmp_path: Path) -> None:
    run_on_ranks(_rank_resume_save, 2, str(tmp_path), timeout=240)
    run_on_ranks(_rank_resume_load, 1, str(tmp_path), timeout=240)


# ---------------------------------------------------------------- crash safety
def _kill_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_crash(rank: int, world: int, root: str) -> None:
    model, opt = _wrap("adam", 3)
    _train(model, opt, rank, world, range(1))
    mf_fsdp.save_checkpoint(root, model, opt, step=1)
    snapshot = full_params(model)
    if rank == 0:
        torch.save(snapshot, Path(root) / "snapshot.pt")
    _train(model, opt, rank, world, range(1, 2))
    dist.barrier()
    # Rank 1 dies while DCP writes checkpoint 2; rank 0 may have written its part.
    killer = mock.patch.object(FileSystemWriter, "write_data", _kill_self)
    with killer if rank == 1 else contextlib.nullcontext():
        mf_fsdp.save_checkpoint(root, model, opt, step=2)


def _rank_after_crash(rank: int, world: int, root: str) -> None:
    root_path = Path(root)
    snapshot = torch.load(root_path / "snapshot.pt")
    model, opt = _wrap("adam", 0, seed=1)
    assert mf_fsdp.load_checkpoint(mf_fsdp.latest_checkpoint(root), model, opt) == {"step": 1}
    for name, value in full_params(model).items():
        assert torch.equal(value, snapshot[name]), name
    # Every rank raises the same clear error, before any collective.
    with pytest.raises(ValueError, match=r"is an incomplete checkpoint \(no mf_checkpoint.json"):
        mf_fsdp.load_checkpoint(root_path / ".step_0000002.partial", model, opt)
    with pytest.raises(ValueError, match="does not exist; expected a checkpoint folder"):
        mf_fsdp.load_checkpoint(root_path / "step_0000099", model)
    if rank == 0:
        shutil.copytree(root_path / "step_0000001", root_path / "flat")
        _make_flat_format(root_path / "flat")
    dist.barrier()
    with pytest.raises(ValueError, match=r"format version 1 .*reads version 3 only"):
        mf_fsdp.load_checkpoint(root_path / "flat", model, opt)
    _check_wrong_model_and_bad_saves(rank, root_path / "other")
    dist.barrier()


@pytest.mark.multiprocess
def test_killed_rank_leaves_previous_checkpoint_intact_and_bad_loads_fail(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"rank 1 --- exited with code -9"):
        run_on_ranks(_rank_crash, 2, str(tmp_path), timeout=120)
    partial = tmp_path / ".step_0000002.partial"
    assert partial.is_dir()
    assert not (partial / mf_fsdp.RECORD_FILE).exists()
    assert not (tmp_path / "step_0000002").exists()
    assert (tmp_path / "step_0000001" / mf_fsdp.RECORD_FILE).is_file()
    assert mf_fsdp.latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        mf_fsdp.checkpoint_to_full_state_dict(partial)
    # Also loads of another model and bad saves (bundled: one process start-up).
    run_on_ranks(_rank_after_crash, 2, str(tmp_path), timeout=120)


# ---------------------------------------------------------------- wrong model
def _check_wrong_model_and_bad_saves(rank: int, root: Path) -> None:
    model, opt = _wrap("sgd", 3)
    path = mf_fsdp.save_checkpoint(root, model, None, step=0)
    wider = GPTConfig(vocab_size=256, seq_len=64, d_model=32, n_layers=2, n_heads=4)
    other, _ = _wrap("sgd", 1, config=wider)
    message = r"saved from a different model: .*wte.weight: checkpoint \(256, 64\) float32 vs "
    with pytest.raises(ValueError, match=message + r"model \(256, 32\) float32; wpe.weight"):
        mf_fsdp.load_checkpoint(path, other)
    deeper = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=3, n_heads=4)
    other, _ = _wrap("sgd", 3, config=deeper)
    with pytest.raises(ValueError, match=r"missing keys \['blocks.2.ln_1.weight'"):
        mf_fsdp.load_checkpoint(path, other)
    with pytest.raises(ValueError, match="holds the state of no optimizer, not of SGD"):
        mf_fsdp.load_checkpoint(path, model, opt)
    adam_path = mf_fsdp.save_checkpoint(root, *_wrap("adam", 3), step=1)
    with pytest.raises(ValueError, match="holds the state of Adam, not of SGD; pass the same"):
        mf_fsdp.load_checkpoint(adam_path, model, opt)
    # Bad saves fail on every rank too (no rank left waiting).
    with pytest.raises(TypeError, match="extra: expected JSON-serialisable values"):
        mf_fsdp.save_checkpoint(root, model, step=2, extra={"t": torch.ones(1)})
    blocker = root / "a_file"
    if rank == 0:
        blocker.write_text("not a folder")
    dist.barrier()
    message = r"save_checkpoint: Not a directory while writing .*a_file/.step_0000001.partial"
    with pytest.raises(RuntimeError, match=message):
        mf_fsdp.save_checkpoint(blocker, model, step=1)
    dist.barrier()


# ---------------------------------------------------------------- full state dicts
def test_full_state_dict_round_trip_is_bit_exact(tmp_path: Path) -> None:
    module = make_model(3)
    full = module.state_dict()
    path = mf_fsdp.full_state_dict_to_checkpoint(full, tmp_path, step=5, extra={"src": "hf"})
    back = mf_fsdp.checkpoint_to_full_state_dict(path)
    assert sorted(back) == sorted(full)
    for name, value in full.items():
        assert back[name].dtype == value.dtype, name
        assert torch.equal(back[name], value), name
    assert back["lm_head.weight"] is back["wte.weight"]  # tied, stored once
    plain = GPT(CONFIG)
    plain.load_state_dict(back)
    file = mf_fsdp.save_full_state_dict(back, tmp_path / "model.safetensors")
    exported = safetensors.torch.load_file(file)
    assert sorted(exported) == sorted(full)
    assert all(torch.equal(exported[name], value) for name, value in full.items())
    with pytest.raises(ValueError, match=r"file: '.*model.pt' must end in .safetensors"):
        mf_fsdp.save_full_state_dict(back, tmp_path / "model.pt")
    # A checkpoint of mf-fsdp 0.1's flat form (record version 1) is refused by name.
    _make_flat_format(path)
    with pytest.raises(ValueError, match=r"format version 1 \(1: the flat form of mf-fsdp 0.1"):
        mf_fsdp.checkpoint_to_full_state_dict(path)


def _make_flat_format(path: Path) -> None:
    """Turn ``path``'s record into one of the old flat format (version 1)."""
    record_file = path / mf_fsdp.RECORD_FILE
    record = json.loads(record_file.read_text())
    record_file.write_text(json.dumps({**record, "version": 1}))


def _rank_sharded_to_full(rank: int, world: int, root: str) -> None:
    model, opt = _wrap("adam", 3)
    _train(model, opt, rank, world, range(3))
    path = mf_fsdp.save_checkpoint(Path(root) / "run", model, opt, step=3)
    sharded = full_params(model)
    with torch.no_grad():
        loss = model(*_local_batch(3, rank, world)).detach()
    dist.all_reduce(loss)
    full = mf_fsdp.checkpoint_to_full_state_dict(path)  # offline: no collective
    plain = GPT(CONFIG)
    plain.load_state_dict(full)
    for name, value in plain.named_parameters():
        assert torch.equal(value, sharded[name]), name
    with torch.no_grad():
        plain_loss = plain(*_global_batch(3))
    torch.testing.assert_close(plain_loss, loss / world, **TOL)
    # model.state_dict() is DCP-ready as it is: parameter-shaped DTensors.
    dcp.save(model.state_dict(), checkpoint_id=str(Path(root) / "raw"))
    copy, _ = _wrap("adam", 3, seed=4)
    target = copy.state_dict()
    dcp.load(target, checkpoint_id=str(Path(root) / "raw"))
    copy.load_state_dict(target)
    for name, value in full_params(copy).items():
        assert torch.equal(value, sharded[name]), name
    with pytest.warns(UserWarning, match="preproc_state_dict_for_dcp_ckpt=False has no effect"):
        mf_fsdp.fully_shard_model(make_model(), preproc_state_dict_for_dcp_ckpt=False)
    # A plain model's weights become a checkpoint any wrapped model loads.
    if rank == 0:
        mf_fsdp.full_state_dict_to_checkpoint(make_model(7).state_dict(), Path(root) / "plain")
    dist.barrier()
    hsdp_mesh = cpu_mesh((1, world), ("dp_outer", "dp_shard"))  # 2-D dp mesh, one replica
    hsdp = {"device_mesh": hsdp_mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer"}
    for strategy, mesh_kwargs in ((1, {}), (3, hsdp)):
        module = make_model(8)
        other = mf_fsdp.fully_shard_model(module, zero_dp_strategy=strategy, **mesh_kwargs)
        info = mf_fsdp.load_checkpoint(mf_fsdp.latest_checkpoint(Path(root) / "plain"), other)
        assert info == {"step": 0}
        loaded = full_params(other)
        for name, value in make_model(7).named_parameters():
            assert torch.equal(loaded[name], value), name


@pytest.mark.multiprocess
def test_sharded_checkpoint_to_full_state_dict(tmp_path: Path) -> None:
    run_on_ranks(_rank_sharded_to_full, 2, str(tmp_path), timeout=120)


def _rank_state_dicts_in_memory(rank: int, world: int) -> None:
    # The state-dict functions on their own (no DCP): a fresh engine and a fresh,
    # still empty optimizer take over a trained one's weights and Adam state and
    # continue exactly, here across strategies (ZeRO-3 -> ZeRO-1).
    trained, trained_opt = _wrap("adam", 3)
    _train(trained, trained_opt, rank, world, range(3))
    model_sd = mf_fsdp.get_model_state_dict(trained)
    optim_sd = mf_fsdp.get_optimizer_state_dict(trained, trained_opt)
    assert set(optim_sd["state"]) == set(model_sd)  # keyed by FQN, every parameter
    assert sorted(optim_sd["param_groups"][0]["params"]) == sorted(model_sd)
    fresh, fresh_opt = _wrap("adam", 1, seed=1)
    _assert_fresh(fresh_opt)
    with pytest.raises(ValueError, match=r"unknown parameters \['nope'\]"):
        mf_fsdp.set_optimizer_state_dict(
            fresh, fresh_opt, {**optim_sd, "state": {**optim_sd["state"], "nope": {}}}
        )
    renamed = [{**optim_sd["param_groups"][0], "params": ["wte.weight"]}]
    with pytest.raises(ValueError, match="do not match the optimizer's"):
        mf_fsdp.set_optimizer_state_dict(fresh, fresh_opt, {**optim_sd, "param_groups": renamed})
    with pytest.raises(ValueError, match=r"missing keys \['wte.weight'\]"):
        mf_fsdp.set_model_state_dict(
            fresh, {k: v for k, v in model_sd.items() if k != "wte.weight"}
        )
    mf_fsdp.set_model_state_dict(fresh, model_sd)
    mf_fsdp.set_optimizer_state_dict(fresh, fresh_opt, optim_sd)
    expected = _train(trained, trained_opt, rank, world, range(3, 5))
    got = _train(fresh, fresh_opt, rank, world, range(3, 5))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL)
    final, reference = full_params(fresh), full_params(trained)
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multiprocess
def test_state_dicts_in_memory_across_strategies() -> None:
    run_on_ranks(_rank_state_dicts_in_memory, 2, timeout=120)
