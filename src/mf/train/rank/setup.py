"""Setting up an ``mf-train`` rank: its process group and mesh, the model, its optimizers.

Every rank builds the same model from the seed, converts what ``--precision``
asks, and shards it with mf-fsdp over the mesh ``--tp``, ``--dp-outer``, ``--cp``
``--ep`` and ``--etp`` describe.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mf.models import (
    MODEL_PRESETS,
    Block,
    GPTTensorParallel,
    MoEBlock,
    MoEGPTConfig,
    MoEGPTTensorParallel,
    TensorParallelBlock,
    build_optimizers,
    plain_model,
)
from mf.models.float8 import (
    FSDP_FLOAT8_ALL_GATHER,
    convert_gpt_to_float8,
)
from mf.train.adapters.run_module import folder_module
from mf.train.run.options import TrainOptions, local_cpu_cores
from mf.train.run.stopping import RunStoppedError, join
from mf.train.sources.folder_weights import load_folder_weights
from mf.train.sources.model_folder import PREFIX, ModelFolder, folder_of, unit_classes

__all__ = [
    "bind_optimizers",
    "build",
    "dp_coordinates",
    "load_folder_model",
    "setup",
    "shard_module",
    "train_mesh",
]


def setup(options: TrainOptions) -> tuple[torch.device, DeviceMesh]:
    """Pick the device, join the process group (if the caller has not) and build the mesh."""
    if options.use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", options.nproc))
        torch.set_num_threads(max(1, local_cpu_cores() // local_ranks))
    if not dist.is_initialized():
        join(options)
    _check_same_settings(options)
    world = dist.get_world_size()
    if world != options.nproc:
        raise ValueError(f"--nproc says {options.nproc} processes but the launcher started {world}")
    return device, train_mesh(
        device.type, world, tp=options.tp, cp=options.cp, dp_outer=options.dp_outer
    )


def train_mesh(device_type: str, world: int, *, tp: int, cp: int, dp_outer: int) -> DeviceMesh:
    """mf-train's mesh over ``world`` ranks: ``(dp_outer, dp, cp, tp)``, with ``dp_cp`` flattened.

    The caller has checked that ``tp * cp * dp_outer`` divides ``world``; ``dp`` is
    what is left (the ranks each replica shards over, per cp and tp rank).
    """
    mesh = init_device_mesh(
        device_type,
        (dp_outer, world // tp // cp // dp_outer, cp, tp),
        mesh_dim_names=("dp_outer", "dp", "cp", "tp"),
    )
    # The weights are replicated over cp as over dp: sharded and reduced over both.
    mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def _check_same_settings(options: TrainOptions) -> None:
    """Stop every rank, rank 0 printing one line, unless all ranks run the same options.

    Ranks started with different settings (``torchrun`` with other flags on one
    node) would build different meshes and models and issue different
    collectives: gloo aborts the process (SIGABRT), NCCL hangs or exchanges the
    wrong bytes. One object all-gather, before the first mesh, is safe whatever
    the options are.
    """
    mine = dataclasses.asdict(options)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        differ = sorted(k for k in first.keys() | theirs.keys() if first.get(k) != theirs.get(k))
        if not differ:
            continue
        shown = ", ".join(
            f"--{k.replace('_', '-')} {theirs.get(k)} (rank 0: {first.get(k)})" for k in differ
        )
        message = (
            f"the ranks were started with different settings: rank {rank} has {shown}; "
            "start every rank with the same options"
        )
        if dist.get_rank() == 0:
            from mf.train.run.cli import user_error

            user_error(message)
        dist.barrier()  # every rank stays until rank 0's line is out
        raise RunStoppedError(message)


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    outer, shard = mesh["dp_outer"], mesh["dp"]
    return (
        outer.get_local_rank() * shard.size() + shard.get_local_rank(),
        outer.size() * shard.size(),
    )


def _expert_mesh(options: TrainOptions, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of a MoE model's experts: ``(dp_outer, dp_cp, ep, etp, tp)``.

    Same ranks and row-major order as ``mesh`` (whose cp size is 1 for a MoE
    model), its ``dp`` dim split into the expert-data-parallel ``dp_cp`` (the
    ranks holding the same experts, which their gradients are reduced over;
    named as the dense mesh's shard dim), ``ep`` and ``etp``: each ETP group is
    ``--etp`` consecutive dp ranks, each EP group ``--ep`` ETP groups apart.
    """
    experts = options.ep * options.etp
    return init_device_mesh(
        mesh.device_type,
        (options.dp_outer, mesh["dp"].size() // experts, options.ep, options.etp, options.tp),
        mesh_dim_names=("dp_outer", "dp_cp", "ep", "etp", "tp"),
    )


def build(options: TrainOptions, mesh: DeviceMesh, device: torch.device):
    """The GPT of the preset (tensor-parallel when --tp > 1), sharded, and its optimizers.

    The optimizers are ``--optimizer``'s recipe, a list (AdamW; or Muon and AdamW).
    """
    folder = folder_of(options.model)
    if folder is not None:
        return _build_from_folder(options, mesh, device, folder)
    torch.manual_seed(options.seed)  # the same full weights on every rank
    config = MODEL_PRESETS[options.model]
    moe = isinstance(config, MoEGPTConfig)
    expert_mesh = _expert_mesh(options, mesh) if moe else None
    ep_group = None if expert_mesh is None else expert_mesh["ep"].get_group()
    etp_group = None if expert_mesh is None or options.etp == 1 else expert_mesh["etp"].get_group()
    module: nn.Module
    unit: type[nn.Module]
    if options.tp == 1:  # experts are keyed globally: --ep, --etp do not change the model either
        module, unit = plain_model(config, ep_group, etp_group), (MoEBlock if moe else Block)
    else:  # the same weights, split: --tp does not change the initial model
        tp_group = mesh["tp"].get_group()
        full_weights = plain_model(config).state_dict()
        split: GPTTensorParallel
        if isinstance(config, MoEGPTConfig):
            split, unit = MoEGPTTensorParallel(config, tp_group, ep_group, etp_group), MoEBlock
        else:
            split, unit = GPTTensorParallel(config, tp_group), TensorParallelBlock
        split.load_full_weights(full_weights)
        module = split
    module.to(device)
    if options.precision == "fp8":  # before the optimizers: FP8 gathering swaps the weights
        gathers_fp8 = FSDP_FLOAT8_ALL_GATHER and options.zero == 3
        convert_gpt_to_float8(module, fsdp_float8_all_gather=gathers_fp8)
    optimizers = build_optimizers(options.optimizer, module, options.lr, weight_decay=0.1)
    return _shard(options, mesh, module, optimizers, [unit], expert_mesh)


def _shard(
    options: TrainOptions,
    mesh: DeviceMesh,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    units: list[type[nn.Module]],
    expert_mesh: DeviceMesh | None = None,
):
    """``module`` and its optimizers sharded over ``mesh`` as the options say."""
    return shard_module(
        module,
        optimizers,
        mesh,
        units,
        zero=options.zero,
        precision=options.precision,
        step_in_backward=options.step_in_backward,
        expert_mesh=expert_mesh,
    )


def shard_module(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    mesh: DeviceMesh,
    units: list[type[nn.Module]],
    *,
    zero: int,
    precision: str,
    step_in_backward: bool = False,
    expert_mesh: DeviceMesh | None = None,
    device: torch.device | None = None,
):
    """``module`` sharded with mf-fsdp over mf-train's mesh, as an mf-train run shards it.

    ``zero``, ``precision`` and ``step_in_backward`` are ``--zero``, ``--precision``
    and ``--step-in-backward``. ``device``: where the engine's buffers live (None:
    the process group's device; ``mf-plan`` passes the meta device).
    """
    from mf_fsdp import MixedPrecisionPolicy, fully_shard

    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    return fully_shard(
        module,
        optimizers,
        device_mesh=mesh,
        dp_shard_dim="dp_cp",
        dp_outer_dim="dp_outer",
        tp_dim="tp",
        expt_device_mesh=expert_mesh,
        fsdp_unit_modules=units,
        zero_dp_strategy=zero,
        optimizer_step_in_backward=step_in_backward,
        device=device,
        mixed_precision_policy=MixedPrecisionPolicy(
            main_params_dtype=torch.float32, param_dtype=compute
        ),
    )


def _build_from_folder(
    options: TrainOptions, mesh: DeviceMesh, device: torch.device, folder: ModelFolder
):
    """A transformers folder's model, wrapped on the meta device, each rank reading its rows.

    Its decoder layers are the units; see ``mf.train.sources.model_folder`` and
    ``mf.train.sources.folder_weights``. The optimizers are bound (and their state made,
    mf-fsdp's [Note: eager optimizer state]) once the weights are in, so loading
    never holds the state beside the weights it reads.
    """
    model, optimizers = load_folder_model(options, mesh, device, folder)
    return model, bind_optimizers(model, optimizers)


def load_folder_model(
    options: TrainOptions, mesh: DeviceMesh, device: torch.device, folder: ModelFolder
):
    """The folder's model sharded with its weights read, and its optimizers not yet bound."""
    module, optimizers = folder_module(options, folder, device)
    model, _ = _shard(options, mesh, module, [], unit_classes(module.lm))
    model.to_empty(device=device)
    if options.lora_rank is None:
        load_folder_weights(model, folder.path, PREFIX)
    else:
        from mf.train.adapters.lora import base_file_name, init_adapters

        if options.base_dtype == "nf4":
            from mf.train.sources.nf4_bases import load_nf4_bases

            load_nf4_bases(model, folder.path, lambda k: base_file_name(k.removeprefix(PREFIX)))
        load_folder_weights(model, folder.path, PREFIX, base_file_name)
        init_adapters(model, options.seed)
    return model, optimizers


def bind_optimizers(model, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """``optimizers``, built on the folder model's parameters, bound to its engine."""
    from mf_fsdp import fully_shard_optimizer

    return [fully_shard_optimizer(optimizer, model) for optimizer in optimizers]
