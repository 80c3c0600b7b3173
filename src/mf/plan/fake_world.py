"""torch's fake process group of N ranks in this one process, for the length of a plan.

A fake group answers every collective at once and moves nothing, so mf's engine
can be built (and, on meta tensors, sized) as rank ``r`` of a job of any size.
It is the default group while it lasts: the planner refuses to run where a real
group already exists rather than replace it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` fake ranks inside the block.

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``.
        RuntimeError: this process already has a process group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"fake_world: rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "mf-plan: this process already has a process group; plan in a process of its own"
        )
    # Importing the module registers torch's "fake" backend.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
