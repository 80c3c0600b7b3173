"""Run a test body on N gloo ranks in child processes, fast and without hangs.

Start here when writing a multi-rank test::

    def _rank_allreduce(rank: int, world_size: int, value: float) -> None:
        t = torch.tensor([value + rank])
        dist.all_reduce(t)
        assert t.item() == ...

    @pytest.mark.multiprocess
    def test_allreduce():
        run_on_ranks(_rank_allreduce, 2, 1.0)

How it works:
- Rank functions are module-level functions of a test module (picklable by
  reference); their arguments must be picklable.
- Children come from one cached ``forkserver`` whose process already
  imported torch, torch.distributed and the mf packages, so a test pays for
  a fork, not for an interpreter start and a torch import.
- Rendezvous goes through a file in a fresh temporary directory
  (``file://`` init method): no TCP port is chosen by the harness, so
  pytest-xdist workers never collide. gloo's own connections are bound to
  the loopback interface.
- The parent polls the children: as soon as one fails, or the deadline
  passes, the rest are killed, and an AssertionError carries every failed
  rank's traceback under a ``--- rank N ---`` header.
- A run whose ranks failed only in gloo's connection set-up (a loaded
  machine) is made once more; any other failure is reported at once.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.context import ForkServerContext
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "cpu_mesh", "preload_in_ranks", "run_on_ranks", "run_simulated_rank"]

DEFAULT_TIMEOUT = 120.0
# A collective that cannot complete (a peer died) fails after this long in the
# children; the parent kills them sooner, this only bounds orphaned ranks.
_COLLECTIVE_TIMEOUT = timedelta(seconds=90)
# gloo's TCP mesh set-up (every pair of ranks connects when a group is made)
# now and then loses a connection when a 2-core machine runs several
# multi-rank tests at once. Nothing of the test body has been judged then, so
# such a run is made again, once.
_TRANSIENT_SETUP_ERROR = "Gloo connectFullMesh failed"
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.device_mesh",
    "torch._dynamo",  # the first optimizer.step() imports it: seconds per child otherwise
    "tests._multiprocess",
    "mf_utils",
    "mf_rng",
    "mf_tp",
    "mf_dtensor",
    "mf_fsdp",
]


@functools.cache
def _context() -> ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def preload_in_ranks(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, so each rank does not.

    For a test module whose ranks need a slow import (``torch.testing._internal``
    costs seconds per rank); call it at the test module's import, i.e. at
    collection, before any rank starts. Once the forkserver runs it is too late:
    the ranks then import the modules themselves, slower but alike.
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    _context().set_forkserver_preload(_PRELOAD)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str | None,
    errors: Any,
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if init_file is None:
            _init_fake_group(rank, world_size)
        else:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=_COLLECTIVE_TIMEOUT,
            )
        fn(rank, world_size, *args)
        if init_file is not None and dist.is_initialized():
            _wait_for_peers(rank, world_size)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _wait_for_peers(rank: int, world_size: int) -> None:
    """Return once every rank's body has returned, through the store (not gloo's pairs).

    A body without collectives lets a fast rank finish and exit while a slow
    one is still inside gloo's pair set-up, which then fails with "Connection
    closed by peer" on a loaded machine (seen in CI: the same race on both
    tries). No rank closes its sockets before every rank is past its body.
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"mf-tests/done/{rank}", "1")
    store.wait([f"mf-tests/done/{peer}" for peer in range(world_size)], _COLLECTIVE_TIMEOUT)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and wait for all.

    The ranks use gloo on the CPU, or with ``backend="nccl"`` one CUDA device each
    (rank r on device r: one GPU hosts one NCCL rank).

    Raises:
        AssertionError: if any rank raised (with each failed rank's traceback)
            or the ranks did not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_on_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"run_on_ranks: {world_size} NCCL ranks need as many CUDA devices, "
            f"got {torch.cuda.device_count()}"
        )
    processes, failures, timed_out = _launch(fn, world_size, args, timeout, backend)
    if _failed_in_gloo_setup(failures, timed_out):
        processes, failures, timed_out = _launch(fn, world_size, args, timeout, backend)
    _raise_on_failure(fn, processes, failures, timed_out, timeout)


