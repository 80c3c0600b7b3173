"""The training engines the benchmark compares, each built the same way from one model.

Every builder takes a freshly initialised model (identical on every rank)
and a recipe of optimizers, and returns the wrapped model and its
optimizers, ready for the plain loop ``loss = model(x, y); loss.backward()``,
then ``step()`` and ``zero_grad()`` of each optimizer.

``plain`` is the model itself on every rank, no wrapper and no communication
(each rank trains its own copy): the host-cost baseline. ``fsdp2`` is PyTorch's
FSDP2 and ``mf-fsdp2`` the same calls through ``mf_fsdp.fsdp2`` (FSDP2's
interface on mf's engine); ``mf-zeroN`` is ``mf_fsdp.fully_shard`` with ZeRO
strategy N, ``mf-zeroN-bwd-step`` the same with ``optimizer_step_in_backward``
(each bucket's step inside the backward, its grads freed at once), and
``mf-zero3-offload`` with ``offload_optimizer_state`` (main weights, grads and
optimizer state on the host), beside ``fsdp2-offload`` (FSDP2's
``CPUOffloadPolicy``). With ``bf16`` the FSDP engines compute in bf16 through
their mixed-precision policies (fp32 main weights and gradient reduction);
engines without one (``AUTOCAST``) run their forward under ``torch.autocast``,
as plain PyTorch users do. ``fp8`` is ``bf16`` with the GPT's block linears
converted to torchao's float8 first (``mf.models.float8``); which engines gather
those weights in FP8 is ``gathers_float8``'s answer.

Optimizer recipes (``OPTIMIZERS``): ``adam`` (torch.optim.Adam on every
parameter, the default of the published tables), and ``mf.models``'
``adamw`` and ``muon`` (Muon on the blocks' matrices, AdamW on the rest), and
``adamw-fused`` (``adamw`` with ``fused=True``: torch's fused kernels for every
engine, which mf picks on CUDA where the choice is left to torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mf.models import OPTIMIZER_RECIPES, Block, build_optimizers
from mf.models.float8 import FSDP_FLOAT8_ALL_GATHER

__all__ = [
    "AUTOCAST",
    "ENGINES",
    "OPTIMIZERS",
    "build_engine",
    "gathers_float8",
    "make_optimizers",
]

OPTIMIZERS = ("adam", *OPTIMIZER_RECIPES, "adamw-fused")

AUTOCAST = frozenset({"single", "plain", "ddp"})
"""Engines with no mixed-precision policy of their own: bf16 runs them under autocast."""

Built = tuple[nn.Module, list[torch.optim.Optimizer]]
Builder = Callable[[nn.Module, DeviceMesh | None, Callable[[nn.Module], list], bool], Built]


def make_optimizers(recipe: str, module: nn.Module, lr: float) -> list[torch.optim.Optimizer]:
    """The optimizers of ``recipe`` (one of ``OPTIMIZERS``) on ``module``'s parameters."""
    if recipe == "adam":
        return [torch.optim.Adam(module.parameters(), lr=lr)]
    if recipe == "adamw-fused":  # what mf steps AdamW with on CUDA, asked of torch by name
        return [torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.1, fused=True)]
    return build_optimizers(recipe, module, lr)


def _single(model: nn.Module, mesh: DeviceMesh | None, optimizers, bf16: bool) -> Built:
    return model, optimizers(model)


def _ddp(model: nn.Module, mesh: DeviceMesh | None, optimizers, bf16: bool) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    on_cpu = model.get_parameter("lm_head.weight").device.type == "cpu"
    device_ids = None if on_cpu else [torch.cuda.current_device()]
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    return wrapped, optimizers(model)  # the module's names; the same parameters


