"""torch's ``MixedPrecisionPolicy`` on mf's engine: the casts FSDP2 makes, and the engine's dtypes.

Two jobs, both reading one ``fully_shard`` call's policy:

- around the module's forward, FSDP2's ``cast_forward_inputs`` and ``output_dtype``
  (``cast_inputs`` and ``cast_output`` make the hooks ``fully_shard`` registers;
  dataclass inputs and outputs are looked into, as FSDP2 does);
- when the engine is built, torch 2.15's ``param_dtype_override_fn`` decided for
  each call's parameters (``resolve_policies``), and each resulting policy
  translated into the engine's ``MixedPrecisionPolicy`` (``engine_policy``: each
  parameter's shard keeps its own dtype, the compute dtype is ``param_dtype``,
  gradients are reduced in ``reduce_dtype`` or else in the dtype the installed
  torch's FSDP2 picks, ``default_reduce_dtype``).

Invariants: one call's parameters compute in one dtype (an override that splits
them raises naming both); a policy is only read, never changed in place (a
resolved one is a ``dataclasses.replace`` copy). This module registers no hook
itself, keeps no state between calls, and must not import the records or the
module class of ``mf_fsdp.fsdp2`` (it takes modules, parameters and policies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from mf_fsdp.config import MixedPrecisionPolicy as EngineMixedPrecision
from mf_fsdp.engine._tensor_tree import flatten

__all__ = [
    "OwnDtypePolicy",
    "cast_inputs",
    "cast_output",
    "default_reduce_dtype",
    "engine_policy",
    "own_dtypes",
    "resolve_policies",
]


def _cast_to(dtype: torch.dtype | None, tree: Any) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (unchanged when None).

    Dataclass instances are looked into, as FSDP2 does (``engine._tensor_tree``).
    """
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    leaves, rebuild = flatten(tree)
    return rebuild([cast(leaf) for leaf in leaves])


def cast_inputs(policy: MixedPrecisionPolicy) -> Callable[..., Any]:
    """FSDP2's ``cast_forward_inputs``: floating inputs in ``param_dtype``."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            return _cast_to(policy.param_dtype, (args, kwargs))
        return None

    return hook


def cast_output(policy: MixedPrecisionPolicy) -> Callable[..., Any]:
    """FSDP2's ``output_dtype``: floating outputs in that dtype."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return None if policy.output_dtype is None else _cast_to(policy.output_dtype, output)

    return hook


def own_dtypes(root: MixedPrecisionPolicy, unit: MixedPrecisionPolicy) -> bool:
    """Whether a unit computes or reduces in other dtypes than the root (its own policy)."""
    return any(
        getattr(unit, name) != getattr(root, name) for name in ("param_dtype", "reduce_dtype")
    )


def resolve_policies(
    module: nn.Module,
    root_policy: MixedPrecisionPolicy,
    units: Sequence[tuple[Sequence[nn.Module], MixedPrecisionPolicy]],
    ignored: Collection[int],
) -> tuple[MixedPrecisionPolicy, list[MixedPrecisionPolicy]]:
    """The root's and each unit's policy with ``param_dtype_override_fn`` applied.

    ``units`` holds each unit call's modules and policy; a unit's parameters are
    those of its modules, the root's are the rest of ``module``'s, as the engine
    assigns them. Parameters whose ``id`` is in ``ignored`` are not asked about.

    Returns:
        The root's resolved policy, and the units' in the order of ``units``.
    """
    named = [(n, p) for n, p in nn.Module.named_parameters(module) if id(p) not in ignored]
    taken: set[int] = set()
    resolved = []
    for modules, policy in units:
        own = {id(p) for m in modules for p in nn.Module.parameters(m)}
        taken |= own
        mine = [(name, p) for name, p in named if id(p) in own]
        resolved.append(_resolve_override(policy, mine))
    rest = [x for x in named if id(x[1]) not in taken]
    return _resolve_override(root_policy, rest), resolved


