"""A rank's unexpected exception as the user sees it: one line, the traceback in a log.

A rank that raises (a bug, a folder it cannot write, out of memory, a peer that
died) writes the full traceback to its own log, ``<--out-dir>/logs/rank-R.log``
(a temporary folder when the out-dir cannot take it), and hands the launcher
one line through torch elastic's error file (``TORCHELASTIC_ERROR_FILE``, the
channel the agent reads into ``ChildFailedError``). The ``mf-train`` launcher
prints each distinct line once, naming every rank that raised it and one log,
and appends the agent's own report (every rank's failure) to that log instead
of the terminal. Lines about lost peers are printed only when no rank raised
anything else: they are the consequence, not the cause. Under ``torchrun``,
where no mf launcher gathers the lines, each failing rank prints its own.

Out of memory (``torch.OutOfMemoryError``, a ``MemoryError``, the CPU
allocator's "can't allocate memory") is named as such, with ``--micro-batch``
as the setting to lower.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mf.train.run.options import TrainOptions

__all__ = [
    "LOG_FOLDER",
    "RankFailure",
    "describe",
    "failure_lines",
    "is_out_of_memory",
    "lost_peer",
    "report_rank_failure",
]

LOG_FOLDER = "logs"
"""The folder of ``--out-dir`` that holds the per-rank logs of a failed run."""

_TAG = "mf-train-rank-failure"
"""Marks the error-file message of a rank failure this module recorded."""

# How the backends report a rank that died (its sockets close) or stopped answering
# (the collective outlives --timeout).
_LOST_PEER = ("Timed out", "timed out", "Connection reset by peer", "Connection closed by peer")

_CPU_OUT_OF_MEMORY = "can't allocate memory"
"""What torch's CPU allocator says (in a RuntimeError) when an allocation fails."""