def _fsdp2_api(front_end: str, offload: bool = False) -> Builder:
    """FSDP2's calls (blocks, then the root) through ``front_end``'s ``fully_shard``.

    ``"torch"``: PyTorch's FSDP2; ``"mf"``: ``mf_fsdp.fsdp2``, FSDP2's interface on
    mf's engine, so the two differ only in what runs below the same calls.
    ``offload``: with ``CPUOffloadPolicy`` (pinned on CUDA).
    """

    def build(model: nn.Module, mesh: DeviceMesh | None, optimizers, bf16: bool) -> Built:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        # The two front ends' fully_shard, called the same way (their types differ).
        fully_shard: Callable[..., object]
        if front_end == "mf":
            from mf_fsdp.fsdp2 import fully_shard as mf_fully_shard

            fully_shard = mf_fully_shard
        else:
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            fully_shard = torch_fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        pinned = mesh is not None and mesh.device_type == "cuda"
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": True,
            "mp_policy": policy,
            "offload_policy": CPUOffloadPolicy(pin_memory=pinned) if offload else OffloadPolicy(),
        }
        # cast: the bench's models are GPTs, whose blocks are an nn.ModuleList
        for block in cast(nn.ModuleList, model.blocks):
            fully_shard(block, **options)
        fully_shard(model, **options)
        return model, optimizers(model)

    return build


def _mf(
    strategy: int,
    *,
    optimizer_step_in_backward: bool = False,
    offload_optimizer_state: bool = False,
) -> Builder:
    """``mf_fsdp.fully_shard`` with ZeRO ``strategy`` and those two options (its defaults: off)."""

    def build(model: nn.Module, mesh: DeviceMesh | None, optimizers, bf16: bool) -> Built:
        from mf_fsdp import MixedPrecisionPolicy, fully_shard

        wrapped, sharded_optimizers = fully_shard(
            model,
            optimizers(model),
            device_mesh=mesh,
            dp_shard_dim="dp",
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
            mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            if bf16
            else None,
            optimizer_step_in_backward=optimizer_step_in_backward,
            offload_optimizer_state=offload_optimizer_state,
        )
        assert isinstance(sharded_optimizers, list)  # given a list, fully_shard returns it
        return wrapped, sharded_optimizers

    return build


ENGINES: dict[str, Builder] = {
    "single": _single,
    "plain": _single,
    "ddp": _ddp,
    "fsdp2": _fsdp2_api("torch"),
    "mf-fsdp2": _fsdp2_api("mf"),
    "fsdp2-offload": _fsdp2_api("torch", offload=True),
    "mf-zero3": _mf(3),
    "mf-zero2": _mf(2),
    "mf-zero1": _mf(1),
    "mf-zero0": _mf(0),
    "mf-zero3-bwd-step": _mf(3, optimizer_step_in_backward=True),
    "mf-zero2-bwd-step": _mf(2, optimizer_step_in_backward=True),
    "mf-zero3-offload": _mf(3, offload_optimizer_state=True),
    "mf-zero3-offload-bwd-step": _mf(
        3, offload_optimizer_state=True, optimizer_step_in_backward=True
    ),
}


def gathers_float8(name: str, device_type: str) -> bool:
    """Whether engine ``name`` gathers float8 weights in FP8 (1 byte per element plus a scale).

    torch's FSDP2 does on CUDA (NCCL); on gloo it cannot (gloo has no float8 dtypes),
    so there its float8 weights gather in bf16. mf's ZeRO-3 engines do when
    ``FSDP_FLOAT8_ALL_GATHER`` says mf-fsdp carries the weights' protocol, except
    with the optimizer state on the host (the extension keeps its shard on the
    device). Engines that gather no weights never do.
    """
    if name in ("fsdp2", "fsdp2-offload"):
        return device_type == "cuda"
    zero3 = name == "mf-fsdp2" or (name.startswith("mf-zero3") and "offload" not in name)
    return FSDP_FLOAT8_ALL_GATHER and zero3


def build_engine(
    name: str,
    model: nn.Module,
    mesh: DeviceMesh | None,
    lr: float,
    optimizer: str = "adam",
    bf16: bool = False,
) -> Built:
    """Wrap ``model`` with engine ``name`` and build the optimizers of recipe ``optimizer``.

    ``bf16``: compute in bf16 (see the module docstring).

    Raises:
        ValueError: if ``name`` is not one of :data:`ENGINES` or ``optimizer`` not one of
            :data:`OPTIMIZERS`.
    """
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {name!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if name not in AUTOCAST and not dist.is_initialized():
        raise RuntimeError(f"engine {name!r} needs torch.distributed to be initialized")
    return ENGINES[name](model, mesh, lambda module: make_optimizers(optimizer, module, lr), bf16)
