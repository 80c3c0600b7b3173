"""The training engines the benchmark compares, each built the same way from one model.

Every builder takes a freshly initialised model (identical on every rank)
and returns the wrapped model and its optimizer, ready for the plain loop
``loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mf.models import Block

__all__ = ["ENGINES", "build_engine"]

Built = tuple[nn.Module, torch.optim.Optimizer]


def _adam(params: object, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)  # type: ignore[arg-type]


def _single(model: nn.Module, mesh: DeviceMesh | None, lr: float) -> Built:
    return model, _adam(model.parameters(), lr)


def _ddp(model: nn.Module, mesh: DeviceMesh | None, lr: float) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = (
        None if model.lm_head.weight.device.type == "cpu" else [torch.cuda.current_device()]
    )
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    return wrapped, _adam(wrapped.parameters(), lr)


def _fsdp2(model: nn.Module, mesh: DeviceMesh | None, lr: float) -> Built:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model, _adam(model.parameters(), lr)


def _mf(strategy: int) -> Callable[[nn.Module, DeviceMesh | None, float], Built]:
    def build(model: nn.Module, mesh: DeviceMesh | None, lr: float) -> Built:
        from mf_fsdp import fully_shard

        optimizer = _adam(model.parameters(), lr)
        wrapped, optimizer = fully_shard(
            model,
            optimizer,
            device_mesh=mesh,
            dp_shard_dim="dp",
            fsdp_unit_modules=[Block],
            zero_dp_strategy=strategy,
        )
        return wrapped, optimizer

    return build


ENGINES: dict[str, Callable[[nn.Module, DeviceMesh | None, float], Built]] = {
    "single": _single,
    "ddp": _ddp,
    "fsdp2": _fsdp2,
    "mf-zero3": _mf(3),
    "mf-zero2": _mf(2),
    "mf-zero1": _mf(1),
    "mf-zero0": _mf(0),
}


def build_engine(name: str, model: nn.Module, mesh: DeviceMesh | None, lr: float) -> Built:
    """Wrap ``model`` with engine ``name``.

    Raises:
        ValueError: if ``name`` is not one of :data:`ENGINES`.
    """
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {name!r}")
    if name != "single" and not dist.is_initialized():
        raise RuntimeError(f"engine {name!r} needs torch.distributed to be initialized")
    return ENGINES[name](model, mesh, lr)
