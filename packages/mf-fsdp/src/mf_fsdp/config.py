"""Public policies of the engine: sharding strategy, mixed precision, DDP config, states.

Everything here is a small frozen value validated at construction, so a bad
argument fails where the user wrote it, not deep inside a hook. Nothing here
touches process groups or tensors' storage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_COMMUNICATION_UNIT_SIZE",
    "DistributedDataParallelConfig",
    "MixedPrecisionPolicy",
    "TrainingState",
    "ZeroDPStrategy",
    "normalize_outer_strategy",
    "normalize_strategy",
]


class ZeroDPStrategy(enum.StrEnum):
    """What a data-parallel rank shards (see the strategy table in docs/sharding.md).

    - ``no_shard`` (0): full params and grads everywhere, grads all-reduced.
    - ``optim`` (1): optimizer state and main weights sharded (ZeRO-1).
    - ``optim_grads`` (2): gradients sharded too (ZeRO-2).
    - ``optim_grads_params`` (3): parameters sharded too (ZeRO-3).
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def level(self) -> int:
        """The ZeRO stage number 0..3."""
        return _LEVEL_OF[self]

    @property
    def shards_grads(self) -> bool:
        """True when the persistent gradient store holds only this rank's shard."""
        return _LEVEL_OF[self] >= 2  # read several times a step: one lookup, no nested property

    @property
    def shards_params(self) -> bool:
        """True when model weights live sharded between forward/backward passes."""
        return _LEVEL_OF[self] == 3


_LEVELS = (
    ZeroDPStrategy.NO_SHARD,
    ZeroDPStrategy.OPTIM,
    ZeroDPStrategy.OPTIM_GRADS,
    ZeroDPStrategy.OPTIM_GRADS_PARAMS,
)
_LEVEL_OF = {strategy: level for level, strategy in enumerate(_LEVELS)}


def normalize_strategy(value: object, name: str = "zero_dp_strategy") -> ZeroDPStrategy:
    """Turn 0..3, a strategy name or a ``ZeroDPStrategy`` into a ``ZeroDPStrategy``.

    Raises:
        ValueError: naming ``name``, the value and the accepted choices.
    """
    if isinstance(value, ZeroDPStrategy):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(_LEVELS):
        return _LEVELS[value]
    if isinstance(value, str) and value in ZeroDPStrategy._value2member_map_:
        return ZeroDPStrategy(value)
    choices = ", ".join(f"{i} / {s.value!r}" for i, s in enumerate(_LEVELS))
    raise ValueError(f"{name}: unknown strategy {value!r}; expected one of {choices}")


_OUTER_CHOICES = (ZeroDPStrategy.NO_SHARD, ZeroDPStrategy.OPTIM)


def normalize_outer_strategy(
    value: object, name: str = "outer_dp_sharding_strategy"
) -> ZeroDPStrategy:
    """Turn an outer (``dp_outer``) strategy into ``NO_SHARD`` (HSDP) or ``OPTIM`` (HFSDP).

    Accepts what the reference accepts: 0 / ``"no_shard"`` (replicate across
    dp_outer) and 1 / ``"optim"`` (optimizer state, main weights and gradient
    store also sharded across dp_outer), or the enum members.

    Raises:
        ValueError: naming ``name``, the value and the two accepted choices.
    """
    strategy = normalize_strategy(value, name)
    if strategy not in _OUTER_CHOICES:
        raise ValueError(
            f"{name}: {value!r} is not supported across dp_outer; expected 0 / 'no_shard' "
            "(replicate, HSDP) or 1 / 'optim' (hybrid-sharded HSDP)"
        )
    return strategy


class TrainingState(enum.Enum):
    """Where a parameter group is in the training step.

    FORWARD: its forward is running (params gathered). PRE_BACKWARD: its
    backward has started (params gathered, grads accumulating); a forward seen
    in this state is activation recomputation. POST_BACKWARD: its grads are
    being reduced. IDLE: between passes (ZeRO-3 params released).
    """

    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()
    IDLE = enum.auto()


