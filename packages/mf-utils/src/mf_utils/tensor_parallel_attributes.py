"""The attribute protocol by which a parameter says it is tensor-parallel.

mf-tp marks the parameters it partitions; mf-fsdp reads the marks without
importing mf-tp. A marked parameter carries three attributes:

- ``tensor_model_parallel`` (bool): the tensor is partitioned across the TP group;
- ``partition_dim`` (int): the dimension it is split along (-1 when not split);
- ``partition_stride`` (int): how many interleaved blocks each rank holds.

Parameters of a TP model that are not partitioned carry
``tensor_model_parallel=False`` and are "duplicated" across TP ranks.
Transformer Engine's ``tensor_parallel_mode`` ("column", "row",
"duplicated") is read as well, so TE modules need no translation.
"""

from __future__ import annotations

import torch

__all__ = [
    "TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
    "copy_tensor_model_parallel_attributes",
    "get_mcore_tensor_parallel_partition_dim",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, bool | int] = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}

_TE_MODE_TO_DIM = {"column": 0, "row": 1}


def _check_tensor(tensor: object, argument: str, function: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{function}: {argument} must be a torch.Tensor, got {type(tensor)!r}")


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark ``tensor`` with the three protocol attributes.

    Raises:
        RuntimeError: if the tensor is already marked (marks are set once).
        ValueError: if ``stride`` is not positive.
    """
    _check_tensor(tensor, "tensor", "set_tensor_model_parallel_attributes")
    already = [name for name in TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS if hasattr(tensor, name)]
    if already:
        raise RuntimeError(
            f"set_tensor_model_parallel_attributes: tensor already has {already}; "
            "tensor-parallel attributes are set once"
        )
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(
            f"set_tensor_model_parallel_attributes: stride must be an int >= 1, got {stride!r}"
        )
    # setattr: the protocol's attributes live on tensors at run time, unknown to Tensor's type
    marks = {
        "tensor_model_parallel": bool(is_parallel),
        "partition_dim": int(dim),
        "partition_stride": stride,
    }
    for name, value in marks.items():
        setattr(tensor, name, value)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the default (not partitioned) value of every attribute it lacks."""
    _check_tensor(tensor, "tensor", "set_defaults_if_not_set_tensor_model_parallel_attributes")
    for name, default in TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, default)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy the protocol attributes that ``source_tensor`` has onto ``destination_tensor``."""
    _check_tensor(destination_tensor, "destination_tensor", "copy_tensor_model_parallel_attributes")
    _check_tensor(source_tensor, "source_tensor", "copy_tensor_model_parallel_attributes")
    for name in TENSOR_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    """Tell whether ``param`` is partitioned across the tensor-parallel group."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    return getattr(param, "tensor_parallel_mode", None) in _TE_MODE_TO_DIM


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """Tell whether ``param`` belongs to a TP model but is replicated on every TP rank."""
    if getattr(param, "tensor_parallel_mode", None) == "duplicated":
        return True
    return hasattr(param, "tensor_model_parallel") and not param.tensor_model_parallel


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> int | None:
    """Return the dimension ``param`` is partitioned along, or ``None`` when it is not."""
    if not is_mcore_tensor_model_parallel(param):
        return None
    if getattr(param, "tensor_model_parallel", False):
        # getattr: attributes set at run time, unknown to Tensor's type (as everywhere here)
        return getattr(param, "partition_dim")  # noqa: B009
    return _TE_MODE_TO_DIM[getattr(param, "tensor_parallel_mode")]  # noqa: B009
