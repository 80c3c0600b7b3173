"""Count the collectives a training step issues and the bytes each rank sends.

Bytes are counted as a bandwidth-optimal (ring) algorithm sends them, so the
figures compare across engines and against the theoretical minimum:

| collective                   | elements sent per rank       |
| ---------------------------- | ---------------------------- |
| all-gather, output N         | N * (w - 1) / w              |
| reduce-scatter, input N      | N * (w - 1) / w              |
| all-reduce, N                | 2 * N * (w - 1) / w          |
| broadcast, N                 | N * (w - 1) / w              |
| all-to-all, input N          | N * (w - 1) / w              |
| all-to-all with input splits | the splits for other ranks   |
| point-to-point batch         | the tensors it sends         |

The Python-level collectives are wrapped where both ``torch.distributed``
and its ``distributed_c10d`` module look them up, under the name the running
torch defines each one with (``mf_utils.collective_name``: the deprecated
aliases delegate to the wrapped ones, so nothing is counted twice); they are
counted under the newest torch's names. A coalesced batch (torch's
``_coalescing_manager``: one NCCL group, or one gloo coalesced call) counts as
one collective of each kind it holds, with the bytes of all. A process
group's own coalesced all-gather (``ProcessGroup.allgather_into_tensor_coalesced``,
which mf calls directly on gloo) counts as one all-gather of all its outputs,
unless a ``_coalescing_manager`` batch made it (its calls were counted). DDP
reduces in C++ and is not seen here: its traffic (one all-reduce of every
gradient) is reported by the benchmark from its bucket sizes.

Bytes are also tallied per process group (``bytes_by_group``, by group
name), so a run can tell, say, context parallelism's traffic over the cp
group from the sharding engine's over the data-parallel one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from mf_utils import collective_name

__all__ = ["CommCounter", "group_key"]


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def group_key(group: dist.ProcessGroup | None) -> str:
    """The name ``bytes_by_group`` keys a process group by (None: the default group)."""
    return (group or distributed_c10d._get_default_group()).group_name


# For each counted collective: the bytes that the table above scales by (w - 1) / w.
_BYTE_MODEL: dict[str, Callable[[list[Any]], int]] = {
    "all_gather_single": lambda a: _nbytes(a[0]),
    "reduce_scatter_single": lambda a: _nbytes(a[1]),
    "all_reduce": lambda a: 2 * _nbytes(a[0]),
    "broadcast": lambda a: _nbytes(a[0]),
    "all_gather": lambda a: sum(_nbytes(t) for t in a[0]),
    "reduce_scatter": lambda a: sum(_nbytes(t) for t in a[1]),
    "all_to_all_single": lambda a: _nbytes(a[1]),
}
# Counted exactly, not scaled: mf's gloo collectives are batches of sends and receives.
_EXACT_BYTES: dict[str, Callable[[list[Any]], int]] = {
    "batch_isend_irecv": lambda a: sum(_nbytes(op.tensor) for op in a[0] if op.op is dist.isend),
}


@dataclass
class CommCounter:
    """Tally of collectives and ring-model bytes sent by this rank while :meth:`counting`."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: float = 0.0
    bytes_by_group: dict[str, float] = field(default_factory=dict)
    enabled: bool = False
    _batch: set[str] | None = field(default=None, repr=False)  # kinds seen in an open batch

    def record(self, name: str, sent_bytes: float, group: dist.ProcessGroup | None = None) -> None:
        """Add one collective over ``group`` in which this rank sends ``sent_bytes``.

        Inside a coalesced batch, only the first of each kind adds a call.
        """
        if not self.enabled:
            return
        if self._batch is None or name not in self._batch:
            self.calls[name] = self.calls.get(name, 0) + 1
        if self._batch is not None:
            self._batch.add(name)
        self.bytes_sent += sent_bytes
        key = group_key(group)
        self.bytes_by_group[key] = self.bytes_by_group.get(key, 0.0) + sent_bytes

    def _wrap_coalescing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        @functools.wraps(original)
        def batched(*args: Any, **kwargs: Any) -> Iterator[Any]:
            outer, self._batch = self._batch, set()
            try:
                with original(*args, **kwargs) as manager:
                    yield manager
            finally:
                self._batch = outer

        return batched

    def _wrap_group_gather(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(group: dist.ProcessGroup, outputs: list[Any], *args: Any) -> Any:
            world = group.size()
            if self.enabled and self._batch is None and world > 1:
                total = sum(_nbytes(t) for t in outputs)
                self.record("all_gather_single", total * (world - 1) / world, group)
            return original(group, outputs, *args)

        return counted

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.calls.clear()
        self.bytes_sent = 0.0
        self.bytes_by_group.clear()

    @property
    def num_calls(self) -> int:
        """Collectives counted so far."""
        return sum(self.calls.values())

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        byte_model = _BYTE_MODEL.get(name)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.enabled and byte_model is None:
                arguments = list(args) + list(kwargs.values())
                ops = arguments[0]
                self.record(name, _EXACT_BYTES[name](arguments), ops[0].group if ops else None)
            elif self.enabled and byte_model is not None:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                group = bound.arguments.get("group")
                world = dist.get_world_size(group)
                splits = bound.arguments.get("input_split_sizes")
                if world <= 1:
                    pass
                elif splits:  # an uneven all-to-all: exactly what goes to the other ranks
                    source = bound.arguments["input"]  # splits count its dim-0 rows
                    row = math.prod(source.shape[1:]) * source.element_size()
                    me = dist.get_rank(group)
                    sent = sum(n for r, n in enumerate(splits) if r != me) * row
                    self.record(name, sent, group)
                else:
                    total = byte_model(list(bound.arguments.values()))
                    self.record(name, total * (world - 1) / world, group)
            return original(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def installed(self) -> Iterator[CommCounter]:
        """Wrap the collectives for the duration of the block (counting starts disabled)."""
        saved: list[tuple[Any, str, Any]] = []
        for module in (dist, distributed_c10d):
            for name in (*_BYTE_MODEL, *_EXACT_BYTES):
                defined = collective_name(name)
                original = getattr(module, defined, None)
                if original is None:
                    continue
                saved.append((module, defined, original))
                setattr(module, defined, self._wrap(name, original))
            manager = "_coalescing_manager"
            coalescing = getattr(module, manager, None)
            if coalescing is not None:
                saved.append((module, manager, coalescing))
                setattr(module, manager, self._wrap_coalescing(coalescing))
        # Restored from the class's own dict: pybind11 keeps an instance-method descriptor
        # there, and the function getattr gives instead would not bind to the group.
        name = "allgather_into_tensor_coalesced"
        saved.append((dist.ProcessGroup, name, vars(dist.ProcessGroup)[name]))
        group_gather = getattr(dist.ProcessGroup, name)
        setattr(dist.ProcessGroup, name, self._wrap_group_gather(group_gather))
        try:
            yield self
        finally:
            for module, name, original in saved:
                setattr(module, name, original)
