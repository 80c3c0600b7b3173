from __future__ import annotations

import pytest
import torch

from mf_utils import (
    copy_tensor_model_parallel_attributes,
    get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(4, 2))


def test_set_and_read() -> None:
    p = _param()
    set_tensor_model_parallel_attributes(p, True, 0, 1)
    assert is_mcore_tensor_model_parallel(p)
    assert not is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) == 0


def test_set_twice_is_an_error() -> None:
    p = _param()
    set_tensor_model_parallel_attributes(p, True, 1, 1)
    with pytest.raises(RuntimeError, match="already has"):
        set_tensor_model_parallel_attributes(p, True, 0, 1)


def test_bad_stride() -> None:
    with pytest.raises(ValueError, match="stride must be an int >= 1, got 0"):
        set_tensor_model_parallel_attributes(_param(), True, 0, 0)


def test_defaults_mark_duplicated() -> None:
    p = _param()
    assert not is_mcore_tensor_parallel_duplicated(p)  # unmarked: not part of a TP model
    set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (False, -1, 1)
    assert is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) is None


def test_defaults_keep_existing() -> None:
    p = _param()
    set_tensor_model_parallel_attributes(p, True, 1, 3)
    set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 1, 3)


def test_copy() -> None:
    source, destination = _param(), _param()
    set_tensor_model_parallel_attributes(source, True, 1, 2)
    copy_tensor_model_parallel_attributes(destination, source)
    assert (destination.tensor_model_parallel, destination.partition_dim) == (True, 1)
    assert destination.partition_stride == 2
    with pytest.raises(TypeError, match="source_tensor must be a torch.Tensor"):
        copy_tensor_model_parallel_attributes(destination, [1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "parallel", "duplicated", "dim"),
    [("column", True, False, 0), ("row", True, False, 1), ("duplicated", False, True, None)],
)
def test_transformer_engine_mode(mode: str, parallel: bool, duplicated: bool, dim: int) -> None:
    p = _param()
    p.tensor_parallel_mode = mode
    assert is_mcore_tensor_model_parallel(p) is parallel
    assert is_mcore_tensor_parallel_duplicated(p) is duplicated
    assert get_mcore_tensor_parallel_partition_dim(p) == dim
