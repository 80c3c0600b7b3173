"""Checkpoints you can trust: loading runs no code, damage is refused, failed saves leave nothing.

- A malicious ``.metadata`` (a pickle whose payload would create a file), with
  its checksum updated as its author would, is refused by name in the offline
  converter and by ``load_checkpoint`` on every rank; the payload never runs.
  So is a checkpoint with a pickled object among its items.
- A flipped byte, a missing file and an extra file are refused by name; with
  ``verify=False`` the flipped byte loads (the option really skips the check).
- A full disk (``ENOSPC`` raised by DCP's writer on one rank) makes every rank
  raise the same error, first line "No space left on device while writing
  <file>", and leaves no ``.partial`` folder; the older checkpoint stays the
  latest.
- Damaged or malformed records, a deleted ``.metadata``, a file or ``None``
  passed as the path: one ``ValueError`` naming the file and what is wrong.
- A checkpoint reads nothing outside its folder: a data path in ``.metadata``
  that leaves the folder (relative or absolute), a data file that is a
  symlink, or one the record does not list is refused by name, in the
  offline converter and in ``load_checkpoint`` on every rank, and the outside
  bytes never reach the weights. A data file holding pickled code is refused
  naming the file, and the code never runs.
- ``verify_checkpoint`` (offline, loading nothing) refuses all of the above and
  a checkpoint of another model or optimizer, and reads every tensor: pickled
  code or garbage in a data file whose checksum was rewritten is named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem

import mf_fsdp
from tests._multiprocess import run_on_ranks
from tests.fsdp._helpers import batch, full_params, make_model, unit_classes
from tests.fsdp._hostile import (
    METADATA,
    Payload,
    outside_copies,
    plant_payload,
    plant_pickled_data,
    redirect_data,
    rewrite_checksum,
)


def _offline_checkpoint(root: Path) -> Path:
    return mf_fsdp.full_state_dict_to_checkpoint(make_model(3).state_dict(), root, step=1)


def test_malicious_checkpoint_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    path = _offline_checkpoint(tmp_path)
    marker = tmp_path / "payload-ran"
    plant_payload(path, marker)
    message = r"names the global pathlib.Path.touch, which a DCP metadata file never needs"
    for verify in (True, False):
        with pytest.raises(ValueError, match=message):
            mf_fsdp.checkpoint_to_full_state_dict(path, verify=verify)
    assert not marker.exists()
    # A pickled object among the items (DCP would torch.load it with weights_only=False).
    other = tmp_path / "objects"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(2)}, "evil": Payload(str(marker))}, checkpoint_id=other)
    record = json.loads((path / mf_fsdp.RECORD_FILE).read_text())
    (other / mf_fsdp.RECORD_FILE).write_text(json.dumps(record))
    for name in os.listdir(other):
        if name != mf_fsdp.RECORD_FILE:
            rewrite_checksum(other, name)
    with pytest.raises(ValueError, match=r"stores 'evil' as a pickled object"):
        mf_fsdp.checkpoint_to_full_state_dict(other)
    assert not marker.exists()


def test_damaged_files_are_refused_by_name(tmp_path: Path) -> None:
    path = _offline_checkpoint(tmp_path)
    data = next(path.glob("*.distcp"))
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))
    message = rf"is damaged: {data.name}: contents differ from the checksum saved with it"
    with pytest.raises(ValueError, match=message):
        mf_fsdp.checkpoint_to_full_state_dict(path)
    mf_fsdp.checkpoint_to_full_state_dict(path, verify=False)  # skipped: loads the flipped byte
    (path / "stray.bin").write_bytes(b"x")
    data.unlink()
    with pytest.raises(ValueError, match=rf"{data.name}: missing; stray.bin: not part of"):
        mf_fsdp.checkpoint_to_full_state_dict(path)


def test_a_checkpoint_reads_nothing_outside_its_folder(tmp_path: Path) -> None:
    path = _offline_checkpoint(tmp_path / "ckpt")
    name = next(path.glob("*.distcp")).name
    outside = outside_copies(path, tmp_path / "outside")[name]
    pristine = (path / METADATA).read_bytes()
    cases = {
        f"../../outside/{name}": "is not a file name inside the checkpoint's folder",
        str(outside): "is not a file name inside the checkpoint's folder",
        f"sub/{name}": "is not a file name inside the checkpoint's folder",
        "..": "is not a file name inside the checkpoint's folder",
    }
    for target, reason in cases.items():
        (path / METADATA).write_bytes(pristine)
        redirect_data(path, target)
        for verify in (True, False):
            with pytest.raises(
                ValueError, match=rf"data file {re.escape(repr(target))}, which {reason}"
            ):
                mf_fsdp.checkpoint_to_full_state_dict(path, verify=verify)
    (path / METADATA).write_bytes(pristine)
    rewrite_checksum(path, METADATA)
    # A data file that is a symlink out of the folder, its checksum the target's.
    (path / name).unlink()
    (path / name).symlink_to(outside)
    rewrite_checksum(path, name)
    for verify in (True, False):
        with pytest.raises(ValueError, match=rf"data file '{name}', which is a symbolic link"):
            mf_fsdp.checkpoint_to_full_state_dict(path, verify=verify)
    # A regular file the record does not list.
    (path / name).unlink()
    shutil.copyfile(outside, path / name)
    record = json.loads((path / mf_fsdp.RECORD_FILE).read_text())
    del record["files"][name]
    (path / mf_fsdp.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match=rf"data file '{name}', which its record .* does not list"):
        mf_fsdp.checkpoint_to_full_state_dict(path, verify=False)


def test_a_data_file_holding_pickled_code_is_refused_by_name(tmp_path: Path) -> None:
    path = mf_fsdp.full_state_dict_to_checkpoint({"w": torch.ones(4)}, tmp_path, step=1)
    marker = tmp_path / "payload-ran"
    payload = io.BytesIO()
    torch.save(Payload(str(marker)), payload)
    name = next(path.glob("*.distcp")).name
    (path / name).write_bytes(payload.getvalue())
    metadata = pickle.loads((path / METADATA).read_bytes())
    for key, info in metadata.storage_data.items():
        metadata.storage_data[key] = dataclasses.replace(
            info, offset=0, length=len(payload.getvalue())
        )
    (path / METADATA).write_bytes(pickle.dumps(metadata))
    rewrite_checksum(path, METADATA)
    rewrite_checksum(path, name)
    message = rf"checkpoint_to_full_state_dict: checkpoint file '.*{name}' holds pickled objects"
    with pytest.raises(ValueError, match=message):
        mf_fsdp.checkpoint_to_full_state_dict(path)
    assert not marker.exists()


def test_damaged_records_and_bad_paths_name_the_problem(tmp_path: Path) -> None:
    path = _offline_checkpoint(tmp_path)
    record_file = path / mf_fsdp.RECORD_FILE
    good = json.loads(record_file.read_text())
    damaged = {
        "{not json": r"is damaged: not JSON",
        json.dumps({k: v for k, v in good.items() if k != "files"}): r"no 'files' field",
        json.dumps({**good, "step": "7"}): r"'step' is '7'",
        json.dumps({**good, "tensors": {"w": {"shape": [-1], "dtype": "float32"}}}): (
            r"tensors\['w'\] is"
        ),
        json.dumps({**good, "tensors": {"w": {"shape": [2], "dtype": "os.system"}}}): (
            r"tensors\['w'\] is"
        ),
        json.dumps({**good, "version": 2}): r"format version 2 .*pickled into DCP",
        json.dumps([1, 2]): r"is not an mf_fsdp checkpoint",
    }
    for text, message in damaged.items():
        record_file.write_text(text)
        with pytest.raises(ValueError, match=message):
            mf_fsdp.checkpoint_to_full_state_dict(path)
    record_file.write_text(json.dumps(good))
    (path / METADATA).unlink()
    with pytest.raises(ValueError, match=r"has no .metadata \(DCP's metadata, written last"):
        mf_fsdp.checkpoint_to_full_state_dict(path, verify=False)
    with pytest.raises(ValueError, match=r"path: '.*mf_checkpoint.json' is a file, not a"):
        mf_fsdp.checkpoint_to_full_state_dict(record_file)
    with pytest.raises(ValueError, match=r"path: expected a checkpoint folder .*got None"):
        mf_fsdp.load_checkpoint(None, None)  # type: ignore[arg-type]


def test_verify_checkpoint_checks_what_a_load_would_without_loading(tmp_path: Path) -> None:
    path = _offline_checkpoint(tmp_path / "ckpt")
    with torch.device("meta"):
        meta = make_model(0)
    assert mf_fsdp.verify_checkpoint(path) == {"step": 1}
    assert mf_fsdp.verify_checkpoint(path, meta) == {"step": 1}  # tied names included
    with pytest.raises(ValueError, match=r"saved from a different model: missing keys \['weight'"):
        mf_fsdp.verify_checkpoint(path, torch.nn.Linear(2, 3))
    with pytest.raises(ValueError, match=r"holds the state of no optimizer, not of Adam"):
        mf_fsdp.verify_checkpoint(path, meta, torch.optim.Adam(meta.parameters()))
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module or None"):
        mf_fsdp.verify_checkpoint(path, "model")  # type: ignore[arg-type]
    pristine = tmp_path / "pristine"
    shutil.copytree(path, pristine)
    marker = tmp_path / "payload-ran"

    def fresh() -> Path:
        shutil.rmtree(path)
        shutil.copytree(pristine, path)
        return path

    name = plant_pickled_data(fresh(), marker)
    with pytest.raises(ValueError, match=rf"verify_checkpoint: checkpoint file '.*{name}' holds"):
        mf_fsdp.verify_checkpoint(path)
    plant_payload(fresh(), marker)
    with pytest.raises(ValueError, match=r"names the global pathlib.Path.touch"):
        mf_fsdp.verify_checkpoint(path)
    assert not marker.exists()
    data = next(fresh().glob("*.distcp"))
    content = bytearray(data.read_bytes())  # each item's zip directory wiped, as garbage
    for info in pickle.loads((path / METADATA).read_bytes()).storage_data.values():
        end = info.offset + info.length
        content[end - 22 : end] = bytes(22)
    data.write_bytes(bytes(content))
    rewrite_checksum(path, data.name)
    with pytest.raises(ValueError, match=rf"'.*{data.name}' does not hold the tensors its DCP"):
        mf_fsdp.verify_checkpoint(path)
    data.write_bytes(b"x")
    with pytest.raises(ValueError, match=rf"is damaged: {data.name}: 1 bytes, expected \d+; ref"):
        mf_fsdp.verify_checkpoint(path)
    redirect_data(fresh(), f"../../outside/{data.name}")
    with pytest.raises(ValueError, match=r"which is not a file name inside the checkpoint's"):
        mf_fsdp.verify_checkpoint(path)


def _wrap(seed: int = 0):
    module = make_model(seed)
    return mf_fsdp.fully_shard(
        module, torch.optim.Adam(module.parameters(), lr=1e-2), fsdp_unit_modules=unit_classes()
    )


def _step(model, opt, rank: int) -> None:
    model(*batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/ckpt/__1_0.distcp")


def _rank_trust(rank: int, world: int, root: str) -> None:
    root_path = Path(root)
    model, opt = _wrap()
    _step(model, opt, rank)
    saved = mf_fsdp.save_checkpoint(root_path, model, opt, step=1)
    expected = full_params(model)
    # Disk full while rank 1 writes: every rank raises the same first line, nothing is left.
    writer = mock.patch.object(dcp_filesystem, "_write_item", _no_space)
    first_line = (
        r"^save_checkpoint: No space left on device while writing /data/ckpt/__1_0.distcp "
        r"\(rank 1\); nothing was saved \(older checkpoints are intact\)\n"
    )
    failing = writer if rank == 1 else contextlib.nullcontext()
    with failing, pytest.raises(RuntimeError, match=first_line):
        mf_fsdp.save_checkpoint(root_path, model, opt, step=2)
    left = sorted(str(p.relative_to(root_path)) for p in root_path.rglob("*"))
    assert [name for name in left if not name.startswith("step_0000001")] == [], left
    assert mf_fsdp.latest_checkpoint(root_path) == saved
    torch.distributed.barrier()  # every rank has looked before rank 0 adds a folder
    # A hostile metadata file: every rank refuses it before any tensor is read.
    hostile = root_path / "hostile"
    marker = root_path / "payload-ran"
    if rank == 0:
        shutil.copytree(saved, hostile)
        plant_payload(hostile, marker)
    torch.distributed.barrier()
    fresh, fresh_opt = _wrap(seed=1)
    with pytest.raises(ValueError, match=r"names the global pathlib.Path.touch"):
        mf_fsdp.load_checkpoint(hostile, fresh, fresh_opt)
    assert not marker.exists()
    torch.distributed.barrier()  # every rank is done with the hostile metadata
    # A flipped byte: every rank refuses it (the ranks share the hashing).
    if rank == 0:
        data = sorted(saved.glob("*.distcp"))[-1]
        content = bytearray(data.read_bytes())
        content[len(content) // 3] ^= 0x01
        (hostile / METADATA).write_bytes((saved / METADATA).read_bytes())
        rewrite_checksum(hostile, METADATA)
        (hostile / data.name).write_bytes(bytes(content))
    torch.distributed.barrier()
    with pytest.raises(ValueError, match=r"load_checkpoint: .*hostile' is damaged: __\d_0.distcp"):
        mf_fsdp.load_checkpoint(hostile, fresh, fresh_opt)
    torch.distributed.barrier()
    # Data paths that leave the folder: every rank refuses them before reading a byte.
    if rank == 0:
        shutil.rmtree(hostile)
        shutil.copytree(saved, hostile)
        outside = outside_copies(saved, root_path / "outside")
        redirect_data(hostile, str(next(iter(outside.values()))))
    torch.distributed.barrier()
    with pytest.raises(ValueError, match=r"names the data file '/.*', which is not a file name"):
        mf_fsdp.load_checkpoint(hostile, fresh, fresh_opt)
    # The intact checkpoint loads (verified), bit-exact.
    mf_fsdp.load_checkpoint(saved, fresh, fresh_opt)
    for name, value in full_params(fresh).items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.multiprocess
def test_full_disk_and_hostile_checkpoints_on_every_rank(tmp_path: Path) -> None:
    run_on_ranks(_rank_trust, 2, str(tmp_path), timeout=120)
