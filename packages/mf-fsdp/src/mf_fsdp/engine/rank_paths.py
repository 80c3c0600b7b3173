"""Ranks that take different paths: the error when their unit orders cannot be reconciled.

Any rank may skip any FSDP unit in a step (``engine/hooks.py`` issues the
skipped unit's collectives in its place, so every rank issues the same
sequence). What cannot be reconciled is detected on one rank only: a unit
run out of the units' order, twice in one forward, or whose backward starts
after the engine had to finish it. The other ranks are then waiting in a
collective that will never be matched.

[Note: stopping every rank] The detecting rank writes its message to the
default process group's store (a reference taken when the engine is built,
so it outlives the groups), then destroys its process groups: the peers'
pending collectives fail at once (gloo: "connection closed by peer") instead
of waiting for the group's timeout. Each engine entry point that runs
collectives (``translated``) turns such a failure into the posted
:class:`UnitOrderError` and destroys its own groups too, so ranks waiting
only on it stop as well. Nothing of this runs while the ranks agree: no
store access, no collective, only a ``try`` around the hooks.

On NCCL a destroyed communicator does not wake a peer blocked in a kernel:
there the peers stop at the process group's timeout (or its watchdog), with
the posted message found by the same lookup.

This module must not decide *which* orders are allowed: the hooks do.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from mf_fsdp.buckets.extension import ExtensionError

__all__ = ["UnitOrderError", "default_store", "stop_every_rank", "stop_out_of_order", "translated"]

_KEY = "mf_fsdp/unit_order_error"
_LOOKUP = timedelta(seconds=2)
"""How long a rank whose collective failed waits for a posted message (it is normally
there already: the detecting rank posts before it tears its groups down)."""

_LOST_PEER = ("peer", "onnection", "gloo", "NCCL", "abort")
"""Words of a collective's failure that a peer's teardown causes (other errors skip the wait)."""

F = TypeVar("F", bound=Callable[..., Any])


class UnitOrderError(RuntimeError):
    """The ranks ran FSDP units in orders the engine cannot reconcile (raised on every rank).

    The message names the rank that detected it, the unit and the step; it is
    the same on every rank.
    """


def default_store() -> dist.Store | None:
    """The default process group's store, or None without an initialised default group."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # a default group without a store
        return None


def _tear_down() -> None:
    """Destroy this process's groups, so peers waiting on it fail now (see the Note)."""
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):  # already (being) torn down
            dist.destroy_process_group()


def stop_every_rank(store: dist.Store | None, message: str) -> NoReturn:
    """Post ``message`` for the other ranks, tear the groups down, raise it here.

    The first message posted wins: where several ranks stop at once (ranks that
    could not agree on an order, ``engine/unit_order.py``), each raises that one.
    """
    if store is not None:
        with contextlib.suppress(RuntimeError, ValueError):  # gone: the peers time out instead
            message = store.compare_set(_KEY, "", message).decode()
    _tear_down()
    raise UnitOrderError(message)


def stop_out_of_order(
    store: dist.Store | None, step: int, unit: str, order: list[str], what: str
) -> NoReturn:
    """Stop every rank: ``unit`` cannot be fitted into the units' ``order`` (``what``: why)."""
    shown = ", ".join(repr(name) for name in order[:8]) + (", ..." if len(order) > 8 else "")
    rank = dist.get_rank() if dist.is_initialized() else 0
    stop_every_rank(
        store,
        f"mf_fsdp: rank {rank}, step {step}: unit {unit!r} {what}. Every rank walks the units "
        f"in one order (here {shown}; first the registration order, changed where every rank "
        "meets the change), may skip any of them, and runs a unit again after others only "
        "where every rank does; the ranks stopped here instead of exchanging mismatched "
        "collectives",
    )


def _posted(store: dist.Store | None, error: RuntimeError) -> str | None:
    """The posted message, if any; waits briefly only when ``error`` came from a lost peer."""
    if store is None:
        return None
    try:
        if not store.check([_KEY]):
            text = str(error)
            if not any(word in text for word in _LOST_PEER):
                return None
            # Polled, not store.wait(): a wait that times out logs C++ warnings, and a
            # peer that froze or died posts nothing.
            deadline = time.monotonic() + _LOOKUP.total_seconds()
            while not store.check([_KEY]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
        return store.get(_KEY).decode()
    except (RuntimeError, ValueError):  # the store is gone too: another failure
        return None


def translated(store_of: Callable[[Any], dist.Store | None]) -> Callable[[F], F]:
    """Decorate a method that runs collectives: a failed one raises a posted ``UnitOrderError``.

    ``store_of(self)`` gives the store to look in. Only a ``RuntimeError`` (what
    a torch.distributed collective raises when a peer went away) is looked up;
    one with no posted message propagates unchanged.
    """

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except UnitOrderError:
                raise
            except ExtensionError as error:  # found on this rank alone: stop the others too
                stop_every_rank(store_of(self), str(error))
            except RuntimeError as error:
                message = _posted(store_of(self), error)
                if message is None:
                    raise
                _tear_down()
                raise UnitOrderError(message) from error

        return run  # type: ignore[return-value]

    return decorate
