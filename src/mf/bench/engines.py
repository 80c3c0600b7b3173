"""The training engines the benchmark compares, each built the same way from one model.

Every builder takes a freshly initialised model (identical on every rank)
and a recipe of optimizers, and returns the wrapped model and its
optimizers, ready for the plain loop ``loss = model(x, y); loss.backward()``,
then ``step()`` and ``zero_grad()`` of each optimizer.

Optimizer recipes (``OPTIMIZERS``): ``adam`` (torch.optim.Adam on every
parameter, the default of the published tables), and ``mf.models``'
``adamw`` and ``muon`` (Muon on the blocks' matrices, AdamW on the rest).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mf.models import OPTIMIZER_RECIPES, Block, build_optimizers

__all__ = ["ENGINES", "OPTIMIZERS", "build_engine", "make_optimizers"]

OPTIMIZERS = ("adam", *OPTIMIZER_RECIPES)

Built = tuple[nn.Module, list[torch.optim.Optimizer]]
Builder = Callable[[nn.Module, DeviceMesh | None, Callable[[nn.Module], list]], Built]


def make_optimizers(recipe: str, module: nn.Module, lr: float) -> list[torch.optim.Optimizer]:
    """The optimizers of ``recipe`` (one of ``OPTIMIZERS``) on ``module``'s parameters."""
    if recipe == "adam":
        return [torch.optim.Adam(module.parameters(), lr=lr)]
    return build_optimizers(recipe, module, lr)


def _single(model: nn.Module, mesh: DeviceMesh | None, optimizers) -> Built:
    return model, optimizers(model)


def _ddp(model: nn.Module, mesh: DeviceMesh | None, optimizers) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = (
        None if model.lm_head.weight.device.type == "cpu" else [torch.cuda.current_device()]
    )
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    return wrapped, optimizers(model)  # the module's names; the same parameters


def _fsdp2(model: nn.Module, mesh: DeviceMesh | None, optimizers) -> Built:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model, optimizers(model)


def _mf(strategy: int) -> Builder:
    def build(model: nn.Module, mesh: DeviceMesh | None, optimizers) -> Built:
        from mf_fsdp import fully_shard

        return fully_shard(
            model,
            optimizers(model),
            device_mesh=mesh,
            dp_shard_dim="dp",
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
        )

    return build


ENGINES: dict[str, Builder] = {
    "single": _single,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
    "mf-zero3": _mf(3),
    "mf-zero2": _mf(2),
    "mf-zero1": _mf(1),
    "mf-zero0": _mf(0),
}


def build_engine(
    name: str, model: nn.Module, mesh: DeviceMesh | None, lr: float, optimizer: str = "adam"
) -> Built:
    """Wrap ``model`` with engine ``name`` and build the optimizers of recipe ``optimizer``.

    Raises:
        ValueError: if ``name`` is not one of :data:`ENGINES` or ``optimizer`` not one of
            :data:`OPTIMIZERS`.
    """
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {name!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if name != "single" and not dist.is_initialized():
        raise RuntimeError(f"engine {name!r} needs torch.distributed to be initialized")
    return ENGINES[name](model, mesh, lambda module: make_optimizers(optimizer, module, lr))
