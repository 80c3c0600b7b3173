"""Entry points: fully_shard, fully_shard_model (and re-export of fully_shard_optimizer).

They validate the mesh and dims, build the ``FSDPDistributedIndex`` (a 1-D
mesh over the whole world when none is given), wrap the model in
``MegatronFSDP`` and rebind the optimizer.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mf_fsdp.buckets.layout import DEFAULT_ALIGNMENT
from mf_fsdp.config import (
    DEFAULT_COMMUNICATION_UNIT_SIZE,
    DistributedDataParallelConfig,
    MixedPrecisionPolicy,
    ZeroDPStrategy,
    normalize_strategy,
)
from mf_fsdp.distributed_index import FSDPDistributedIndex
from mf_fsdp.engine.discover import expert_dtensor_dim
from mf_fsdp.engine.megatron_fsdp import MegatronFSDP, check_module_to_wrap
from mf_fsdp.engine.options import check_engine_options
from mf_fsdp.optim.optimizer import Optimizers, fully_shard_optimizer
from mf_utils import get_group_device

__all__ = ["fully_shard", "fully_shard_model"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


_ONCE_POSITIONAL = (
    "device_mesh",
    "dp_shard_dim",
    "dp_outer_dim",
    "tp_dim",
    "fsdp_unit_modules",
    "zero_dp_strategy",
    "outer_dp_sharding_strategy",
    "device",
    "init_model_with_meta_device",
    "mixed_precision_policy",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "sync_model_each_microbatch",
    "preproc_state_dict_for_dcp_ckpt",
    "average_in_collective",
    "disable_bucketing",
    "calculate_per_token_loss",
)
"""The arguments after ``module`` that mf-fsdp up to 0.6 took by position as well."""


def _keyword_only(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn``, still taking the arguments it once took by position, with a DeprecationWarning.

    Seventeen positional options are a call nobody can read; from mf-fsdp 0.7.0
    they are keyword-only. A call that passes some by position still works for
    this release, as the versioning policy asks, and is told how to change.
    """

    @functools.wraps(fn)
    def call(module: nn.Module, *args: Any, **kwargs: Any) -> _R:
        if args:
            if len(args) > len(_ONCE_POSITIONAL):
                raise TypeError(
                    f"{fn.__name__}: takes the module, then at most {len(_ONCE_POSITIONAL)} "
                    f"arguments by position (deprecated), got {len(args)}"
                )
            names = _ONCE_POSITIONAL[: len(args)]
            twice = [name for name in names if name in kwargs]
            if twice:
                raise TypeError(f"{fn.__name__}: got {twice} both by position and by name")
            warnings.warn(
                f"{fn.__name__}: passing {', '.join(names)} by position is deprecated since "
                "mf-fsdp 0.7.0 (they are keyword-only); pass them by name",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs.update(zip(names, args, strict=True))
        # ParamSpec cannot say "the module, then _P's keywords"; fn's callers are checked.
        return fn(module, **kwargs)  # type: ignore[arg-type]

    return call  # type: ignore[return-value]


@_keyword_only
def fully_shard_model(
    module: nn.Module,
    *,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    fsdp_unit_modules: Sequence[type[nn.Module] | str] | None = None,
    zero_dp_strategy: ZeroDPStrategy | int | str = 3,
    outer_dp_sharding_strategy: ZeroDPStrategy | int | str = 0,
    device: torch.device | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    gradient_scaling_factor: float | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    expt_device_mesh: DeviceMesh | None = None,
    suggested_communication_unit_size: int = DEFAULT_COMMUNICATION_UNIT_SIZE,
    find_unused_parameters: bool = False,
    optimizer_step_in_backward: bool = False,
    offload_optimizer_state: bool = False,
) -> MegatronFSDP:
    """Wrap ``module`` in ``MegatronFSDP`` over ``device_mesh`` (``fully_shard`` minus optimizer).

    Args:
        module: the model (on the meta device with ``init_model_with_meta_device``).
        device_mesh: mesh over all ranks; None builds a 1-D ``("dp_shard",)`` mesh.
        dp_shard_dim: the dim parameters are sharded over (optional for a 1-D mesh).
        dp_outer_dim: the dim of replicas (HSDP), or None.
        tp_dim: the tensor-parallel dim, or None.
        fsdp_unit_modules: classes or dotted class paths gathered/released as units
            (a list or tuple of them, or a single one).
        zero_dp_strategy: 0..3 or "no_shard" / "optim" / "optim_grads" /
            "optim_grads_params".
        outer_dp_sharding_strategy: across dp_outer: 0 / "no_shard" replicates (HSDP);
            1 / "optim" also shards main weights, grads and optimizer state there
            (hybrid-sharded HSDP; needs ``dp_outer_dim`` and ``zero_dp_strategy`` 3).
        device: buffer device (default: the group's device).
        init_model_with_meta_device: materialise meta parameters unit by unit.
        mixed_precision_policy: dtypes (compute, main, grads, communication).
        overlap_grad_reduce: reduce each unit's grads asynchronously during backward.
        overlap_param_gather: prefetch the next unit's weights (ZeRO-3).
        sync_model_each_microbatch: wait for reductions at the end of each backward.
        preproc_state_dict_for_dcp_ckpt: accepted for the reference's API; state dicts
            are always ready for ``dcp.save`` (False warns that it has no effect).
        average_in_collective: divide inside the collective (same result).
        disable_bucketing: one bucket for all parameters.
        calculate_per_token_loss: reduce grads by sum instead of mean.
        gradient_scaling_factor: extra factor on every reduced gradient (finite, > 0).
        alignment: per-tensor alignment inside a bucket, in elements.
        expt_device_mesh: the mesh of expert parameters (mixture-of-experts models):
            over the same ranks, with a dim named like ``dp_shard_dim`` that is the
            expert-data-parallel group (see ``FSDPDistributedIndex``). Grouped experts
            that are DTensors ``Shard(d)`` over the expert-parallel group (mf-tp's
            ``GroupedExperts``) keep that split: the dim of this mesh over the same
            ranks is found, and their state-dict entries are the full ``[E, ...]``.
        suggested_communication_unit_size: the communication window in elements
            (``DistributedDataParallelConfig``): consecutive units whose buckets fit
            in it together are gathered and reduced in one collective; 0 turns that off.
        find_unused_parameters: a parameter no rank's backward reached in a step gets
            no gradient (``.grad`` None, so torch's optimizers leave it alone), also
            inside a unit that ran or in the root, as DDP's option does; one device
            sync per step (``DistributedDataParallelConfig``). Without it, only the
            parameters of units that no rank ran get none.
        optimizer_step_in_backward: (ZeRO-2/3) run each bucket's optimizer step inside
            the backward, as soon as its gradients are reduced, and free them at once
            (``DistributedDataParallelConfig``; see docs/performance.md). Needs the optimizer
            bound (``fully_shard`` or ``fully_shard_optimizer``) and elementwise; no
            global-norm clipping.
        offload_optimizer_state: (ZeRO-1/2/3) keep the fp32 main weights, the optimizer
            state and the reduced gradients' copy in host memory (pinned on CUDA) and
            step there with torch's multi-tensor kernels; the device keeps the compute
            weights and the gradients being reduced (``DistributedDataParallelConfig``;
            see docs/performance.md). Needs an elementwise optimizer; no tensor
            parallelism.

    Returns:
        The ``MegatronFSDP`` wrapping ``module``.

    Raises:
        RuntimeError: if torch.distributed is not initialised.
        ValueError: if ``module`` is already wrapped (a ``MegatronFSDP``, or a module
            with a parameter an engine manages); checked before any communication.
        TypeError / ValueError: for other bad arguments (see ``MegatronFSDP``).
    """
    check_module_to_wrap(module)
    check_engine_options(mixed_precision_policy, gradient_scaling_factor)
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=normalize_strategy(zero_dp_strategy),
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        average_in_collective=average_in_collective,
        suggested_communication_unit_size=suggested_communication_unit_size,
        find_unused_parameters=find_unused_parameters,
        optimizer_step_in_backward=optimizer_step_in_backward,
        offload_optimizer_state=offload_optimizer_state,
    )
    hybrid = config.outer_dp_sharding_strategy is ZeroDPStrategy.OPTIM
    if hybrid and dp_outer_dim is None:
        raise ValueError(
            "outer_dp_sharding_strategy: 'optim' (hybrid-sharded HSDP) shards across dp_outer "
            "but dp_outer_dim is None; expected the name of the outer dim of device_mesh"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard_model: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    if device_mesh is None:
        device_type = get_group_device(None).type
        device_mesh = init_device_mesh(
            device_type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",)
        )
        dp_shard_dim = dp_shard_dim or "dp_shard"
    elif not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"fully_shard_model: device_mesh must be a DeviceMesh, got {device_mesh!r}")
    if device_mesh.size() != dist.get_world_size():
        raise ValueError(
            f"device_mesh: covers {device_mesh.size()} ranks (shape {tuple(device_mesh.shape)}) "
            f"but the world has {dist.get_world_size()}; expected a mesh over every rank"
        )
    index = FSDPDistributedIndex(
        device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hsdp_outer_dp_shard=hybrid,
        expt_device_mesh=expt_device_mesh,
        expt_tp_dim=expert_dtensor_dim(module, expt_device_mesh),
    )
    model = MegatronFSDP(
        module,
        index,
        config,
        fsdp_unit_modules=fsdp_unit_modules,
        disable_bucketing=disable_bucketing,
        device=device,
        calculate_per_token_loss=calculate_per_token_loss,
        init_model_with_meta_device=init_model_with_meta_device,
        sync_model_each_microbatch=sync_model_each_microbatch,
        mixed_precision_policy=mixed_precision_policy,
        gradient_scaling_factor=gradient_scaling_factor,
        alignment=alignment,
    )
    if not preproc_state_dict_for_dcp_ckpt:
        warnings.warn(
            "fully_shard_model: preproc_state_dict_for_dcp_ckpt=False has no effect; "
            "model.state_dict() always holds DTensors that DCP saves and loads correctly",
            UserWarning,
            stacklevel=2,
        )
    return model


