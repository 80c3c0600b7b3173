"""The engine's buffer work run outside any ``torch.func`` transform the model is called under.

A model sharded by mf may be called inside ``torch.func.jvp`` (or ``vmap``): its
forward hooks then run under the transform's interpreters. What they do to the
engine's own buffers (casting the main weights into the compute-dtype shard a
gather reads, writing the stepped weights in, filling the gathered bucket) is no
part of the transformed function, yet functorch refuses an in-place op on a tensor
it did not create there ("would mutate a captured Tensor"). ``outside_transforms``
runs such a method with the interpreter stack cleared, as a call outside the
transform would; the parameters the forward reads are views of those buffers,
lifted by the transform as any captured tensor is.

Invariant: only methods that touch the engine's buffers and return no tensor the
transformed function uses are wrapped; a wrapped method costs one look at the
interpreter stack when no transform is active.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

__all__ = ["outside_transforms"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def outside_transforms(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method``, run with no ``torch.func`` transform active (see the module docstring)."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch._C._functorch.peek_interpreter_stack() is None:
            return method(*args, **kwargs)
        with temporarily_clear_interpreter_stack():
            return method(*args, **kwargs)

    return run
