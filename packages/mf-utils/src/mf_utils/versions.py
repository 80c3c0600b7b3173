"""Cached version checks for torch and the optional Transformer Engine.

Transformer Engine is never required by mf: its absence is a normal answer
("not installed"), never an exception.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch
from torch.torch_version import TorchVersion

__all__ = ["get_te_version", "is_te_min_version", "is_torch_min_version"]

_TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine", "transformer-engine-torch")


@functools.cache
def get_te_version() -> TorchVersion | None:
    """Return the installed Transformer Engine version, or ``None`` when it is absent."""
    for distribution in _TE_DISTRIBUTIONS:
        try:
            return TorchVersion(importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _check_version(installed: TorchVersion, version: str, check_equality: bool) -> bool:
    if not isinstance(version, str):
        raise TypeError(f"version must be a str such as '2.13', got {version!r}")
    return installed >= version if check_equality else installed > version


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Tell whether Transformer Engine is installed at ``version`` or newer.

    With ``check_equality=False`` the installed version must be strictly newer.
    Returns False when TE is not installed.
    """
    installed = get_te_version()
    if installed is None:
        if not isinstance(version, str):
            raise TypeError(f"version must be a str such as '2.13', got {version!r}")
        return False
    return _check_version(installed, version, check_equality)


@functools.cache
def _torch_version() -> TorchVersion:
    return TorchVersion(torch.__version__.split("+")[0])


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Tell whether the running torch is at ``version`` or newer (strictly newer without equality).

    Local build tags such as ``+cu130`` are ignored.
    """
    return _check_version(_torch_version(), version, check_equality)
