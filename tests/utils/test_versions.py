from __future__ import annotations

import importlib.metadata

import pytest
import torch

from mf_utils import get_te_version, is_te_min_version, is_torch_min_version


def test_te_absent_is_a_normal_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    get_te_version.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", missing)
    try:
        assert get_te_version() is None
        assert is_te_min_version("1.0") is False
    finally:
        get_te_version.cache_clear()


def test_te_present_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    get_te_version.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.3.0")
    try:
        assert get_te_version() == "2.3.0"
        assert is_te_min_version("2.3")
        assert is_te_min_version("2.3.0", check_equality=False) is False
        assert is_te_min_version("2.2", check_equality=False)
        assert not is_te_min_version("2.4")
    finally:
        get_te_version.cache_clear()


def test_torch_version() -> None:
    current = torch.__version__.split("+")[0]
    assert is_torch_min_version("2.0")
    assert is_torch_min_version(current)
    assert not is_torch_min_version(current, check_equality=False)
    assert not is_torch_min_version("999.0")


@pytest.mark.parametrize("function", [is_torch_min_version, is_te_min_version])
def test_version_must_be_a_string(function) -> None:
    with pytest.raises(TypeError, match="version must be a str"):
        function(2.13)
