"""mf_fsdp: fully sharded data parallelism (ZeRO-0..3) over flat, bucketed buffers.

Start with ``fully_shard(model, optimizer, fsdp_unit_modules=[Block])``; see
docs/sharding.md for the gradient-reduction contract and the strategies. Code written for
PyTorch FSDP2 uses ``mf_fsdp.fsdp2.fully_shard`` instead (same interface, mf's engine).
"""

import importlib
import warnings
from typing import Any

from mf_fsdp import checkpoint, config, fsdp2, optim, planning
from mf_fsdp.config import (
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    TrainingState,
    ZeroDPStrategy,
)
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine.grad_norm import clip_grad_norm_, get_grad_norm
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP, RegisterFSDPBackwardFunction
from mf_fsdp.engine.rank_paths import UnitOrderError
from mf_fsdp.fully_shard import fully_shard, fully_shard_model
from mf_fsdp.optim.optimizer import fully_shard_optimizer

__all__ = [
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "RegisterFSDPBackwardFunction",
    "TrainingState",
    "UnitOrderError",
    "ZeroDPStrategy",
    "checkpoint",
    "clip_grad_norm_",
    "config",
    "fsdp2",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "get_grad_norm",
    "optim",
    "planning",
]

_MOVED = {
    **dict.fromkeys(checkpoint.__all__, "checkpoint"),
    **dict.fromkeys(planning.__all__, "planning"),
    **dict.fromkeys(optim.__all__, "optim"),
    **dict.fromkeys(
        ("DEFAULT_COMMUNICATION_UNIT_SIZE", "normalize_strategy", "normalize_outer_strategy"),
        "config",
    ),
}
"""Names mf_fsdp exported at the top up to 0.6, and the public sub-module they live in now."""


def __getattr__(name: str) -> Any:
    """A name moved to a sub-module in 0.7.0, still found here with a DeprecationWarning."""
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'mf_fsdp' has no attribute {name!r}")
    warnings.warn(
        f"mf_fsdp.{name} moved to mf_fsdp.{home}.{name} in mf-fsdp 0.7.0 (the top-level "
        "name will go in a later release)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f"mf_fsdp.{home}"), name)
