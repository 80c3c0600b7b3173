"""The run every torchtitan MoE parity test shares: one model, two engines, one script.

A test names its model by a :class:`TitanMoE` (how to build the config, which
torchtitan ``parallelize_*`` applies EP and FSDP to it; :func:`tiny_config`
holds what the models' configs share) and calls
:func:`rank_parity` on every rank. That function parallelizes the model at
dp_shard=world x ep 2 with torchtitan's own function, twice: once with torch's
``fully_shard``, once with ``mf_fsdp.fsdp2.fully_shard`` swapped in
(``test_torchtitan_fsdp2``'s way). Both start from one process's weights, run
torchtitan's script (FSDP's division off, the loss over the world, its
EP-aware gradient clipping) with AdamW in fp32, and must agree: first-step
gradients, gradient norms, losses and weights. mf's state dict, saved by DCP,
must also load into a fresh FSDP2 model with mf's values, bit for bit.

Importing this module imports torchtitan: a test module imports it inside the
guard that skips where torchtitan does not import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchtitan.distributed.fsdp as titan_fsdp
import torchtitan.distributed.parallel_dims as titan_dims
import torchtitan.distributed.utils as titan_utils
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention

from mf_fsdp import fsdp2
from tests.integration.test_torchtitan_fsdp2 import _loss, sharded_dims

VOCAB, DIM, SEQ, BATCH, STEPS, EP = 256, 64, 16, 2, 2, 2


@dataclass(frozen=True)
class TitanMoE:
    """A torchtitan MoE model as the parity run needs it (module-level, so ranks pickle it).

    ``config`` builds the model's config (vocabulary :data:`VOCAB`, sharding
    configs set for EP) from the routed expert count; ``parallelize`` is the
    model's torchtitan ``parallelize_*`` function.
    """

    config: Callable[[int], object]
    parallelize: Callable[..., object]


def _with_sdpa(layers: list) -> list:
    """The blocks with SDPA as inner attention (torchtitan's flex attention has no CPU
    backward; its SDPA is causal, as the debug models' block-causal mask is on one document)."""
    sdpa = ScaledDotProductAttention.Config()
    return [
        dataclasses.replace(
            layer, attention=dataclasses.replace(layer.attention, inner_attention=sdpa)
        )
        for layer in layers
    ]


def tiny_config(
    model: type,
    set_sharding: Callable[..., None],
    *,
    layers: list,
    norm: object,
    embedding_init: object,
    lm_head_init: object,
    **fields: object,
) -> object:
    """``model.Config`` of width :data:`DIM` over :data:`VOCAB` tokens with ``layers``
    (made to attend through SDPA) and EP's sharding configs (``set_sharding``, the
    model's ``set_*_sharding_config``, sequence parallelism off).

    ``norm`` is the final norm's config, ``embedding_init`` and ``lm_head_init``
    the model's own initializers; ``fields`` are the model's further config fields.
    """
    config = model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=norm,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=embedding_init
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=lm_head_init),
        layers=_with_sdpa(layers),
        **fields,
    )
    set_sharding(config, enable_sp=False, enable_ep=True)
    return config


def plain(moe: TitanMoE, experts: int):
    """One process's model and initial weights (the values both engines start from)."""
    with torch.device("meta"):
        model = moe.config(experts).build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def parallelized(moe: TitanMoE, shard, experts: int, tmp: str):
    """torchtitan's parallelize at dp_shard=world, ep=2, ``fully_shard`` = ``shard``."""
    dims = sharded_dims(ep=EP)
    with torch.device("meta"):
        model = moe.config(experts).build()
    with (
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
    ):
        titan_utils.set_spmd_backend("partial_dtensor")  # the trainer's call, from its config
        dims.build_mesh()
        moe.parallelize(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(
                spmd_backend="partial_dtensor", expert_parallel_degree=EP
            ),
            compile_config=CompileConfig(enable=False, components=["model"]),
            ac_config=None,
            dump_folder=tmp,
        )
    assert isinstance(model.layers["0"], TorchFSDPModule)
    if shard is torch_fully_shard:  # gloo has no PREMUL_SUM, which factor 1.0 asks of torch
        for module in model.modules():
            if isinstance(module, TorchFSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    _start_from(model, plain(moe, experts), mf=shard is not torch_fully_shard)
    return model


def _start_from(model, reference, mf: bool) -> None:
    """Give ``model`` one process's weights: mf loads full tensors, FSDP2 its own shards."""
    if mf:
        model.load_state_dict(reference.state_dict())
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference.get_parameter(name)
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, rank: int, world: int) -> tuple[list[float], torch.Tensor, dict]:
    """AdamW steps with torchtitan's scaling (FSDP's division off, each loss over ``world``)
    and its EP-aware gradient clipping.

    Returns the losses, the gradient norms and the first step's gradients (AdamW's
    steps do not see a gradient's scale; the norms and gradients do).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = _loss(model, *_batch(step, rank)) / world
        loss.backward()
        if step == 0:
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        # The trainer's clipping: the experts' norm over their meshes, the rest over theirs.
        norms.append(titan_utils.clip_grad_norm_(model.parameters(), 0.05, ep_enabled=True))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, torch.stack(norms), grads


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {
        name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for name, p in model.named_parameters()
    }


def rank_parity(rank: int, world: int, moe: TitanMoE, experts: int, tmp: str) -> None:
    """One rank of the parity run (see the module's docstring)."""
    runs, norms, grads, weights = {}, {}, {}, {}
    for name, shard in (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard)):
        model = parallelized(moe, shard, experts, tmp)
        runs[name], norms[name], grads[name] = _train(model, rank, world)
        weights[name] = _full_weights(model)
    # mf's state dict (experts as pieces over (efsdp, ep)) saved by DCP loads into a fresh
    # FSDP2 model (experts as _StridedShard over efsdp, Shard over ep) with mf's values.
    dcp.save(model.state_dict(), checkpoint_id=tmp)
    fresh = parallelized(moe, torch_fully_shard, experts, tmp)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=tmp)
    fresh.load_state_dict(state)
    torch.testing.assert_close(_full_weights(fresh), weights["mf"], rtol=0, atol=0)
    torch.testing.assert_close(runs["mf"], runs["torch"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms["mf"], norms["torch"], rtol=1e-5, atol=1e-7)
    assert weights["mf"].keys() == weights["torch"].keys()
    for name, value in grads["torch"].items():
        torch.testing.assert_close(grads["mf"][name], value, rtol=1e-5, atol=1e-8, msg=name)
    # AdamW moves an element whose gradients are rounding noise by up to lr (1e-3) a step,
    # either way: after the first step's equal gradients, two such elements of one expert
    # weight differ by 8.9e-5 (Qwen3, 2 experts), every other weight element by at most 5.7e-6.
    for name, value in weights["torch"].items():
        torch.testing.assert_close(weights["mf"][name], value, rtol=5e-5, atol=1e-4, msg=name)