_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_dtype(name: str, value: object) -> None:
    if value is not None and value not in _FLOAT_DTYPES:
        raise ValueError(
            f"MixedPrecisionPolicy: {name} must be None or one of {_FLOAT_DTYPES}, got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Dtypes of the compute weights, optimizer weights, gradients and their reduction.

    Attributes:
        param_dtype: compute dtype of the model weights (e.g. ``torch.bfloat16``);
            None keeps each parameter's own dtype.
        main_params_dtype: dtype of the optimizer's (main) weights; None uses the
            compute weights themselves. When it equals the compute dtype there is one
            copy of the weights, not two.
        main_grads_dtype: dtype of the reduced gradient store the optimizer reads;
            None means ``main_params_dtype`` (or the compute dtype when that is None).
        grad_comm_dtype: dtype the reduction runs in; None means ``main_grads_dtype``.
    """

    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        """Validate each dtype."""
        for name in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            _check_dtype(name, getattr(self, name))

    def resolve(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """Return (compute, main params, main grads, comm) dtypes for a parameter dtype."""
        compute = self.param_dtype or model_dtype
        main = self.main_params_dtype or compute
        grads = self.main_grads_dtype or main
        return compute, main, grads, self.grad_comm_dtype or grads


DEFAULT_COMMUNICATION_UNIT_SIZE = 1 << 18
"""Elements (1 MiB of fp32): below this, a bucket's collective costs its latency, not its bytes,
so consecutive units that fit together are gathered and reduced in one collective. Units of a
model large enough for sharding to matter are bigger, and communicate alone as before."""


@dataclass(slots=True)
class DistributedDataParallelConfig:
    """The reference's DDP/FSDP configuration fields that this engine honours.

    Attributes:
        data_parallel_sharding_strategy: ZeRO strategy (0..3 or its name); the
            reference's default, ``no_shard`` (``fully_shard`` defaults to 3).
        outer_dp_sharding_strategy: strategy across ``dp_outer``: 0 / ``no_shard``
            replicates there (HSDP); 1 / ``optim`` also shards main weights,
            gradient store and optimizer state across it (hybrid-sharded HSDP,
            which needs ``data_parallel_sharding_strategy`` 3).
        overlap_grad_reduce: reduce a unit's grads asynchronously as soon as its
            backward ends (else synchronously at that point).
        overlap_param_gather: prefetch the next unit's all-gather (ZeRO-3).
        average_in_collective: divide inside the collective (``ReduceOp.AVG``)
            instead of before it; the result is the same. Over gloo the engine
            always does (gloo divides only what it keeps, never a whole bucket
            on the main thread).
        grad_reduce_in_fp32: reduce gradients in fp32 whatever the compute dtype.
        suggested_communication_unit_size: the communication window, in elements of
            whole buckets (the reference's name). Units whose buckets fit in it
            together share one collective: ZeRO-3 prefetches the next units up to
            it (at least one), and reductions of consecutive units are held until
            the next would overflow it, then packed into one. 0 turns coalescing off
            (one unit prefetched, each unit reduced alone).
        find_unused_parameters: give the optimizer no gradient (``.grad`` None, as
            torch leaves it) for a parameter that no rank's backward reached in a
            step, also inside a unit that ran or in the root (DDP's option of the
            same name). It costs one device sync per step; without it, only the
            parameters of units no rank ran are found, at no cost.
        optimizer_step_in_backward: (ZeRO-2/3) step each bucket's parameters as soon
            as its gradients are reduced, inside the backward, then free the bucket's
            gradients (see docs/performance.md, "Optimizer step inside the backward");
            ``optimizer.step()`` then only finishes what is pending.
        offload_optimizer_state: (ZeRO-1/2/3) keep the main weights, the optimizer
            state and a copy of the reduced gradients in host memory (pinned when the
            device is CUDA) and step the optimizer there; the device keeps only the
            compute weights and the gradients being reduced (see docs/performance.md,
            "Optimizer state on the host").
    """

    data_parallel_sharding_strategy: ZeroDPStrategy | int | str = "no_shard"
    outer_dp_sharding_strategy: ZeroDPStrategy | int | str = "no_shard"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    average_in_collective: bool = False
    grad_reduce_in_fp32: bool = False
    suggested_communication_unit_size: int = DEFAULT_COMMUNICATION_UNIT_SIZE
    find_unused_parameters: bool = False
    optimizer_step_in_backward: bool = False
    offload_optimizer_state: bool = False

    def __post_init__(self) -> None:
        """Normalise the strategies; outer sharding needs inner ZeRO-3 (as in the reference)."""
        window = self.suggested_communication_unit_size
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(
                f"suggested_communication_unit_size: expected an int >= 0 (elements), "
                f"got {window!r}"
            )
        if not isinstance(self.find_unused_parameters, bool):
            raise TypeError(
                f"find_unused_parameters: expected a bool, got {self.find_unused_parameters!r}"
            )
        inner = normalize_strategy(
            self.data_parallel_sharding_strategy, "data_parallel_sharding_strategy"
        )
        if not isinstance(self.optimizer_step_in_backward, bool):
            raise TypeError(
                "optimizer_step_in_backward: expected a bool, got "
                f"{self.optimizer_step_in_backward!r}"
            )
        if self.optimizer_step_in_backward and not inner.shards_grads:
            raise ValueError(
                f"optimizer_step_in_backward=True needs data_parallel_sharding_strategy 2 / "
                f"'optim_grads' or 3 / 'optim_grads_params', got {inner.value!r}: ZeRO-0/1 "
                "reduce every gradient at the step anyway, so there is nothing to step early"
            )
        if not isinstance(self.offload_optimizer_state, bool):
            raise TypeError(
                f"offload_optimizer_state: expected a bool, got {self.offload_optimizer_state!r}"
            )
        if self.offload_optimizer_state and inner is ZeroDPStrategy.NO_SHARD:
            raise ValueError(
                "offload_optimizer_state=True needs data_parallel_sharding_strategy 1 / 'optim', "
                f"2 / 'optim_grads' or 3 / 'optim_grads_params', got {inner.value!r}: under "
                "ZeRO-0 every rank steps the whole model, so its weights double as the main "
                "weights and there is no shard to keep on the host"
            )
        outer = normalize_outer_strategy(self.outer_dp_sharding_strategy)
        if outer is ZeroDPStrategy.OPTIM and inner is not ZeroDPStrategy.OPTIM_GRADS_PARAMS:
            raise ValueError(
                f"outer_dp_sharding_strategy: 'optim' (hybrid-sharded HSDP) needs "
                f"data_parallel_sharding_strategy 3 / 'optim_grads_params', got {inner.value!r}"
            )
        self.data_parallel_sharding_strategy = inner
        self.outer_dp_sharding_strategy = outer
