"""Size facts of the engine's buckets and the bytes a rank holds (read-only reporting).

What ``MegatronFSDP.bucket_stats()`` and ``memory_footprint()`` return, for the
benchmark and the scale simulation. These functions only read layouts and
buffer sizes: they allocate nothing and never communicate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mf_fsdp.buckets import collectives
from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.tp_params import local_value

__all__ = ["BucketStats", "bucket_stats", "memory_footprint"]


@dataclass(slots=True)
class BucketStats:
    """Size facts of one bucket, as the benchmark and the scale simulation read them.

    Attributes:
        unit_name: the unit's qualified name ("" for the root bucket).
        dtype: compute dtype.
        numel: elements of real data.
        padded_numel: bucket size including alignment and tail padding.
        padding_fraction: ``1 - numel / padded_numel``.
        shard_numel: elements each rank holds of the bucket (padding included).
        rank_numel: real elements this rank owns.
    """

    unit_name: str
    dtype: torch.dtype
    numel: int
    padded_numel: int
    padding_fraction: float
    shard_numel: int
    rank_numel: int


def bucket_stats(named_groups: Iterable[tuple[str, Bucket]], rank: int) -> list[BucketStats]:
    """One ``BucketStats`` per ``(unit name, bucket)``, as seen from dp_shard rank ``rank``."""
    return [
        BucketStats(
            unit_name=name,
            dtype=g.dtypes.compute,
            numel=g.layout.numel,
            padded_numel=g.layout.padded_numel,
            padding_fraction=g.layout.padding_fraction,
            shard_numel=g.layout.shard_size,
            rank_numel=g.layout.rank_numel(rank),
        )
        for name, g in named_groups
    ]


def memory_footprint(
    groups: Iterable[Bucket],
    pool: BufferPool,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, int]:
    """Bytes held: params, separate main params, grads, idle pools (and optimizer state).

    ``pool`` counts the engine's idle temporaries and the collectives' receive buffers.

    With ``optimizer``, the local pieces of its state tensors are counted under
    ``optimizer_state``. With ``offload_optimizer_state``, ``main_params``,
    ``optimizer_state`` and ``host_grads`` (the reduced grads' host copy) are
    host memory; ``params``, ``grads`` and ``pool`` are on the device.
    """
    total = {"params": 0, "main_params": 0, "grads": 0}
    for group in groups:
        for key, value in group.owned_bytes().items():
            total[key] = total.get(key, 0) + value
    total["pool"] = pool.held_bytes() + collectives.workspace_bytes()
    if optimizer is not None:
        total["optimizer_state"] = sum(
            local_value(v).numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
    return total
