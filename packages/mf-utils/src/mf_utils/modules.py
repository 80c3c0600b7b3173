"""Helpers about ``torch.nn.Module`` trees and callables."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["create_updated_function_signature", "is_submodule"]


def is_submodule(
    module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True
) -> bool:
    """Tell whether ``module`` sits in the tree of ``parent_module``.

    With ``strict=True`` a module is not its own submodule.

    Raises:
        TypeError: if either argument is not an ``nn.Module``.
    """
    for argument, value in (("module", module), ("parent_module", parent_module)):
        if not isinstance(value, torch.nn.Module):
            raise TypeError(f"is_submodule: {argument} must be an nn.Module, got {type(value)!r}")
    if module is parent_module:
        return not strict
    return any(candidate is module for candidate in parent_module.modules())


def create_updated_function_signature(
    original_function: Callable[..., Any], **extended_kwargs: Any
) -> Callable[..., Any]:
    """Return a wrapper of ``original_function`` whose signature gains keyword-only parameters.

    Each ``name=default`` in ``extended_kwargs`` becomes a keyword-only
    parameter with that default, so that code that inspects the signature
    (argument validators, ``forward`` patching) sees it. Calls are checked
    against the new signature; the extra arguments reach the original only
    when it takes ``**kwargs``, otherwise they are dropped.

    Raises:
        TypeError: if ``original_function`` is not callable.
        ValueError: if an extended name already names a parameter of the original.
    """
    if not callable(original_function):
        raise TypeError(
            "create_updated_function_signature: original_function must be callable, "
            f"got {original_function!r}"
        )
    signature = inspect.signature(original_function)
    parameters = list(signature.parameters.values())
    clashes = sorted(set(extended_kwargs) & set(signature.parameters))
    if clashes:
        raise ValueError(
            "create_updated_function_signature: extended_kwargs "
            f"{clashes} already name parameters of {original_function!r}"
        )
    var_keyword = [p for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
    head = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in extended_kwargs.items()
    ]
    new_signature = signature.replace(parameters=head + added + var_keyword)
    forwards_extras = bool(var_keyword)

    @functools.wraps(original_function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        new_signature.bind(*args, **kwargs)
        if not forwards_extras:
            kwargs = {k: v for k, v in kwargs.items() if k not in extended_kwargs}
        return original_function(*args, **kwargs)

    wrapper.__signature__ = new_signature  # type: ignore[attr-defined]
    return wrapper
