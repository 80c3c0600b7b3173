"""mf_fsdp: fully sharded data parallelism (ZeRO-0..3) over flat, bucketed buffers.

Start with ``fully_shard(model, optimizer, fsdp_unit_modules=[Block])``; see the
README for the gradient-reduction contract and the strategies.
"""

from mf_fsdp.config import (
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    TrainingState,
    ZeroDPStrategy,
    normalize_outer_strategy,
    normalize_strategy,
)
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.fully_shard import fully_shard, fully_shard_model
from mf_fsdp.grad_norm import clip_grad_norm_, get_grad_norm
from mf_fsdp.layout import DEFAULT_ALIGNMENT, BucketLayout, compute_bucket_layout
from mf_fsdp.megatron_fsdp import BucketStats, MegatronFSDP, RegisterFSDPBackwardFunction
from mf_fsdp.optimizer import fully_shard_optimizer
from mf_fsdp.units import plan_bucket_layouts

__all__ = [
    "DEFAULT_ALIGNMENT",
    "BucketLayout",
    "BucketStats",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "RegisterFSDPBackwardFunction",
    "TrainingState",
    "ZeroDPStrategy",
    "clip_grad_norm_",
    "compute_bucket_layout",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "get_grad_norm",
    "normalize_outer_strategy",
    "normalize_strategy",
    "plan_bucket_layouts",
]
