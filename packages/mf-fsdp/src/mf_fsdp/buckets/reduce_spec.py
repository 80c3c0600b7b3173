"""How a bucket's gradients are scaled and reduced: one place for every reduction option.

``ReduceSpec.build`` turns the engine's options (mean or per-token sum,
averaging inside the collective, an extra scaling factor, FSDP2's divide
factor, experts reduced over their own group) into the pre-multiplier, the
collective's op and the overall factor; the bucket applies them (see
``buckets/bucket_reduction.py``). Pure arithmetic: no tensors, no groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ReduceSpec"]


@dataclass(frozen=True, slots=True)
class ReduceSpec:
    """How gradients are reduced: pre-multiplier, collective op and the overall factor.

    Attributes:
        pre: multiply local grads by this before the collective (1.0 skips it).
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        factor: what the result is relative to the plain sum over dp ranks.
    """

    pre: float
    op: dist.ReduceOp.RedOpType
    factor: float

    @property
    def outer_op(self) -> dist.ReduceOp.RedOpType:
        """The op across dp_outer replicas (HSDP): averaging stays averaging."""
        return dist.ReduceOp.AVG if self.op == dist.ReduceOp.AVG else dist.ReduceOp.SUM

    @classmethod
    def build(
        cls,
        dp_size: int,
        per_token: bool,
        in_collective: bool,
        scale: float | None,
        reduce_size: int | None = None,
        divide_factor: float | None = None,
    ) -> ReduceSpec:
        """Derive the spec from the contract's knobs (one place for all scaling).

        ``dp_size`` is the number of data-parallel replicas the mean is over;
        ``reduce_size`` the ranks the collective runs over when that differs:
        expert gradients are summed over the expert-data-parallel group only
        (each expert-parallel rank already holds the contributions of its whole
        expert-parallel group), yet averaged over all ``dp_size`` replicas. A
        ``divide_factor`` (FSDP2's ``set_gradient_divide_factor``) replaces the
        mean: the sum over the replicas divided by it.
        """
        scale = 1.0 if scale is None else float(scale)
        reduce_size = dp_size if reduce_size is None else reduce_size
        if divide_factor is not None:
            return cls(scale / divide_factor, dist.ReduceOp.SUM, scale / divide_factor)
        if per_token:
            return cls(scale, dist.ReduceOp.SUM, scale)
        if in_collective:
            pre = scale if reduce_size == dp_size else scale * reduce_size / dp_size
            return cls(pre, dist.ReduceOp.AVG, scale / dp_size)
        return cls(scale / dp_size, dist.ReduceOp.SUM, scale / dp_size)
