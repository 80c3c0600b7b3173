"""torchtitan's Qwen3 MoE at dp_shard 4 or 2 x ep 2, parallelized by torchtitan on mf.

torchtitan 0.3.0's ``parallelize_qwen3`` applies expert parallelism (the routed
experts' grouped weights become DTensors ``Shard(0)`` over the ``ep`` mesh, the
tokens travel by all-to-all) and then ``apply_fsdp_to_decoder``, which shards
each MoE block with a ``shard_placement_fn`` returning torch 2.15's
``ShardPlacementResult``: the experts on the expert-data-parallel mesh
(``efsdp``, 2 ranks), everything else on the data-parallel mesh (``fsdp``, 4
ranks); it sets explicit forward and backward prefetch lists and turns FSDP's
gradient division off (the loss is divided by the world). With ``fully_shard``
swapped for ``mf_fsdp.fsdp2.fully_shard`` (``test_torchtitan_fsdp2``'s way), mf
runs the same script as torch's FSDP2, clipping with torchtitan's EP-aware
``clip_grad_norm_`` as its trainer does: equal first-step gradients, gradient
norms, losses and weights over 2 AdamW steps, fp32; and mf's state dict, saved
by DCP, loads into torch's FSDP2 model with mf's values. At world 2
(dp_shard 2 x ep 2) the ``efsdp`` mesh has one rank: the experts are split
by EP alone, their buckets over a group of one.

The model is the Qwen3 MoE debug model's architecture made tiny for 2 CPU cores
(2 layers, dim 64, top-2 routing) with SDPA attention (torchtitan's flex
attention has no CPU backward). Two expert counts: 4 (``efsdp x ep`` = 4 <= 4
experts: torchtitan shards the experts' dim 0) and 2 (fewer experts than ranks:
torchtitan asks for ``Shard(1)``, which mf serves with its own row layout).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from mf_fsdp import fsdp2
from tests._multiprocess import run_on_ranks
from tests.integration.test_torchtitan_fsdp2 import _loss, sharded_dims

try:
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.utils as titan_utils
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete")

VOCAB, DIM, HEAD_DIM, SEQ, BATCH, STEPS, EP = 256, 64, 16, 16, 2, 2, 2


def _config(experts: int) -> Qwen3Model.Config:
    """The debug MoE model's blocks, tiny, with SDPA attention and EP's sharding configs."""
    layers = _build_qwen3_moe_layers(
        n_layers=2,
        dim=DIM,
        n_heads=4,
        n_kv_heads=2,
        head_dim=HEAD_DIM,
        moe_hidden_dim=32,
        num_experts=experts,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=1e6),
    )
    sdpa = ScaledDotProductAttention.Config()
    layers = [
        dataclasses.replace(
            layer, attention=dataclasses.replace(layer.attention, inner_attention=sdpa)
        )
        for layer in layers
    ]
    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=layers,
    )
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    return config


def _plain(experts: int):
    """One process's model and initial weights (the values both engines start from)."""
    with torch.device("meta"):
        model = _config(experts).build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _parallelized(shard, experts: int, tmp: str):
    """torchtitan's ``parallelize_qwen3`` at dp_shard=world, ep=2, ``fully_shard`` = ``shard``."""
    dims = sharded_dims(ep=EP)
    with torch.device("meta"):
        model = _config(experts).build()
    with (
        mock.patch.object(titan_dims, "device_type", "cpu"),
        mock.patch.object(titan_fsdp, "fully_shard", shard),
    ):
        titan_utils.set_spmd_backend("partial_dtensor")  # the trainer's call, from its config
        dims.build_mesh()
        parallelize_qwen3(
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
    _start_from(model, _plain(experts), mf=shard is not torch_fully_shard)
    return model


def _start_from(model, plain, mf: bool) -> None:
    """Give ``model`` one process's weights: mf loads full tensors, FSDP2 its own shards."""
    if mf:
        model.load_state_dict(plain.state_dict())
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = plain.get_parameter(name)
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


def _rank_parity(rank: int, world: int, experts: int, tmp: str) -> None:
    runs, norms, grads, weights = {}, {}, {}, {}
    for name, shard in (("torch", torch_fully_shard), ("mf", fsdp2.fully_shard)):
        model = _parallelized(shard, experts, tmp)
        runs[name], norms[name], grads[name] = _train(model, rank, world)
        weights[name] = _full_weights(model)
    # mf's state dict (experts as pieces over (efsdp, ep)) saved by DCP loads into a fresh
    # FSDP2 model (experts as _StridedShard over efsdp, Shard over ep) with mf's values.
    dcp.save(model.state_dict(), checkpoint_id=tmp)
    fresh = _parallelized(torch_fully_shard, experts, tmp)
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
    # weight differ by 8.9e-5 (2 experts), every other weight element by at most 5.7e-6.
    for name, value in weights["torch"].items():
        torch.testing.assert_close(weights["mf"][name], value, rtol=5e-5, atol=1e-4, msg=name)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "experts"), [(4, 4), (4, 2), (2, 4)])
def test_torchtitan_qwen3_moe_dp_ep_on_mf_matches_torch_fsdp2(
    tmp_path, world: int, experts: int
) -> None:
    run_on_ranks(_rank_parity, world, experts, str(tmp_path), timeout=180)
