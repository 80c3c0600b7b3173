"""What ``mf-bench --cp`` measures beside the engines' table: activations and CP traffic.

- :func:`cp_group_mesh`: the cp mesh of a run, on process groups of its own, so
  the collective counter tells CP's bytes from the sharding engine's (a mesh
  dim spanning the world would reuse the default group, the engine's).
- :func:`saved_activation_bytes`: the bytes the forward keeps for the backward
  (distinct storages of autograd's saved tensors, parameters left out): the
  activation memory a rank holds, device-agnostic, without allocator noise.
- :func:`cp_traffic`: the bytes each rank must send per step for attention's
  K/V under CP: mf's (all-gather, re-gather, reduce-scatter: ``3(N-1)·kv``
  per attention call), a ring's least (K/V in forward, dK/dV back, K/V kept
  in between: ``2(N-1)·kv``) and the least under the balanced causal mask
  (``1.5(N-1)·kv``); ``kv`` is one rank's K plus V shard. See
  docs/context-parallel.md.

It must not: change what the run computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mf.models import GPTConfig

__all__ = ["CPTraffic", "SavedBytes", "cp_group_mesh", "cp_traffic", "saved_activation_bytes"]


def cp_group_mesh(cp: int, device_type: str) -> DeviceMesh:
    """The 1-D cp mesh of this rank: ranks ``[d * cp, (d + 1) * cp)`` for data-parallel ``d``.

    Collective: every rank calls it. Its groups are new ones (see the module docstring).
    """
    world = dist.get_world_size()
    groups = [list(range(start, start + cp)) for start in range(0, world, cp)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    # cast: this rank is in one of the groups (the function's type allows it none)
    return DeviceMesh.from_group(
        cast(dist.ProcessGroup, group), device_type, mesh_dim_names=("cp",)
    )


@dataclass
class SavedBytes:
    """Bytes of the distinct storages autograd saved while counting."""

    total: int = 0


@contextmanager
def saved_activation_bytes() -> Iterator[SavedBytes]:
    """Count what the forward run inside saves for the backward (parameters excluded)."""
    tally = SavedBytes()
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) and tensor.device.type != "meta":
            for pointer, nbytes in _storages(tensor):
                if pointer not in seen:
                    seen.add(pointer)
                    tally.total += nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield tally


def _storages(tensor: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``(data pointer, bytes)`` of the storages holding ``tensor``.

    A wrapper subclass (torchao's float8 tensors) has no storage of its own: its
    inner tensors are counted instead.
    """
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor:
        names, _ = flatten()
        for name in names:
            yield from _storages(getattr(tensor, name))
        return
    storage = tensor.untyped_storage()
    yield storage.data_ptr(), storage.nbytes()


@dataclass(frozen=True)
class CPTraffic:
    """Bytes one rank sends per training step for attention's K/V under CP."""

    mf: float
    ring: float
    causal: float


def cp_traffic(
    config: GPTConfig, micro_batch: int, seq_len: int, cp: int, itemsize: int
) -> CPTraffic:
    """The bytes of mf's scheme and the two floors, for ``config``'s causal attention."""
    head_dim = config.d_model // config.n_heads
    kv = 2 * micro_batch * config.n_heads * (seq_len // cp) * head_dim * itemsize
    per_call = (cp - 1) * kv * config.n_layers
    return CPTraffic(mf=3 * per_call, ring=2 * per_call, causal=1.5 * per_call)
