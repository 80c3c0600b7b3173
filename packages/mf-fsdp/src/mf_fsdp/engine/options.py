"""Checks of the engine's options that are not parameters: dtypes policies and factors.

Each raises where the user passed the value, naming it and what is expected;
nothing here touches a process group or a tensor's storage.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from torch import nn

from mf_fsdp.config import MixedPrecisionPolicy

__all__ = ["check_engine_options", "check_gradient_factor", "unit_policies"]


def check_engine_options(mixed_precision_policy: object, gradient_scaling_factor: object) -> None:
    """Check the types (and the scaling factor's value) of two engine options.

    Raises:
        TypeError: if ``mixed_precision_policy`` is not a ``MixedPrecisionPolicy`` or
            None, or ``gradient_scaling_factor`` is not a real number or None.
        ValueError: if ``gradient_scaling_factor`` is not finite and positive.
    """
    if mixed_precision_policy is not None and not isinstance(
        mixed_precision_policy, MixedPrecisionPolicy
    ):
        raise TypeError(
            f"mixed_precision_policy: expected a MixedPrecisionPolicy or None, got "
            f"{mixed_precision_policy!r} ({type(mixed_precision_policy).__name__}); e.g. "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16) for bf16 compute"
        )
    if gradient_scaling_factor is not None:
        check_gradient_factor("gradient_scaling_factor", gradient_scaling_factor)


def check_gradient_factor(name: str, value: object) -> float:
    """``value`` as a float, if it is a finite positive real number (``name`` for the error).

    Raises:
        TypeError: if ``value`` is not a real number.
        ValueError: if it is zero, negative or not finite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}: expected a real number or None, got {value!r} ({type(value).__name__})"
        )
    factor = float(value)
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(
            f"{name}: expected a finite positive factor, got {value!r} (zero, negative or "
            "non-finite factors would erase, flip or poison every gradient)"
        )
    return factor


def unit_policies(
    module: nn.Module, policies: Mapping[nn.Module, MixedPrecisionPolicy] | None
) -> dict[int, MixedPrecisionPolicy]:
    """``unit_mixed_precision`` by the ``id`` of each unit module, each entry checked.

    Raises:
        TypeError: if it is not a mapping of submodules of ``module`` to
            ``MixedPrecisionPolicy``s.
    """
    if policies is None:
        return {}
    if not isinstance(policies, Mapping):
        raise TypeError(
            f"unit_mixed_precision: expected a mapping of unit modules to "
            f"MixedPrecisionPolicy, got {policies!r}"
        )
    inside = {id(m) for m in module.modules()}
    for unit, policy in policies.items():
        if not isinstance(unit, nn.Module) or id(unit) not in inside:
            raise TypeError(
                f"unit_mixed_precision: key {unit!r} is not a submodule of "
                f"{type(module).__name__}; expected unit modules"
            )
        check_engine_options(policy, None)
    return {id(unit): policy for unit, policy in policies.items()}
