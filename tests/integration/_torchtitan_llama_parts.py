"""What the torchtitan Llama parity tests on meshes and pipelines share.

Both build torchtitan's Llama 3 debugmodel cut to a few blocks (SDPA attention
for the CPU, ``test_torchtitan_llama``'s config) with torchtitan's own tensor
parallel plan, run torch's FSDP2 and mf through torchtitan's code in the same
ranks, and compare with one process. ``pipelined`` is torchtitan's pipeline of
that model, which ``benchmarks/pp_schedule.py`` measures too. Importing this
module imports torchtitan: a test module imports it inside the guard that skips
where torchtitan does not import.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
import torchtitan.distributed.fsdp as titan_fsdp
import torchtitan.distributed.parallel_dims as titan_dims
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from mf_fsdp import fsdp2
from tests.integration.test_torchtitan_llama import _config, _initialised

__all__ = [
    "ENGINES",
    "PipelineCase",
    "force_sum",
    "full",
    "model_config",
    "one_process",
    "pipelined",
]

ENGINES = (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard))
"""The two engines a parity run compares, torch's first."""


def model_config(layers: int):
    """The debugmodel's first ``layers`` blocks with torchtitan's TP plan (sequence parallel)."""
    config = _config()
    config = dataclasses.replace(config, layers=config.layers[:layers])
    set_llama3_sharding_config(config, enable_sp=True)
    return config


def one_process(layers: int) -> nn.Module:
    """The plain model with torchtitan's init: one process's initial weights."""
    with torch.device("meta"):
        model = model_config(layers).build()
    return _initialised(model)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (maybe sharded) tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def force_sum(model: nn.Module, shard) -> None:
    """torch's FSDP2 asks gloo for PREMUL_SUM, which it lacks: sum, then divide."""
    if shard is torch_fully_shard:
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_force_sum_reduction_for_comms(True)


@dataclasses.dataclass(frozen=True)
class PipelineCase:
    """One pipelined configuration: the degrees, torch's schedule, the model and batch sizes.

    Each dp rank's batch is ``local_batch`` sequences of ``seq`` tokens, one
    micro-batch per sequence.
    """

    pp: int
    dp_shard: int
    tp: int
    schedule: str
    mean: bool = False  # FSDP's mean over the dp ranks instead of torchtitan's division off
    backend: str = "partial_dtensor"  # torchtitan's spmd_backend
    layers: int = 4
    local_batch: int = 4
    seq: int = 16

    @property
    def world(self) -> int:
        return self.pp * self.dp_shard * self.tp

    @property
    def tokens(self) -> float:
        """The global batch's tokens: torchtitan's loss is each sum over them."""
        return float(self.local_batch * self.seq * self.dp_shard)

    @property
    def loss_tokens(self) -> float:
        """What a dp rank's loss sum is divided by: the global batch's tokens, or its own."""
        return self.tokens / self.dp_shard if self.mean else self.tokens


def pipelined(shard, case: PipelineCase) -> tuple[ParallelDims, Any, list[nn.Module], bool, bool]:
    """torchtitan's mesh, ``pipeline_llm`` and per-part ``parallelize_llama`` with ``shard``.

    Returns torchtitan's dims, torch's schedule, this rank's model parts (each
    its own root, initialised as torchtitan's trainer does) and whether this rank
    holds the first and the last stage.
    """
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=case.dp_shard,
        cp=1,
        tp=case.tp,
        pp=case.pp,
        ep=1,
        world_size=case.world,
        spmd_backend=case.backend,
    )
    parallelism = ParallelismConfig(
        spmd_backend=case.backend,
        pipeline_parallel_degree=case.pp,
        pipeline_parallel_schedule=case.schedule,
        pipeline_parallel_microbatch_size=1,
    )

    def loss_fn(pred, labels, **_):
        if case.backend == "full_dtensor":  # torchtitan's sum, Partial() over the dp dims
            return cross_entropy_loss(pred, labels) / case.loss_tokens, None
        loss = F.cross_entropy(full(pred).flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return loss / case.loss_tokens, None

    with torch.device("meta"):
        model = model_config(case.layers).build()
    with (
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
        # FSDP's own mean: torchtitan's call turning it off does nothing
        mock.patch.object(titan_fsdp, "disable_fsdp_gradient_division", id)
        if case.mean
        else contextlib.nullcontext(),
    ):
        dims.build_mesh()
        schedule, parts, has_first, has_last = pipeline_llm(
            model,
            parallel_dims=dims,
            training=TrainingConfig(
                mixed_precision_param="float32", local_batch_size=case.local_batch
            ),
            parallelism=parallelism,
            compile_config=CompileConfig(enable=False, components=["model"]),
            ac_config=None,
            dump_folder="unused",
            device=torch.device("cpu"),
            model_config=model_config(case.layers),
            parallelize_fn=parallelize_llama,
            loss_fn=loss_fn,
        )
    for part in parts:  # torchtitan's trainer: to_empty and init_weights per part
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=torch.device("cpu"))
        force_sum(part, shard)
    return dims, schedule, parts, has_first, has_last
