"""What mf_fsdp's collectives hand to torch.distributed: a spy, and the native backend's paths.

``spy_collectives()`` records every collective torch.distributed receives inside
the block: the kind, the dtype and size, whether it went inside a coalesced call,
and whether a reduce-scatter ran in place. Tests read what mf really issues from
it (the dtype of each reduction, which branch ran), rather than patching one
torch function that mf may never call: on gloo mf packs small reduce-scatters
into all-reduces and sends large ones point to point.

``native_collectives()`` makes ``mf_fsdp.buckets.collectives`` take, on gloo,
the branches it takes on NCCL and every other backend: the native call at every
size (no point-to-point transfers), packs through torch's
``_coalescing_manager`` for every kind, in-place reduce-scatters handed to the
backend, and the division before the reduction (``divides_after_reduction``).
gloo serves all of these, on torch 2.11 and 2.15 alike. The engine decides the
branches from one fact per process group, ``transfers.GroupFacts.gloo``; the switch
reports it False. Without it those branches run only on a multi-GPU machine:
the CUDA tests run at world 1, where every collective is skipped.

Start with the pattern of ``tests/fsdp/buckets/test_native_collectives.py``::

    with native_collectives(), spy_collectives() as issued:
        ...  # a training run
    assert not [call for call in issued if call.kind == "point_to_point"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mf_fsdp.buckets import transfers

__all__ = ["REDUCTIONS", "Issued", "native_collectives", "spy_collectives"]

REDUCTIONS = ("reduce_scatter", "all_reduce")
"""The kinds of ``Issued`` that reduce (a point-to-point transfer may carry either)."""


@dataclass(frozen=True, slots=True)
class Issued:
    """One collective torch.distributed received.

    Attributes:
        kind: "all_gather", "reduce_scatter", "all_reduce" or "point_to_point" (one
            send or receive of ``batch_isend_irecv``).
        dtype: the dtype of the tensor sent (the input; an all-reduce's tensor).
        numel: the elements of the whole bucket: a gather's output, a reduction's
            input (a point-to-point transfer: the piece sent or received).
        coalesced: issued as part of one coalesced call (torch's
            ``_coalescing_manager``, or a process group's coalesced all-gather).
        in_place: a reduce-scatter whose output is a view into its input.
    """

    kind: str
    dtype: torch.dtype
    numel: int
    coalesced: bool = False
    in_place: bool = False

    def branch(self) -> str:
        """A short name of the path it took, e.g. ``"reduce_scatter coalesced in place"``."""
        return " ".join(
            [self.kind, *(["coalesced"] if self.coalesced else []), *(["in place"] * self.in_place)]
        )


class _Depth(threading.local):
    """How deep this thread is inside torch's ``_coalescing_manager``."""

    value = 0


def _inside(output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether ``output``'s memory lies inside ``input``'s."""
    start, size = input.data_ptr(), input.numel() * input.element_size()
    return start <= output.data_ptr() < start + size


@contextlib.contextmanager
def spy_collectives() -> Iterator[list[Issued]]:
    """Record every collective torch.distributed receives inside the block (all threads).

    Yields the list the calls are appended to, in the order they were issued. The
    calls still run: the spy only looks.
    """
    issued: list[Issued] = []
    depth = _Depth()
    originals = {
        name: getattr(dist, name)
        for name in (
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_reduce",
            "batch_isend_irecv",
            "_coalescing_manager",
        )
    }
    # The class's own attribute (pybind's ``instancemethod``), to put back as it was:
    # what ``getattr`` returns is the unbound function, which would not bind again.
    coalesced_gather = vars(dist.ProcessGroup)["allgather_into_tensor_coalesced"]

    def all_gather_into_tensor(output, input, *args, **kwargs):
        issued.append(Issued("all_gather", input.dtype, output.numel(), depth.value > 0))
        return originals["all_gather_into_tensor"](output, input, *args, **kwargs)

    def reduce_scatter_tensor(output, input, *args, **kwargs):
        in_place = _inside(output, input)
        issued.append(
            Issued("reduce_scatter", input.dtype, input.numel(), depth.value > 0, in_place)
        )
        return originals["reduce_scatter_tensor"](output, input, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        issued.append(Issued("all_reduce", tensor.dtype, tensor.numel(), depth.value > 0))
        return originals["all_reduce"](tensor, *args, **kwargs)

    def batch_isend_irecv(ops):
        issued.extend(Issued("point_to_point", op.tensor.dtype, op.tensor.numel()) for op in ops)
        return originals["batch_isend_irecv"](ops)

    @contextlib.contextmanager
    def _coalescing_manager(*args, **kwargs):
        # Raised until the manager's exit has made its one call of the group.
        depth.value += 1
        try:
            with originals["_coalescing_manager"](*args, **kwargs) as manager:
                yield manager
        finally:
            depth.value -= 1

    def allgather_into_tensor_coalesced(group, outputs, inputs, *args):
        if depth.value == 0:  # else the calls were recorded one by one inside the manager
            issued.extend(
                Issued("all_gather", i.dtype, o.numel(), True)
                for o, i in zip(outputs, inputs, strict=True)
            )
        return coalesced_gather.__get__(group)(outputs, inputs, *args)

    replacements = {
        "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "all_reduce": all_reduce,
        "batch_isend_irecv": batch_isend_irecv,
        "_coalescing_manager": _coalescing_manager,
    }
    for name, replacement in replacements.items():
        setattr(dist, name, replacement)
    dist.ProcessGroup.allgather_into_tensor_coalesced = allgather_into_tensor_coalesced
    try:
        yield issued
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        dist.ProcessGroup.allgather_into_tensor_coalesced = coalesced_gather


@contextlib.contextmanager
def native_collectives() -> Iterator[None]:
    """Inside the block, mf_fsdp's collectives treat gloo groups as a native backend's.

    Enter it before the model is wrapped: the engine reads the backend's facts when
    it is built (``divides_after_reduction``) and at every collective.
    """
    facts = transfers.group_facts

    def as_native(group: dist.ProcessGroup) -> transfers.GroupFacts:
        return dataclasses.replace(facts(group), gloo=False)

    transfers.group_facts = as_native
    try:
        yield
    finally:
        transfers.group_facts = facts
