from __future__ import annotations

import contextlib

import pytest
import torch

from mf_utils import (
    GlobalMemoryBuffer,
    default_device,
    get_global_memory_buffer,
    use_global_memory_buffer,
)


def test_same_or_smaller_request_reuses_storage() -> None:
    buffer = GlobalMemoryBuffer(device="cpu")
    first = buffer.get_tensor((4, 8), torch.float32, "scratch")
    assert first.shape == (4, 8)
    pointer = first.untyped_storage().data_ptr()
    again = buffer.get_tensor((4, 8), torch.float32, "scratch")
    smaller = buffer.get_tensor((3,), torch.float32, "scratch")
    assert again.untyped_storage().data_ptr() == pointer
    assert smaller.untyped_storage().data_ptr() == pointer
    assert len(buffer.buffer) == 1


def test_larger_request_grows_once() -> None:
    buffer = GlobalMemoryBuffer(device="cpu")
    buffer.get_tensor((2,), torch.float32, "scratch")
    big = buffer.get_tensor((10, 10), torch.float32, "scratch")
    assert big.numel() == 100
    key = ("scratch", torch.float32, torch.device("cpu"))
    assert buffer.buffer[key].numel() == 100


def test_names_and_dtypes_are_separate() -> None:
    buffer = GlobalMemoryBuffer(device="cpu")
    a = buffer.get_tensor((4,), torch.float32, "a")
    b = buffer.get_tensor((4,), torch.float32, "b")
    c = buffer.get_tensor((4,), torch.bfloat16, "a")
    ptrs = {t.untyped_storage().data_ptr() for t in (a, b, c)}
    assert len(ptrs) == 3
    assert c.dtype == torch.bfloat16


def test_mem_alloc_context_wraps_allocation_only() -> None:
    calls: list[str] = []

    @contextlib.contextmanager
    def context():
        calls.append("enter")
        yield

    buffer = GlobalMemoryBuffer(device="cpu")
    buffer.get_tensor((8,), torch.float32, "x", mem_alloc_context=context)
    buffer.get_tensor((8,), torch.float32, "x", mem_alloc_context=context)
    assert calls == ["enter"]


def test_zero_size_request() -> None:
    buffer = GlobalMemoryBuffer(device="cpu")
    assert buffer.get_tensor((0, 5), torch.float32, "empty").shape == (0, 5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_shape": (2,), "dtype": "float32", "name": "x"}, TypeError, "dtype must be"),
        ({"tensor_shape": (2,), "dtype": torch.float32, "name": 3}, TypeError, "name must be"),
        ({"tensor_shape": (-1,), "dtype": torch.float32, "name": "x"}, ValueError, "non-negative"),
    ],
)
def test_bad_input(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GlobalMemoryBuffer(device="cpu").get_tensor(**kwargs)


def test_default_buffer_is_shared_and_swappable() -> None:
    assert get_global_memory_buffer() is get_global_memory_buffer()
    mine = GlobalMemoryBuffer(device="cpu")
    with use_global_memory_buffer(mine):
        assert get_global_memory_buffer() is mine
    assert get_global_memory_buffer() is not mine
    with (
        pytest.raises(TypeError, match="expected a GlobalMemoryBuffer"),
        use_global_memory_buffer(
            object()  # type: ignore[arg-type]
        ),
    ):
        pass


def test_default_device_is_cpu_without_accelerator() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    assert default_device() == torch.device("cpu")
