"""Float8 training of mf's GPT with torchao: which linears convert, and whether a device can.

torchao's float8 training (tensorwise dynamic scaling) replaces an ``nn.Linear`` by a
``Float8Linear``: its matmuls cast input, weight and output gradient to FP8 with a
scale from each tensor's absolute maximum, while the weight itself stays in high
precision (mf's fp32 main weight, gathered in bf16 or FP8). torchao is the optional
extra ``mf[float8]``; this module imports it only when a model is converted.

Which linears convert (``converts_to_float8``): every ``nn.Linear`` of the blocks whose
two dimensions divide by 16 (``torch._scaled_mm`` needs that); the LM head stays in
bf16 (it is tied to the token embedding, and its logits feed the loss directly), and
so do the embeddings and norms, which are not linears.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "FSDP_FLOAT8_ALL_GATHER",
    "TORCHAO_REQUIREMENT",
    "convert_gpt_to_float8",
    "converts_to_float8",
    "float8_unavailable",
    "refresh_float8_scales",
]

TORCHAO_REQUIREMENT = "torchao>=0.18"
"""The torchao the extra ``mf[float8]`` installs (0.18 is built against torch 2.11, our floor)."""

FSDP_FLOAT8_ALL_GATHER = True
"""The one switch for FP8 weight gathering under ZeRO-3 (``enable_fsdp_float8_all_gather``).

True makes each converted weight a torchao tensor subclass that an FSDP engine gathers
through FSDP2's extension protocol (``fsdp_pre_all_gather``), in 1 byte per element
plus a scale, instead of the bf16 copy of the fp32 main weight. mf-fsdp carries that
protocol (``mf_fsdp.buckets.extension``) under ZeRO-2/3; under ZeRO-0/1, where every
rank keeps its weights whole, float8 runs in the matmuls only.
"""

_FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 matmuls (Ada sm_89, Hopper sm_90)."""

_FP8_ALIGNMENT = 16
"""``torch._scaled_mm`` needs both dimensions of each operand divisible by this."""


def float8_unavailable(device: torch.device) -> str | None:
    """Why float8 training cannot run on ``device``, in one line; None when it can.

    Checks that torchao is installed, that a CUDA GPU has FP8 matmuls (sm_89 or newer),
    and that ``torch._scaled_mm`` runs on the device (on the CPU it does from torch 2.11).
    """
    if importlib.util.find_spec("torchao") is None:
        return (
            f"float8 training needs {TORCHAO_REQUIREMENT}, which is not installed "
            "(install the extra: pip install 'mf[float8]')"
        )
    device = torch.device(device)
    if device.type == "cuda" and torch.version.cuda is not None:
        capability = torch.cuda.get_device_capability(device)
        if capability < _FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (
                f"the GPU {name} (sm_{capability[0]}{capability[1]}) has no FP8 matmul; "
                "float8 training needs sm_89 or newer (Ada, Hopper, Blackwell)"
            )
    return _scaled_mm_fails(device.type, torch.__version__)


@functools.cache
def _scaled_mm_fails(device_type: str, torch_version: str) -> str | None:
    """Run one tiny ``torch._scaled_mm`` on the device type; its failure in one line, or None."""
    fp8 = torch.zeros(_FP8_ALIGNMENT, _FP8_ALIGNMENT, device=device_type).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device_type)
    try:
        torch._scaled_mm(fp8, fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        cause = str(error).strip().splitlines()[0]
        return f"torch {torch_version} has no FP8 matmul on {device_type} ({cause})"
    return None


def _torchao_float8() -> tuple[type, Callable[..., nn.Module]]:
    """Import torchao's ``Float8LinearConfig`` and ``convert_to_float8_training`` quietly.

    On torch 2.15, importing torchao 0.18 logs a deprecation warning from torch's
    pytree registry on every rank (torchao registers an Enum torch now handles
    itself); it says nothing to an mf user, so that logger is raised past it.
    """
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        pytree_log.setLevel(level)
    return Float8LinearConfig, convert_to_float8_training


def converts_to_float8(module: nn.Module, fqn: str) -> bool:
    """Whether the submodule ``fqn`` of a GPT gets float8 matmuls (see the module docstring)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % _FP8_ALIGNMENT == 0 and module.out_features % _FP8_ALIGNMENT == 0


def convert_gpt_to_float8(
    model: nn.Module,
    *,
    fsdp_float8_all_gather: bool,
    module_filter: Callable[[nn.Module, str], bool] = converts_to_float8,
) -> list[str]:
    """Swap the GPT's eligible linears for torchao's ``Float8Linear`` in place; return their FQNs.

    Tensorwise dynamic scaling (torchao's default recipe). Parameter names and values
    are unchanged, so state dicts and exports stay those of the plain GPT.

    Args:
        model: a plain ``GPT`` (not yet sharded), or any model whose linears
            ``module_filter`` picks (a transformers model on the meta device too:
            the weights are wrapped, not read).
        fsdp_float8_all_gather: make the weights torchao's FP8-gathering subclass
            (``FSDP_FLOAT8_ALL_GATHER`` says whether mf-fsdp carries it).
        module_filter: ``(module, fqn) -> bool``, the linears to convert
            (default ``converts_to_float8``, the GPT's rule); each must also pass
            ``converts_to_float8``'s alignment.

    Raises:
        ValueError: if no linear of ``model`` can take float8 matmuls.
    """
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()

    def eligible(module: nn.Module, fqn: str) -> bool:
        return converts_to_float8(module, fqn) and module_filter(module, fqn)

    converted = [fqn for fqn, module in model.named_modules() if eligible(module, fqn)]
    if not converted:
        raise ValueError(
            f"convert_gpt_to_float8: no linear of the {type(model).__name__} has both "
            f"dimensions divisible by {_FP8_ALIGNMENT}; float8 matmuls need that"
        )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    convert_to_float8_training(model, module_filter_fn=eligible, config=config)
    return converted


def refresh_float8_scales(model: nn.Module) -> None:
    """Compute every FP8-gathering weight's scale in one all-reduce; call after the step.

    torchao's ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan calls it:
    without it each weight all-reduces its own amax when it is gathered. The scale
    is the same either way (the amax over the whole weight), so losses do not
    change. A no-op for a model with no such weight (ZeRO-0/1, or not converted).
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
