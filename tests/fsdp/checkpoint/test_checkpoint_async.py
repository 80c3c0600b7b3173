"""Asynchronous checkpoints: the same files as a synchronous save, written while training goes on.

``save_checkpoint(..., async_save=True)`` returns a future once the state is
staged in host memory (see [Note: asynchronous save]). Checked on 2 gloo ranks:
the published checkpoint holds the same data files, byte for byte, as a
synchronous save of the same state, although the model trains on before the
write ends; a second save waits for the first; a failed write is raised by
the future on every rank, leaving nothing behind; and a rank killed during the
background write leaves the previous checkpoint the newest and loadable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import mf_fsdp
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import batch, full_params, make_model, unit_classes


def _wrap():
    module = make_model(0)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    return mf_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=unit_classes())


def _train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        model(*batch(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _data_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.suffix == ".distcp"}


def _rank_same_as_sync(rank: int, world: int, root: str) -> None:
    root_path = Path(root)
    model, optimizer = _wrap()
    _train(model, optimizer, rank, range(2))
    snapshot = full_params(model)
    sync = mf_fsdp.save_checkpoint(root_path / "sync", model, optimizer, step=2)
    future = mf_fsdp.save_checkpoint(root_path / "async", model, optimizer, step=2, async_save=True)
    _train(model, optimizer, rank, range(2, 4))  # the write must not see these steps
    path = future.result(timeout=60)
    assert path == root_path / "async" / "step_0000002"
    assert mf_fsdp.latest_checkpoint(root_path / "async") == path
    if rank == 0:
        assert _data_files(path) == _data_files(sync)
        records = [json.loads((p / mf_fsdp.RECORD_FILE).read_text()) for p in (sync, path)]
        for record in records:  # DCP's metadata names the folder it was written to
            del record["files"][".metadata"]
        assert records[0] == records[1]
    # A second asynchronous save starts after the first has ended; a load waits too.
    first = mf_fsdp.save_checkpoint(root_path / "async", model, optimizer, step=3, async_save=True)
    second = mf_fsdp.save_checkpoint(root_path / "async", model, optimizer, step=4, async_save=True)
    assert first.done()
    fresh, fresh_optimizer = _wrap()
    assert mf_fsdp.load_checkpoint(path, fresh, fresh_optimizer) == {"step": 2}
    assert second.done()
    assert second.result() == root_path / "async" / "step_0000004"
    for name, value in full_params(fresh).items():
        assert torch.equal(value, snapshot[name]), name
    # A failed write is the future's RuntimeError, on every rank, with nothing left.
    blocker = root_path / "a_file"
    if rank == 0:
        blocker.write_text("not a folder")
    dist.barrier()
    failed = mf_fsdp.save_checkpoint(blocker, model, step=5, async_save=True)
    with pytest.raises(RuntimeError, match=r"save_checkpoint: Not a directory while writing"):
        failed.result(timeout=60)
    with pytest.raises(TypeError, match="async_save: expected a bool, got 'yes'"):
        mf_fsdp.save_checkpoint(root_path, model, step=6, async_save="yes")
    dist.barrier()


@pytest.mark.multiprocess
def test_async_save_publishes_what_a_sync_save_does(tmp_path: Path) -> None:
    run_on_ranks(_rank_same_as_sync, 2, str(tmp_path), timeout=180)
    assert not any(p.name.endswith(".partial") for p in tmp_path.rglob("*"))


def _kill_self_in_writer(*args, **kwargs):
    assert threading.current_thread() is not threading.main_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_killed_while_writing(rank: int, world: int, root: str) -> None:
    model, optimizer = _wrap()
    _train(model, optimizer, rank, range(1))
    mf_fsdp.save_checkpoint(root, model, optimizer, step=1, async_save=True).result(timeout=60)
    snapshot = full_params(model)  # collective
    if rank == 0:
        torch.save(snapshot, Path(root) / "snapshot.pt")
    _train(model, optimizer, rank, range(1, 2))
    dist.barrier()
    # Rank 1 dies in its background write; rank 0 may have written its part.
    killer = mock.patch.object(FileSystemWriter, "write_data", _kill_self_in_writer)
    with killer if rank == 1 else contextlib.nullcontext():
        future = mf_fsdp.save_checkpoint(root, model, optimizer, step=2, async_save=True)
        _train(model, optimizer, rank, range(2, 3))  # training goes on meanwhile
        future.result(timeout=60)


@pytest.mark.multiprocess
def test_rank_killed_during_background_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"rank 1 --- exited with code -9"):
        run_on_ranks(_rank_killed_while_writing, 2, str(tmp_path), timeout=120)
    assert not (tmp_path / "step_0000002").exists()
    assert mf_fsdp.latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    snapshot = torch.load(tmp_path / "snapshot.pt")
    loaded = mf_fsdp.checkpoint_to_full_state_dict(tmp_path / "step_0000001")
    for name, value in snapshot.items():
        assert torch.equal(loaded[name], value), name
