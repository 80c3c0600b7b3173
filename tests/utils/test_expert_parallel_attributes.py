"""The expert mark: Megatron-Core's ``allreduce = False``, set and read by mf_utils."""

from __future__ import annotations

import pytest
import torch

import mf_utils


def test_mark_and_read() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    assert not mf_utils.is_expert_parallel_parameter(param)
    mf_utils.set_expert_parallel_attribute(param)
    assert param.allreduce is False
    assert mf_utils.is_expert_parallel_parameter(param)


def test_megatron_core_marks_are_read_as_they_are() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    param.allreduce = True  # Megatron-Core's dense parameters
    assert not mf_utils.is_expert_parallel_parameter(param)
    param.allreduce = False
    assert mf_utils.is_expert_parallel_parameter(param)


def test_only_tensors_are_marked() -> None:
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got <class 'list'>"):
        mf_utils.set_expert_parallel_attribute([1.0])