def _resolve_override(
    policy: MixedPrecisionPolicy, named: Iterable[tuple[str, nn.Parameter]]
) -> MixedPrecisionPolicy:
    """``policy`` with its ``param_dtype_override_fn`` (torch 2.15) decided for ``named``.

    The function may give each parameter None or ``param_dtype`` (compute in
    ``param_dtype``) or the parameter's own dtype (keep it), as FSDP2 allows. mf
    computes one call's parameters in one dtype, so they must all get the same.

    Raises:
        TypeError / ValueError: for an answer FSDP2 refuses too.
        NotImplementedError: if the call's parameters would compute in several dtypes.
    """
    override = getattr(policy, "param_dtype_override_fn", None)
    if override is None:
        return policy
    first: dict[torch.dtype, str] = {}  # compute dtype -> the first parameter given it
    for name, param in named:
        answer = override(param)
        if answer is not None and not isinstance(answer, torch.dtype):
            raise TypeError(
                f"fully_shard: mp_policy.param_dtype_override_fn returned {answer!r} for "
                f"{name}; expected a torch.dtype or None"
            )
        if answer not in (None, policy.param_dtype, param.dtype):
            raise ValueError(
                f"fully_shard: mp_policy.param_dtype_override_fn returned {answer} for {name} "
                f"({param.dtype}); expected None, param_dtype={policy.param_dtype} or "
                f"{param.dtype}"
            )
        compute = answer or policy.param_dtype or param.dtype
        first.setdefault(compute, name)
    if len(first) > 1:
        (a, a_name), (b, b_name) = list(first.items())[:2]
        raise NotImplementedError(
            f"fully_shard: mp_policy.param_dtype_override_fn gives {a_name} {a} but {b_name} "
            f"{b} in one fully_shard call; mf_fsdp.fsdp2 computes each call's parameters in "
            "one dtype: call fully_shard separately on the modules that keep their dtype"
        )
    call_dtype = next(iter(first), policy.param_dtype)
    return dataclasses.replace(policy, param_dtype=call_dtype, param_dtype_override_fn=None)


@dataclasses.dataclass(frozen=True, slots=True)
class OwnDtypePolicy(EngineMixedPrecision):
    """The engine's dtypes as FSDP2 picks them: each parameter keeps its own dtype.

    FSDP2 shards, steps and reduces each parameter in its own dtype (a frozen bf16
    base beside fp32 adapters, an fp8 weight beside fp32 ones); only the compute
    dtype is the policy's ``param_dtype``. The engine resolves a bucket's dtypes
    from its parameters' dtype (buckets are split by dtype, ``buckets/units.py``),
    so ``resolve`` gives the main weights and gradients that dtype, and the
    reduction ``grad_comm_dtype`` or else what FSDP2 reduces that dtype in.
    ``main_params_dtype`` is the model's dtype where it has one, else None (read
    by the all-gather extension's check, ``engine/assemble.py``).
    """

    def resolve(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """Return (compute, main params, main grads, comm) dtypes for a parameter dtype."""
        comm = self.grad_comm_dtype or default_reduce_dtype(self.param_dtype, model_dtype)
        return self.param_dtype or model_dtype, model_dtype, model_dtype, comm


def engine_policy(module: nn.Module, policy: MixedPrecisionPolicy) -> EngineMixedPrecision:
    """The engine's dtypes for torch's policy (each parameter's shard keeps its own dtype).

    Raises:
        NotImplementedError: for a trainable one-byte float (fp8) parameter: its
            gradients would be reduced in fp8, which the collectives do not serve
            (frozen fp8 parameters are gathered as their bytes).
    """
    for name, param in nn.Module.named_parameters(module):
        if param.requires_grad and param.is_floating_point() and param.element_size() == 1:
            raise NotImplementedError(
                f"fully_shard: parameter {name} is {param.dtype} and requires grad; "
                "mf_fsdp.fsdp2 reduces gradients in the parameter's own dtype and cannot "
                "reduce one-byte floats: freeze it (requires_grad=False) or keep it in "
                "bf16/fp32"
            )
    dtypes = {p.dtype for p in nn.Module.parameters(module) if p.is_floating_point()}
    return OwnDtypePolicy(
        param_dtype=policy.param_dtype,
        main_params_dtype=dtypes.pop() if len(dtypes) == 1 else None,
        grad_comm_dtype=policy.reduce_dtype,
    )


def default_reduce_dtype(param_dtype: torch.dtype | None, own: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 of the installed torch reduces in when ``reduce_dtype`` is None.

    torch up to at least 2.11 reduces the gradients in the dtype they were computed
    in, ``param_dtype``. torch 2.15 (pytorch/pytorch#197203, "Separate sharded and
    unsharded gradient dtypes") reduces them in the parameters' own dtype, so bf16
    compute over fp32 weights reduces in fp32. mf follows the installed torch,
    recognised by the property that change added (``FSDPParam.unsharded_grad_dtype``).
    """
    if param_dtype is None or _REDUCES_IN_OWN_DTYPE:
        return own
    return param_dtype


def _reduces_in_own_dtype() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "unsharded_grad_dtype")


_REDUCES_IN_OWN_DTYPE = _reduces_in_own_dtype()
