"""One ``mf-train`` run per folder: a lock on ``--ckpt-dir`` and ``--out-dir`` for a run's life.

Two runs into the same folders would replace each other's checkpoints and
interleave their ``metrics.jsonl``. So a run first takes a lock on each folder
(:func:`acquire_run_locks`), holds it until it ends by any path (the returned
:class:`RunLocks` is a context manager) and a second run is refused with one
line naming the folder and the holder. Who takes them: the ``mf-train``
launcher, before it starts the ranks (it tells its ranks so through
``LAUNCHER_LOCKED_VARIABLE``); under ``torchrun -m mf.train.rank.worker``, global
rank 0.

The lock of a folder is the file ``.mf-train.lock`` in it: small JSON naming
the holder (host, pid, start time, torchelastic run id). It is created with
``O_CREAT | O_EXCL`` (atomic: of two runs, one creates it) and removed at the
end. Checkpoint code never mistakes it for a checkpoint: ``latest_checkpoint``
(and so ``--resume`` and ``mf-sample``) only considers ``step_N`` folders, and
the integrity check only lists files inside one ``step_N`` folder.

Liveness. The holder also keeps an exclusive ``fcntl.flock`` on the file for
its life; the kernel drops it when the process dies, however it dies. A lock
file whose flock is free, from this host, and whose pid no longer runs is stale
(a killed run) and is taken over with a one-line note; silently when it is this
run's own, left by a rank 0 that an elastic restart replaced (same run id). A
lock from another host is respected: its pid cannot be checked from here, so
the error says which file to remove if the user knows the run is over.

Why flock rather than renaming a stale file away: with flock, taking over is
race-free without a second file. Whoever holds the flock on the inode that the
path names owns the lock; a contender flocks the existing file without waiting,
checks that the path still names that inode (else it was released meanwhile
and the contender starts over) and only then rewrites it in place. A creator
flocks its new file before writing into it, so a file with no readable record
and a free flock belongs to no one (its creator died, or lost that race and
backs off). The release removes the file while still holding the flock, so no
contender can take over a file that is about to disappear. Rename-away instead
needs a re-check of the moved file and a way back when it was a live lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from mf.train.run.options import TrainOptions

__all__ = [
    "LAUNCHER_LOCKED_VARIABLE",
    "LOCK_FILE",
    "RunLockError",
    "RunLocks",
    "acquire_run_locks",
    "launcher_holds_locks",
    "started_by_launcher",
    "worker_takes_locks",
]

LOCK_FILE = ".mf-train.lock"
LAUNCHER_LOCKED_VARIABLE = "MF_TRAIN_LAUNCHER_LOCKED"
"""Set (to ``1``) by the ``mf-train`` launcher for its ranks: it holds the locks itself."""

_ATTEMPTS = 20  # a lock released and re-created this often while we look is not for us
_READ_WAIT_S = 1.0  # how long a refused run waits for the holder to finish writing its record


class RunLockError(ValueError):
    """A folder of this run is locked by another run (or cannot be locked): one line."""


@dataclass
class _FolderLock:
    """One held lock file: its path, the open descriptor holding the flock, folders made for it."""

    path: Path
    fd: int
    created: list[Path] = field(default_factory=list)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            if _names(self.path, self.fd):
                self.path.unlink()  # before the flock goes: see the module's docstring
        os.close(self.fd)
        for folder in self.created:  # deepest first; a folder the run wrote into stays
            try:
                folder.rmdir()
            except OSError:
                break


class RunLocks:
    """The locks a run holds; a context manager that releases them (also on errors, Ctrl-C)."""

    def __init__(self, locks: list[_FolderLock]) -> None:
        self._locks = locks

    def release(self) -> None:
        """Remove every lock file, the last taken first; calling it again does nothing."""
        while self._locks:
            self._locks.pop().release()

    def __enter__(self) -> RunLocks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _try_flock(fd: int) -> bool:
    """Take the exclusive flock without waiting; False while another process holds it.

    A filesystem without flock gives no evidence of a holder (True): the pid
    check alone then decides whether a lock of this host is stale.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
    return True


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(text: str) -> dict[str, Any] | None:
    """The record of a lock file's text, or None when it is not one (empty, half written)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("host"), str)
    return record if ok and isinstance(record.get("pid"), int) else None


def _read_holder(path: Path) -> dict[str, Any] | None:
    """The record of the lock file at ``path``, waiting briefly for a holder still writing it."""
    deadline = time.monotonic() + _READ_WAIT_S
    while True:
        try:
            record = _holder(path.read_text())
        except OSError:  # removed meanwhile: the holder just ended
            record = None
        if record is not None or time.monotonic() >= deadline:
            return record
        time.sleep(0.05)


def _describe(holder: dict[str, Any]) -> str:
    run = f", run {holder['run_id']}" if holder.get("run_id") else ""
    return f"host {holder['host']}, pid {holder['pid']}{run}, since {holder.get('started', '?')}"


def _refusal(names: str, folder: Path, path: Path, holder: dict[str, Any] | None) -> RunLockError:
    where = f"{names} {str(folder)!r} is in use by another mf-train run"
    if holder is None:
        return RunLockError(
            f"{where} (its lock file {path} names no holder); if no run uses the folder, "
            f"remove {path}"
        )
    if holder["host"] != socket.gethostname():
        return RunLockError(
            f"{where} ({_describe(holder)}); mf-train cannot check a process of another "
            f"host: if that run has ended, remove {path}"
        )
    return RunLockError(
        f"{where} ({_describe(holder)}); wait for it to end or choose another folder"
    )


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def _note_take_over(names: str, folder: Path, holder: dict[str, Any] | None) -> None:
    was = "an unfinished lock" if holder is None else _describe(holder)
    print(
        f"mf-train: note: {names} {str(folder)!r} was locked by a run that no longer runs "
        f"({was}); taking the lock over",
        file=sys.stderr,
        flush=True,
    )


def _take(path: Path, names: str, own_run: str | None) -> int:
    """The descriptor of the lock file at ``path``, flocked by this process (protocol above)."""
    folder = path.parent
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            if _try_flock(fd):
                return fd
            os.close(fd)  # taken over before we could flock it: not ours
            raise _refusal(names, folder, path, _read_holder(path))
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue  # released meanwhile
        if not _try_flock(fd):
            os.close(fd)
            raise _refusal(names, folder, path, _read_holder(path))
        if not _names(path, fd):
            os.close(fd)  # released (and maybe taken) meanwhile: look again
            continue
        holder = _holder(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
        if holder is not None and (
            holder["host"] != socket.gethostname() or _running(holder["pid"])
        ):
            os.close(fd)
            raise _refusal(names, folder, path, holder)
        if holder is None or own_run is None or holder.get("run_id") != own_run:
            _note_take_over(names, folder, holder)
        return fd
    raise RunLockError(f"{names} {str(folder)!r}: its lock {path} keeps changing; try again")


def _lock_folder(
    folder: Path, names: str, record: dict[str, Any], own_run: str | None
) -> _FolderLock:
    """Take the lock of ``folder`` (``names``: its options), creating the folder if need be.

    ``own_run``: the run id whose stale lock is this run's own (taken over without a note).
    """
    created = _missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = _FolderLock(folder / LOCK_FILE, _take(folder / LOCK_FILE, names, own_run), created)
    except OSError as error:
        raise RunLockError(
            f"{names} {str(folder)!r}: cannot lock the folder ({error.strerror or error})"
        ) from None
    try:
        _write(lock.fd, record)
    except OSError as error:
        lock.release()
        raise RunLockError(
            f"{names} {str(folder)!r}: cannot write its lock {lock.path} "
            f"({error.strerror or error})"
        ) from None
    return lock


def acquire_run_locks(
    options: TrainOptions, run_id: str | None, *, restarted: bool = False
) -> RunLocks:
    """Lock ``--ckpt-dir`` and ``--out-dir`` (one lock when they are the same folder).

    ``run_id``: the torchelastic run id recorded in the locks. ``restarted``: this
    process replaces a rank 0 of the same run (an elastic restart), so a stale
    lock of ``run_id`` is taken over without a note. Folders are created if
    missing (and removed again at release if the run left them empty); they are
    locked in path order, so nested folders are locked parent first.

    Raises:
        RunLockError: one line naming the option, the folder and the holder.
    """
    folders: dict[Path, list[str]] = {}
    for name, value in (("--ckpt-dir", options.ckpt_dir), ("--out-dir", options.out_dir)):
        folders.setdefault(Path(value).resolve(), []).append(name)
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "run_id": run_id,
    }
    own_run = run_id if restarted else None
    locks: list[_FolderLock] = []
    try:
        for folder in sorted(folders):
            locks.append(_lock_folder(folder, " and ".join(folders[folder]), record, own_run))
    except BaseException:
        RunLocks(locks).release()
        raise
    return RunLocks(locks)


@contextlib.contextmanager
def launcher_holds_locks() -> Iterator[None]:
    """While open, ranks started by this process skip locking (``worker_takes_locks``)."""
    previous = os.environ.get(LAUNCHER_LOCKED_VARIABLE)
    os.environ[LAUNCHER_LOCKED_VARIABLE] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[LAUNCHER_LOCKED_VARIABLE]
        else:
            os.environ[LAUNCHER_LOCKED_VARIABLE] = previous


def started_by_launcher() -> bool:
    """Whether the ``mf-train`` launcher started this rank, rather than torchrun or a test.

    That launcher holds the run's locks and made its checks before any rank started.
    """
    return os.environ.get(LAUNCHER_LOCKED_VARIABLE) == "1"


def worker_takes_locks() -> bool:
    """Whether this worker locks the run's folders: rank 0, not started by ``mf-train``."""
    return not started_by_launcher() and os.environ.get("RANK", "0") == "0"