def lost_peer(error: BaseException) -> str | None:
    """The first line of ``error`` when it says another rank died or stopped answering."""
    first = (str(error).splitlines() or [""])[0]
    return first if any(sign in first for sign in _LOST_PEER) else None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is an allocation that failed."""
    seen: BaseException | None = error
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:  # a chain may loop back
        if isinstance(seen, torch.OutOfMemoryError | MemoryError):
            return True
        if isinstance(seen, RuntimeError) and _CPU_OUT_OF_MEMORY in str(seen):
            return True
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}".rstrip(": ")


def describe(error: BaseException, options: TrainOptions) -> tuple[str, bool]:
    """One line saying what went wrong (no rank in it), and whether a peer was lost."""
    peer = lost_peer(error)
    if peer is not None:
        return (
            "lost contact with the other ranks (one died or stopped answering for "
            f"--timeout {options.timeout:g} s): {peer}",
            True,
        )
    if is_out_of_memory(error):
        device = "GPU" if options.use_cuda else "CPU"
        return (
            f"out of {device} memory ({_first_line(error)[:200]}); lower --micro-batch "
            f"(now {options.micro_batch}) and raise --grad-accum (now {options.grad_accum}) "
            "to keep the batch, or use fewer --nproc per machine or a smaller --model",
            False,
        )
    return _first_line(error)[:500], False


def _write_log(path: Path, rank: str, error: BaseException) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    text = "".join(traceback.format_exception(error))
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"mf-train rank {rank} failed at {when} (pid {os.getpid()}):\n{text}\n")


def _log_path(options: TrainOptions, rank: str, error: BaseException) -> Path:
    """Write the traceback into this rank's log; return its path.

    ``--out-dir``'s ``logs`` folder, or a temporary folder when the out-dir cannot
    take it (it is a file, or not writable: perhaps the very failure).
    """
    name = f"rank-{rank}.log"
    run = os.environ.get("TORCHELASTIC_RUN_ID", f"pid-{os.getpid()}")
    for folder in (Path(options.out_dir) / LOG_FOLDER, Path(tempfile.gettempdir()) / run):
        try:
            _write_log(folder / name, rank, error)
        except OSError:
            continue
        return folder / name
    return Path(os.devnull)


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What one rank tells the launcher: its line, whether it only lost a peer, its log.

    ``when`` (seconds since the epoch): of the ranks that lost their peers, the
    first names the cause.
    """

    line: str
    lost_peer: bool
    log: str
    when: float = 0.0

    def to_message(self) -> str:
        """The error file's message: tagged JSON, read back by ``from_message``."""
        return f"{_TAG} " + json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_message(cls, message: str) -> RankFailure | None:
        """The failure a rank recorded, or None for any other message (a signal, a crash)."""
        tag, _, payload = message.partition(" ")
        if tag != _TAG:
            return None
        try:
            fields = json.loads(payload)
            return cls(
                str(fields["line"]),
                bool(fields["lost_peer"]),
                str(fields["log"]),
                float(fields["when"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def _record(failure: RankFailure) -> None:
    """Write the elastic error file, in torch's plain form: a ``message`` and a ``timestamp``."""
    file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not file:
        return
    data = {"message": failure.to_message(), "timestamp": int(time.time())}
    with open(file, "w", encoding="utf-8") as out:
        json.dump(data, out)


def report_rank_failure(error: BaseException, options: TrainOptions, gathered: bool) -> int:
    """Log ``error``'s traceback for this rank and report it in one line; return exit code 1.

    ``gathered``: the ``mf-train`` launcher prints the lines of all ranks (this rank
    records its own and prints nothing); else (torchrun) this rank prints it.
    """
    rank = os.environ.get("RANK", "0")
    line, peer = describe(error, options)
    log = _log_path(options, rank, error)
    failure = RankFailure(line, peer, str(log), time.time())
    if gathered:
        _record(failure)
    else:
        print(f"mf-train: error: rank {rank} {_joined(line)} (traceback: {log})", file=sys.stderr)
    return 1


def _joined(line: str) -> str:
    """``line`` after "rank R" or "ranks R, S": a verb for the lost-peer line, else "raised"."""
    return line if line.startswith("lost contact") else f"raised {line}"


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _killed(rank: int, process: ProcessFailure) -> str:
    """The line of a rank that recorded nothing: killed by a signal, or a crash."""
    if process.exitcode >= 0:
        return f"rank {rank} exited with code {process.exitcode} ({process.message})"
    name = process.signal_name()
    hint = ""
    if name == "SIGKILL":
        hint = (
            "; the kernel's out-of-memory killer sends SIGKILL when memory runs out: if "
            "it did, lower --micro-batch"
        )
    return f"rank {rank} was killed by {name}{hint}"


def failure_lines(error: ChildFailedError, out_dir: str) -> list[str]:
    """The launcher's lines for a failed run, each cause once.

    What ranks raised comes first, one line per distinct failure naming every rank
    that raised it and one log; else a rank killed by a signal (not the agent's
    SIGTERM) or crashed; else the first rank that lost its peers (the others lost
    it, or each other, after). The agent's report goes into the log named, or into
    ``<out_dir>/logs/launcher.log`` when no rank wrote one.
    """
    failures = sorted(error.failures.items())
    recorded = {
        rank: failure
        for rank, process in failures
        if (failure := RankFailure.from_message(str(process.message))) is not None
    }
    raised = {rank: f for rank, f in recorded.items() if not f.lost_peer}
    unrecorded = [(rank, process) for rank, process in failures if rank not in recorded]
    killed = [(r, p) for r, p in unrecorded if p.exitcode != -signal.SIGTERM]
    if not raised and not killed and recorded:
        first = min(recorded, key=lambda rank: (recorded[rank].when, rank))
        raised = {first: recorded[first]}
    if raised:
        groups: dict[str, list[int]] = {}
        for rank, failure in raised.items():
            groups.setdefault(failure.line, []).append(rank)
        lines = [
            f"{_ranks(ranks)} {_joined(line)} (traceback: {raised[ranks[0]].log})"
            for line, ranks in groups.items()
        ]
        _append_report(Path(raised[min(raised)].log), error)
        return lines
    log = Path(out_dir) / LOG_FOLDER / "launcher.log"
    written = _append_report(log, error)
    where = f" (torch elastic's report: {log})" if written else ""
    return [f"{_killed(*(killed or unrecorded)[0])}{where}"]


def _append_report(log: Path, error: ChildFailedError) -> bool:
    """Append the elastic agent's report of every rank to ``log``; whether it could."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"torch elastic's report of the run:\n{error.format_msg()}\n")
    except OSError:
        return False
    return True
