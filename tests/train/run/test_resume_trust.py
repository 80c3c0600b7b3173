"""``mf-train --resume`` from a damaged, hostile or foreign checkpoint: refused before any
process starts, in one line naming the folder and the file, exit code 2, no code run.

One real 2-rank run saves steps 1 and 2 (module fixture); each case damages a copy of
step 2 as a careless or hostile user would (a hostile one rewrites the checksums), and
the launcher must refuse it naming the newest intact checkpoint (step 1), which
``--resume-from`` then chooses. The record-only checks (not UTF-8, a list, another
--model, changed settings) are in ``test_options.py``; these add the real files.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mf.train.rank.worker import main as worker_main
from mf.train.run.cli import main
from mf.train.run.options import parse_options
from mf.train.run.resume import resume_checkpoint, verify_resume
from mf_fsdp import RECORD_FILE
from tests.fsdp._hostile import (
    METADATA,
    outside_copies,
    plant_payload,
    plant_pickled_data,
    redirect_data,
    rewrite_checksum,
)

_RUN = ["--device", "cpu", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2"]
_RUN += ["--eval-every", "100", "--sample-tokens", "0", "--no-plot"]
_STEP1, _STEP2 = "step_0000001", "step_0000002"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --ckpt-dir holding steps 1 and 2 of a real 2-rank run."""
    root = tmp_path_factory.mktemp("saved")
    command = [sys.executable, "-m", "mf.train.run.cli", *_RUN, "--steps", "2", "--save-every", "1"]
    command += ["--ckpt-dir", str(root / "ckpt"), "--out-dir", str(root / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stderr
    return root / "ckpt"


def _flip_byte(path: Path, marker: Path) -> str:
    data = sorted(path.glob("*.distcp"))[0]
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01
    data.write_bytes(bytes(content))
    return rf"is damaged: {data.name}: contents differ from the checksum saved with it"


def _truncate(path: Path, marker: Path) -> str:
    data = sorted(path.glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:100])
    return rf"is damaged: {data.name}: 100 bytes, expected \d+"


def _no_metadata(path: Path, marker: Path) -> str:
    (path / METADATA).unlink()
    return r"has no \.metadata \(DCP's metadata"


def _extra_file(path: Path, marker: Path) -> str:
    (path / "stray.bin").write_bytes(b"x")
    return r"is damaged: stray\.bin: not part of the checkpoint"


def _pickled_metadata(path: Path, marker: Path) -> str:
    plant_payload(path, marker)
    return r"file '[^']*/\.metadata' names the global pathlib\.Path\.touch"


def _pickled_data(path: Path, marker: Path) -> str:
    name = plant_pickled_data(path, marker, key_prefix="optimizer.")
    return rf"file '[^']*/{name}' holds pickled objects where tensors belong"


def _relative_path_out(path: Path, marker: Path) -> str:
    name = sorted(path.glob("*.distcp"))[0].name
    outside_copies(path, path.parent / "outside")
    redirect_data(path, f"../outside/{name}")
    return rf"names the data file '\.\./outside/{name}', which is not a file name inside"


def _absolute_path(path: Path, marker: Path) -> str:
    copy = next(iter(outside_copies(path, path.parent / "outside").values()))
    redirect_data(path, str(copy))
    return rf"names the data file '{re.escape(str(copy))}', which is not a file name inside"


def _symlink(path: Path, marker: Path) -> str:
    name = sorted(path.glob("*.distcp"))[0].name
    copy = outside_copies(path, path.parent / "outside")[name]
    (path / name).unlink()
    (path / name).symlink_to(copy)
    rewrite_checksum(path, name)
    return rf"names the data file '{name}', which is a symbolic link"


def _record_not_utf8(path: Path, marker: Path) -> str:
    (path / RECORD_FILE).write_bytes(b"\xca\xfe" + (path / RECORD_FILE).read_bytes())
    return rf"'[^']*/{RECORD_FILE}' is damaged: not JSON \('utf-8' codec"


def _record_list(path: Path, marker: Path) -> str:
    (path / RECORD_FILE).write_text("[1, 2]")
    return rf"'[^']*/{RECORD_FILE}' is damaged: expected a JSON object"


def _record_ill_typed(path: Path, marker: Path) -> str:
    record = json.loads((path / RECORD_FILE).read_text())
    (path / RECORD_FILE).write_text(json.dumps({**record, "files": ["__0_0.distcp"]}))
    return rf"record '[^']*/{RECORD_FILE}' is damaged: 'files' is \['__0_0.distcp'\]"


_DAMAGE: dict[str, Callable[[Path, Path], str]] = {
    "flipped byte": _flip_byte,
    "truncated file": _truncate,
    "missing .metadata": _no_metadata,
    "extra file": _extra_file,
    "pickled code in .metadata": _pickled_metadata,
    "pickled code in a .distcp": _pickled_data,
    "relative path out": _relative_path_out,
    "absolute path": _absolute_path,
    "symlink": _symlink,
    "record not UTF-8": _record_not_utf8,
    "record a JSON list": _record_list,
    "record ill-typed": _record_ill_typed,
}


def _copy(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt, symlinks=True)
    return ckpt


def _resume(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture, *extra: str) -> str:
    """Run the launcher with --resume; assert exit code 2 and one line; return it."""
    argv = [*_RUN, "--steps", "4", "--resume", "--ckpt-dir", str(ckpt)]
    code = main([*argv, "--out-dir", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert err.startswith("mf-train: error: --resume"), err
    return err


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("damage", list(_DAMAGE), ids=list(_DAMAGE))
def test_a_damaged_or_hostile_checkpoint_is_refused_in_one_line(
    damage: str, saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    message = _DAMAGE[damage](ckpt / _STEP2, marker)
    err = _resume(ckpt, tmp_path, capsys)
    assert re.search(message, err), err
    assert f"{ckpt / _STEP2}" in err  # the folder (and, above, the file)
    step1 = ckpt / _STEP1
    assert f"the newest intact checkpoint is '{step1}' (--resume-from {step1})" in err, err
    assert not marker.exists()  # no code ran
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no worker started


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_resume_from_chooses_the_older_intact_checkpoint(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path)
    _flip_byte(ckpt / _STEP2, tmp_path / "marker")
    options = parse_options([*_RUN, "--steps", "4", "--resume-from", str(ckpt / _STEP1)])
    assert options.resume
    assert resume_checkpoint(options) == ckpt / _STEP1
    verify_resume(options)  # passes: the worker loads it
    with pytest.raises(ValueError, match=r"--resume-from: '.*nowhere' is not a complete check"):
        parse_options([*_RUN, "--resume-from", str(tmp_path / "nowhere")])


def _claim(path: Path, **extra: object) -> None:
    """Make the record's ``extra`` claim other options (as a foreign checkpoint would)."""
    record = json.loads((path / RECORD_FILE).read_text())
    record["extra"].update(extra)
    (path / RECORD_FILE).write_text(json.dumps(record))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_checkpoint_of_another_model_or_optimizer_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = _copy(saved, tmp_path)
    for step in (_STEP1, _STEP2):  # another model's checkpoints under this run's --model name
        _claim(ckpt / step, model="small")
    err = _resume(ckpt, tmp_path, capsys, "--model", "small")
    assert re.search(rf"'{ckpt / _STEP2}' was saved from a different model: missing keys", err)
    assert f"no other checkpoint in '{ckpt}' is intact" in err, err
    # Another optimizer: named from the record's options, or from its classes if they lie.
    ckpt = _copy(saved, tmp_path / "b")
    err = _resume(ckpt, tmp_path, capsys, "--optimizer", "muon")
    assert "was saved with --optimizer adamw, this run has --optimizer muon" in err, err
    _claim(ckpt / _STEP2, optimizer="muon")
    err = _resume(ckpt, tmp_path, capsys, "--optimizer", "muon")
    assert re.search(rf"'{ckpt / _STEP2}' holds the state of AdamW, not of Muon, AdamW", err)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_ranks_under_torchrun_verify_the_checkpoint_themselves(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without mf-train's launcher, every rank verifies before joining; rank 0 prints."""
    ckpt = _copy(saved, tmp_path)
    message = _extra_file(ckpt / _STEP2, tmp_path / "marker")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--", *_RUN, "--steps", "4", "--resume", "--ckpt-dir", str(ckpt)]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert worker_main([*argv, "--out-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        if rank == "0":
            assert err.startswith("mf-train: error: --resume: "), err
            assert err.count("\n") == 1, err
            assert re.search(message, err), err
        else:
            assert err == ""
