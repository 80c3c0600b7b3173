from __future__ import annotations

import inspect

import pytest
import torch

from mf_utils import create_updated_function_signature, is_submodule


def test_is_submodule() -> None:
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(torch.nn.Sequential(inner))
    assert is_submodule(inner, outer)
    assert not is_submodule(outer, inner)
    assert not is_submodule(outer, outer)
    assert is_submodule(outer, outer, strict=False)
    assert not is_submodule(torch.nn.Linear(2, 2), outer)


def test_is_submodule_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match="parent_module must be an nn.Module"):
        is_submodule(torch.nn.Linear(1, 1), "model")  # type: ignore[arg-type]


def test_extended_signature_without_var_keyword() -> None:
    def forward(x, scale=2):
        return x * scale

    patched = create_updated_function_signature(forward, extra=None, flag=True)
    params = inspect.signature(patched).parameters
    assert list(params) == ["x", "scale", "extra", "flag"]
    assert params["flag"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["flag"].default is True
    assert patched(3, extra="ignored") == 6
    with pytest.raises(TypeError):
        patched(3, unknown=1)


def test_extended_signature_forwards_to_var_keyword() -> None:
    def forward(x, **kwargs):
        return x, kwargs

    patched = create_updated_function_signature(forward, extra=5)
    assert list(inspect.signature(patched).parameters) == ["x", "extra", "kwargs"]
    assert patched(1, extra=7) == (1, {"extra": 7})
    assert patched.__name__ == "forward"


def test_extended_signature_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\['x'\] already name parameters"):
        create_updated_function_signature(lambda x: x, x=1)
    with pytest.raises(TypeError, match="original_function must be callable"):
        create_updated_function_signature(3)  # type: ignore[arg-type]
