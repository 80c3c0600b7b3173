"""mf_fsdp: fully sharded data parallelism (ZeRO-0..3) over flat, bucketed buffers.

Start with ``fully_shard(model, optimizer, fsdp_unit_modules=[Block])``; see
docs/sharding.md for the gradient-reduction contract and the strategies. Code written for
PyTorch FSDP2 uses ``mf_fsdp.fsdp2.fully_shard`` instead (same interface, mf's engine).
"""

from mf_fsdp import fsdp2
from mf_fsdp.buckets.layout import (
    DEFAULT_ALIGNMENT,
    BucketLayout,
    compute_bucket_layout,
    partition_bucket,
)
from mf_fsdp.buckets.units import plan_bucket_layouts
from mf_fsdp.checkpoint.convert import (
    checkpoint_to_full_state_dict,
    full_state_dict_to_checkpoint,
    save_full_state_dict,
)
from mf_fsdp.checkpoint.load import latest_checkpoint, load_checkpoint
from mf_fsdp.checkpoint.record import RECORD_FILE
from mf_fsdp.checkpoint.save import save_checkpoint
from mf_fsdp.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from mf_fsdp.checkpoint.verify import verify_checkpoint
from mf_fsdp.config import (
    DEFAULT_COMMUNICATION_UNIT_SIZE,
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    TrainingState,
    ZeroDPStrategy,
    normalize_outer_strategy,
    normalize_strategy,
)
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine.grad_norm import clip_grad_norm_, get_grad_norm
from mf_fsdp.engine.megatron_fsdp import BucketStats, MegatronFSDP, RegisterFSDPBackwardFunction
from mf_fsdp.engine.rank_paths import UnitOrderError
from mf_fsdp.fully_shard import fully_shard, fully_shard_model
from mf_fsdp.optim.optimizer import fully_shard_optimizer
from mf_fsdp.optim.shape_aware import ELEMENTWISE_OPTIMIZERS, register_elementwise_optimizer

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_COMMUNICATION_UNIT_SIZE",
    "ELEMENTWISE_OPTIMIZERS",
    "RECORD_FILE",
    "BucketLayout",
    "BucketStats",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "RegisterFSDPBackwardFunction",
    "TrainingState",
    "UnitOrderError",
    "ZeroDPStrategy",
    "checkpoint_to_full_state_dict",
    "clip_grad_norm_",
    "compute_bucket_layout",
    "fsdp2",
    "full_state_dict_to_checkpoint",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "get_grad_norm",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "normalize_outer_strategy",
    "normalize_strategy",
    "partition_bucket",
    "plan_bucket_layouts",
    "register_elementwise_optimizer",
    "save_checkpoint",
    "save_full_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "verify_checkpoint",
]