def _failed_in_gloo_setup(failures: dict[int, str], timed_out: bool) -> bool:
    """True when the ranks that failed all failed connecting gloo's pairs."""
    return (
        not timed_out
        and bool(failures)
        and all(_TRANSIENT_SETUP_ERROR in text for text in failures.values())
    )


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    backend: str,
) -> tuple[list[multiprocessing.process.BaseProcess], dict[int, str], bool]:
    """Start the ranks and wait for them: (processes, failed ranks' tracebacks, timed out)."""
    context = _context()
    errors = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="mf-rdzv-") as tmp:
        init_file = os.path.join(tmp, "rdzv")
        processes = [
            context.Process(
                target=_child,
                args=(fn, rank, world_size, init_file, errors, args, backend),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        failures: dict[int, str] = {}
        timed_out = _wait(processes, time.monotonic() + timeout, errors, failures)
    return processes, failures, timed_out


def run_simulated_rank(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    rank: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in one child that plays ``rank`` of ``world_size``.

    The child's default group is torch's fake process group: collectives
    return at once without moving data, so the engine's set-up, layouts and
    memory can be simulated at cluster scale (world 1024) in one process.
    Values that depend on communication are meaningless there.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"run_simulated_rank: rank must be in [0, {world_size}), got {rank}")
    context = _context()
    errors = context.SimpleQueue()
    process = context.Process(
        target=_child,
        args=(fn, rank, world_size, None, errors, args),
        name="simulated",
        daemon=True,
    )
    process.start()
    failures: dict[int, str] = {}
    timed_out = _wait([process], time.monotonic() + timeout, errors, failures)
    _raise_on_failure(fn, [process], failures, timed_out, timeout)


def _init_fake_group(rank: int, world_size: int) -> None:
    # Importing this module registers torch's "fake" backend (torch's own
    # init_process_group imports it the same way for backend="fake").
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _drain(errors: Any, failures: dict[int, str]) -> None:
    # Read while the children run: a traceback larger than the pipe buffer
    # would otherwise block its rank before it can exit.
    while not errors.empty():
        rank, text = errors.get()
        failures[rank] = text


def _wait(
    processes: list[multiprocessing.process.BaseProcess],
    deadline: float,
    errors: Any,
    failures: dict[int, str],
) -> bool:
    """Poll until all exit, one fails or the deadline passes; kill the rest. True on timeout."""
    timed_out = False
    while True:
        _drain(errors, failures)
        codes = [p.exitcode for p in processes]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.01)
    # A failed rank's peers are stuck in a collective: give them a moment to
    # fail on their own (their traceback helps), then kill what is left.
    grace = time.monotonic() + (0.0 if timed_out else 0.5)
    while time.monotonic() < grace and any(p.exitcode is None for p in processes):
        _drain(errors, failures)
        time.sleep(0.01)
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join()
    _drain(errors, failures)
    return timed_out


def _raise_on_failure(
    fn: Callable[..., Any],
    processes: list[multiprocessing.process.BaseProcess],
    failures: dict[int, str],
    timed_out: bool,
    timeout: float,
) -> None:
    if not timed_out and not failures and all(p.exitcode == 0 for p in processes):
        return
    lines = [f"{fn.__qualname__} failed on {len(processes)} ranks"]
    if timed_out:
        hung = [rank for rank, p in enumerate(processes) if rank not in failures]
        lines[0] += f": timed out after {timeout:.1f}s (ranks {hung} did not finish)"
    for rank in sorted(failures):
        lines.append(f"--- rank {rank} ---\n{failures[rank]}")
    for rank, process in enumerate(processes):
        if rank not in failures and process.exitcode not in (0, None) and not timed_out:
            lines.append(f"--- rank {rank} --- exited with code {process.exitcode}")
    raise AssertionError("\n".join(lines))


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Build a CPU ``DeviceMesh`` over the running gloo world (for use inside rank functions)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)