def _adds_optimizer(
    shard_model: Callable[Concatenate[nn.Module, _P], MegatronFSDP],
) -> Callable[[Callable[..., _R]], Callable[Concatenate[nn.Module, Optimizers, _P], _R]]:
    """Declare a ``(module, optimizer, *args, **kwargs)`` function as ``shard_model`` + optimizer.

    The function's ``__signature__`` becomes ``shard_model``'s with an ``optimizer``
    parameter after the first, and type checkers see the same, so the long argument
    list is written once.
    """
    params = list(inspect.signature(shard_model).parameters.values())
    optimizer = inspect.Parameter(
        "optimizer",
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        annotation="torch.optim.Optimizer | Sequence[torch.optim.Optimizer]",
    )

    def declare(
        fn: Callable[..., _R],
    ) -> Callable[Concatenate[nn.Module, Optimizers, _P], _R]:
        own = inspect.signature(fn)
        fn.__signature__ = own.replace(parameters=[params[0], optimizer, *params[1:]])  # type: ignore[attr-defined]
        return fn

    return declare


@_adds_optimizer(fully_shard_model)
def fully_shard(
    module: nn.Module, optimizer: Optimizers, *args: Any, **kwargs: Any
) -> tuple[MegatronFSDP, Optimizers]:
    """Shard ``module`` and rebind ``optimizer`` so the plain training loop just works.

    After it, ``loss = model(x); loss.backward(); optimizer.step(); optimizer.zero_grad()``
    trains with data parallelism: ``optimizer.step()`` first finishes any pending
    gradient reduction, steps on this rank's shard, then installs the new weights.

    Its signature is ``fully_shard_model``'s with ``optimizer`` after ``module``
    (``inspect.signature`` shows it in full); every other argument goes to
    ``fully_shard_model`` unchanged.

    Args:
        module: the model (on the meta device with ``init_model_with_meta_device``).
        optimizer: a torch optimizer built on ``module``'s parameters, not stepped yet,
            or a list or tuple of them (e.g. Muon for the matrices, AdamW for the rest).
        *args: ``fully_shard_model``'s arguments after ``module`` (``device_mesh``, ...).
        **kwargs: the same by name.

    Returns:
        ``(model, optimizer)``: the ``MegatronFSDP`` and the same optimizer(s), rebound.
    """
    model = fully_shard_model(module, *args, **kwargs)
    if isinstance(optimizer, list | tuple):
        return model, type(optimizer)(fully_shard_optimizer(o, model) for o in optimizer)
    return model, fully_shard_optimizer(optimizer, model)
