"""What an engine tells about itself: its optimizer's parameters, its buckets and its bytes.

``EngineIntrospection`` is a part of ``MegatronFSDP`` (a base class of it):
questions asked of a built engine that change nothing, kept apart from the
training controls in ``engine/megatron_fsdp.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from mf_fsdp.buckets.bucket import Bucket
from mf_fsdp.buckets.buffer_pool import BufferPool
from mf_fsdp.buckets.param import FSDPParam
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine.forms import ParamForms
from mf_fsdp.engine.sharded_params import OWNER_ATTR
from mf_fsdp.engine.stats import BucketStats, bucket_stats, memory_footprint
from mf_fsdp.engine.unit import Unit

__all__ = ["EngineIntrospection"]


class EngineIntrospection:
    """The engine's read-only questions; the attributes are the engine's own."""

    _forms: ParamForms
    _units: list[Unit]
    _pool: BufferPool
    groups: list[Bucket]
    fsdp_params: list[FSDPParam]
    dist_index: FSDPDistributedIndex

    def optimizer_param(self, param: nn.Parameter) -> nn.Parameter:
        """The sharded parameter the optimizer steps on in place of ``param``.

        ``param`` may be an original (compute) parameter of the wrapped module or
        already a sharded one (then it is returned as is).

        Raises:
            ValueError: if ``param`` is not a parameter managed by this engine.
        """
        fp = self._forms.record_of(param)
        if fp is not None:
            return fp.sharded
        ref = getattr(param, OWNER_ATTR, None)  # a sharded parameter of this engine
        if ref is not None and ref() is self:
            return param
        raise ValueError(
            f"param: a tensor of shape {tuple(param.shape)} is not a parameter managed by "
            "this MegatronFSDP; expected a parameter of the wrapped module"
        )

    def optimizer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(canonical name, sharded parameter) for every managed parameter, in bucket order."""
        for fp in self.fsdp_params:
            yield fp.fqn, fp.sharded

    def bucket_stats(self) -> list[BucketStats]:
        """Size and padding of every bucket, as seen from this rank."""
        names = {id(g): unit.name for unit in self._units for g in unit.groups}
        named = [(names.get(id(g), ""), g) for g in self.groups]
        return bucket_stats(named, self.dist_index.shard_rank)

    def memory_footprint(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds: params, separate main params, grads, pool (and optimizer).

        ``pool`` is the reusable temporaries currently idle; with ``optimizer``, the
        local pieces of its state tensors are counted under ``optimizer_state``.
        """
        return memory_footprint(self.groups, self._pool, optimizer)
