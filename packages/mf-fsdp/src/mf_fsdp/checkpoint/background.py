"""Checkpoint writes off the training path: host staging, one writer thread, a group of its own.

[Note: asynchronous save]
``save_checkpoint(..., async_save=True)`` returns once every tensor it saves
is copied into host memory (pinned buffers for device tensors, kept from save
to save). One background thread per process then writes the DCP files,
hashes them and publishes the record exactly as a synchronous save does
([Note: crash-safe save]), so what it publishes is the same checkpoint, file
for file. The write's collectives run on a gloo group of its own, created by
the first asynchronous save (every rank calls it): they never interleave with
the training thread's collectives on the default group.

A kill during the background write leaves a ``.partial`` folder without a
record, so the previous checkpoint stays the newest. A save or a load first
waits for the pending save of this process: at most one is in flight, and its
staging buffers are free again when the next save copies into them. The
returned future holds the outcome: the published path, or the ``RuntimeError``
a synchronous save would have raised. Wait for it before destroying the
process group (the write needs it until the record is published).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mf_dtensor import UnevenDTensor

__all__ = ["run_in_background", "stage_on_host", "wait_for_pending_save", "writer_group"]

_T = TypeVar("_T")


class _Writer:
    """This process's background writer: its thread, the save in flight, staging buffers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending: concurrent.futures.Future[Any] | None = None
        self.buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self.groups: dict[int, dist.ProcessGroup] = {}


_WRITER = _Writer()


def wait_for_pending_save() -> None:
    """Block until this process's background save (if any) has finished, either way.

    Its outcome stays in its future: a failure is raised by ``result()``, not here.
    """
    pending = _WRITER.pending
    if pending is not None:
        concurrent.futures.wait([pending])


def run_in_background(write: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """Start ``write`` on the writer thread, after the pending save; its future."""
    wait_for_pending_save()
    with _WRITER.lock:
        if _WRITER.executor is None:
            _WRITER.executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="mf-checkpoint-writer"
            )
        future = _WRITER.executor.submit(write)
        _WRITER.pending = future
    return future


def writer_group() -> dist.ProcessGroup | None:
    """The gloo group the background writes communicate on (collective on first use).

    One per default process group; None without one (a single process).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.distributed_c10d._get_default_group()
    group = _WRITER.groups.get(id(default))
    if group is None:
        # cast: a group of every rank, so never NON_GROUP_MEMBER (which new_group's type allows)
        group = cast(
            dist.ProcessGroup, dist.new_group(backend="gloo", timeout=_timeout_of(default))
        )
        _WRITER.groups = {id(default): group}  # a group of a destroyed default one is gone
    return group


def _timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout ``group`` was made with (None: torch's default).

    The writer's group waits no longer for a lost peer than training does, so a
    process whose peer died does not sit on its background write for torch's
    default 30 minutes.
    """
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def stage_on_host(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` whose tensors live in host memory, safe from further training.

    Nested dicts are copied; DTensors (and ``UnevenDTensor``) keep their mesh,
    placements and global shape around a host copy of their local tensor; other
    values are shared. Device copies are complete when this returns.
    """
    staged = _stage_dict(state, ())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return staged


def _stage_dict(state: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    return {key: _stage_value(value, (*path, str(key))) for key, value in state.items()}


def _stage_value(value: Any, path: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return _stage_dict(value, path)
    if isinstance(value, UnevenDTensor):
        return UnevenDTensor.from_local(
            _host_copy(value.to_local(), path),
            value.device_mesh,
            value.placements,
            shape=value.shape,
            pieces=value.pieces,
        )
    if isinstance(value, DTensor):
        return DTensor.from_local(
            _host_copy(value.to_local(), path),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return _host_copy(value, path)
    return value


def _host_copy(tensor: torch.Tensor, path: tuple[str, ...]) -> torch.Tensor:
    """``tensor``'s values in a host buffer kept for ``path`` (reused while it fits)."""
    tensor = tensor.detach()
    buffer = _WRITER.buffers.get(path)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        buffer = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
        )
        _WRITER.buffers[path] = buffer
    buffer.copy_(tensor, non_blocking=tensor.is_cuda)
    return buffer
