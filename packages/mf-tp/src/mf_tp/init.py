"""Sharded weight initialisation that is independent of the TP size.

Responsibility: give every rank its shard of a full "master" weight that
depends only on the seed, never on the TP size or rank.

[Note: TP-size-independent init] Both paths draw the *full* master weight with
``init_method`` and keep this rank's shard, so the gathered weight is the same
at TP=1, 2, 4, ... for the same seed:

- CPU (:func:`initialize_affine_weight_cpu`): draws from the default CPU
  generator, as the reference does.
- on device (:func:`initialize_affine_weight_on_device`): draws on the weight's
  device inside ``mf_rng``'s tracker fork of the data-parallel state, which
  ``model_parallel_cuda_manual_seed(seed)`` seeds with ``seed`` on every rank.
  (The reference forks the model-parallel state, seed + 2718 + tp_rank, so its
  full weight changes with the TP size; we trade a transient full-size
  allocation for the invariance.) On the CPU both paths draw the same numbers
  right after seeding, because that call seeds the CPU generator with ``seed``.

Expert layers fork the expert-parallel state instead: experts on different
expert ranks must differ, so only the non-expert invariance holds for them.

Stride: a weight made of ``stride`` interleaved blocks (e.g. fused QKV) is cut
into ``stride * t`` pieces along ``partition_dim``; rank ``r`` keeps pieces
``r, r + t, r + 2t, ...``, which is what a strided layer expects.

It must not: touch the process group (ranks and sizes are passed in).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mf_rng import (
    InferenceRNGStatesTracker,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
)
from mf_tp.config import ModelParallelConfig
from mf_utils import divide, set_tensor_model_parallel_attributes

__all__ = [
    "allocate_sharded_weight",
    "initialize_affine_weight_cpu",
    "initialize_affine_weight_on_device",
]

InitMethod = Callable[[torch.Tensor], object]


def _shard_of_master(
    master: torch.Tensor,
    per_partition_size: int,
    partition_dim: int,
    stride: int,
    rank: int,
    world_size: int,
) -> torch.Tensor:
    if master.shape[partition_dim] != per_partition_size * world_size:
        raise ValueError(
            f"initialize_affine_weight: per_partition_size={per_partition_size!r} times "
            f"world_size={world_size!r} does not equal the full size "
            f"{master.shape[partition_dim]} of partition_dim={partition_dim!r}"
        )
    piece = divide(per_partition_size, stride)
    pieces = torch.split(master, piece, dim=partition_dim)
    return torch.cat(pieces[rank::world_size], dim=partition_dim)


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"initialize_affine_weight: need 0 <= rank < world_size, got rank={rank!r}, "
            f"world_size={world_size!r}"
        )


def initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int,
    world_size: int,
    skip_set_tensor_parallel_attributes: bool = False,
) -> torch.Tensor | None:
    """Fill ``weight`` with this rank's shard of a full ``[output_size, input_size]`` weight.

    The master is drawn in fp32 on the CPU, cast to ``params_dtype`` and split
    (see [Note: TP-size-independent init]).

    Args:
        weight: the shard to fill, ``per_partition_size`` along ``partition_dim``.
        output_size: full rows of the master weight.
        input_size: full columns of the master weight.
        per_partition_size: this rank's size along ``partition_dim``.
        partition_dim: 0 (column parallel) or 1 (row parallel).
        init_method: fills a tensor in place.
        stride: interleaved blocks per shard.
        return_master_weight: also return the full master weight.
        params_dtype: dtype the master is cast to before splitting.
        rank: this rank in the TP group.
        world_size: the TP group size.
        skip_set_tensor_parallel_attributes: do not tag ``weight`` with the TP
            attribute protocol of mf_utils.

    Returns:
        The master weight when ``return_master_weight``, else None.
    """
    _check_rank(rank, world_size)
    if not skip_set_tensor_parallel_attributes:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    master = torch.empty(output_size, input_size, dtype=torch.float32, requires_grad=False)
    init_method(master)
    master = master.to(dtype=params_dtype)
    shard = _shard_of_master(master, per_partition_size, partition_dim, stride, rank, world_size)
    with torch.no_grad():
        weight.copy_(shard)
    return master if return_master_weight else None


def initialize_affine_weight_on_device(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: InitMethod,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    rank: int,
    world_size: int,
    is_expert: bool = False,
) -> torch.Tensor | None:
    """Fill ``weight`` on its own device under the mf_rng tracker fork.

    The full master is drawn on ``weight.device`` inside the
    data-parallel fork (expert-parallel for ``is_expert``) in fp32, cast and split; see
    [Note: TP-size-independent init]. Needs ``mf_rng.model_parallel_cuda_manual_seed``
    to have run. Returns the master weight when ``return_master_weight``.

    Raises:
        ValueError: if the tracker's device type is not the weight's (its fork
            would not govern the draw).
        RuntimeError: if the tracker was not seeded.
    """
    _check_rank(rank, world_size)
    tracker = get_cuda_rng_tracker()
    if tracker.device.type != weight.device.type:
        raise ValueError(
            f"initialize_affine_weight_on_device: weight is on {weight.device}, but the mf_rng "
            f"tracker forks the {tracker.device} generator; seed it for the weight's device "
            "with model_parallel_cuda_manual_seed(seed, device=...)"
        )
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    name = (
        get_expert_parallel_rng_tracker_name()
        if is_expert
        else get_data_parallel_rng_tracker_name()
    )
    # fp32 first, like the CPU path, so both give the same numbers in any params dtype.
    master = torch.empty(output_size, input_size, dtype=torch.float32, device=weight.device)
    if not isinstance(tracker, InferenceRNGStatesTracker) and name not in tracker.get_states():
        raise RuntimeError(
            f"initialize_affine_weight_on_device: the mf_rng tracker has no {name!r} state; "
            "call mf_rng.model_parallel_cuda_manual_seed(seed) first, or set "
            "use_cpu_initialization=True"
        )
    with tracker.fork(name):
        init_method(master)
    master = master.to(dtype=weight.dtype)
    shard = _shard_of_master(master, per_partition_size, partition_dim, stride, rank, world_size)
    with torch.no_grad():
        weight.copy_(shard)
    return master if return_master_weight else None


def allocate_sharded_weight(
    shard_shape: tuple[int, int],
    full_shape: tuple[int, int],
    partition_dim: int,
    *,
    config: ModelParallelConfig,
    init_method: InitMethod,
    stride: int,
    rank: int,
    world_size: int,
    device: torch.device,
    is_expert: bool = False,
) -> tuple[torch.nn.Parameter, torch.Tensor | None]:
    """Allocate a layer's TP-sharded weight and initialise it as ``config`` asks.

    The weight lives on the CPU with ``config.use_cpu_initialization``, else on
    ``device``. Returns the parameter and the full master weight (None when
    ``config.perform_initialization`` is off), for ``keep_master_weight_for_test``.
    """
    target = torch.device("cpu") if config.use_cpu_initialization else device
    weight = torch.nn.Parameter(torch.empty(shard_shape, dtype=config.params_dtype, device=target))
    master = None
    per_partition = shard_shape[partition_dim]
    if not config.perform_initialization:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    elif config.use_cpu_initialization:
        master = initialize_affine_weight_cpu(
            weight,
            *full_shape,
            per_partition,
            partition_dim,
            init_method,
            stride,
            return_master_weight=True,
            params_dtype=config.params_dtype,
            rank=rank,
            world_size=world_size,
        )
    else:
        master = initialize_affine_weight_on_device(
            weight,
            *full_shape,
            per_partition,
            partition_dim,
            init_method,
            stride,
            return_master_weight=True,
            rank=rank,
            world_size=world_size,
            is_expert=is_expert,
        )
    return weight, master
