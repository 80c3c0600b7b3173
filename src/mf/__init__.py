"""mf: the meta-package that assembles the five mf packages.

Each member is re-exported as a submodule alias (``mf.utils``, ``mf.rng``,
``mf.tp``, ``mf.dtensor``, ``mf.fsdp``); the command-line entry points live
in :mod:`mf.cli`.
"""

from __future__ import annotations

import importlib.metadata

import mf_dtensor as dtensor
import mf_fsdp as fsdp
import mf_rng as rng
import mf_tp as tp
import mf_utils as utils

__all__ = ["MEMBERS", "dtensor", "fsdp", "rng", "tp", "utils", "versions"]

MEMBERS = ("mf-utils", "mf-rng", "mf-tp", "mf-dtensor", "mf-fsdp")


def versions() -> dict[str, str]:
    """Return the installed version of mf and of each member distribution."""
    return {name: importlib.metadata.version(name) for name in ("mf", *MEMBERS)}
