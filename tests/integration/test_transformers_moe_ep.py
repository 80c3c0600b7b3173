"""transformers' own MoE models with expert parallelism under mf: Qwen3-MoE and Mixtral.

Each tiny model (built in code, no download) is made expert-parallel by one call per
layer, ``mf_tp.expert_parallel(layer.mlp.experts, ep_group)`` (transformers' grouped
``gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]``, its own router untouched), then
wrapped with ``mf_fsdp.fully_shard`` ZeRO-3 over 2 ranks with an expert mesh (edp 1,
ep 2): each rank holds 2 of the 4 experts. 3 steps of SGD and of AdamW against one
process running every rank's batch, at 1e-5 (only the order of fp32 sums differs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

import mf_fsdp
import mf_tp
from tests._multiprocess import preload_in_ranks, run_on_ranks
from tests.fsdp._helpers import (
    assert_matches_reference,
    full_params,
    global_batch_run,
    make_optimizer,
    optimizer_step,
)

# The ranks import this module (their functions are its), and so transformers' models:
# seconds of CPU per rank, which the forkserver pays once instead.
preload_in_ranks(__name__)

VOCAB, BATCH, SEQ, STEPS, EXPERTS = 64, 2, 8, 3, 4
RTOL, ATOL = 1e-5, 1e-6
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "num_experts_per_tok": 2,
    "attn_implementation": "eager",
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
_MODELS = {
    "qwen3_moe": (
        lambda: Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**_SHAPE, num_experts=EXPERTS, moe_intermediate_size=16, head_dim=8)
        ),
        Qwen3MoeDecoderLayer,
    ),
    "mixtral": (
        lambda: MixtralForCausalLM(
            MixtralConfig(**_SHAPE, num_local_experts=EXPERTS, intermediate_size=16)
        ),
        MixtralDecoderLayer,
    ),
}


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return _MODELS[name][0]()


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7 * step + rank)
    )


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _reference(name: str, opt_name: str, world: int):
    model = _make(name)
    opt = make_optimizer(opt_name, model.parameters())
    return global_batch_run(
        model, opt, STEPS, world, lambda m, step, rank: _loss(m, _tokens(step, rank))
    )


def _rank_ep_parity(rank: int, world: int, name: str) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    for opt_name in ("sgd", "adam"):
        ref_losses, ref_params = _reference(name, opt_name, world)
        module = _make(name)
        for layer in module.model.layers:
            mf_tp.expert_parallel(layer.mlp.experts, expert_mesh["ep"].get_group())
        local = module.model.layers[0].mlp.experts.gate_up_proj.to_local()
        assert local.shape[0] == EXPERTS // world  # this rank's experts only
        model, opt = mf_fsdp.fully_shard(
            module,
            make_optimizer(opt_name, module.parameters()),
            device_mesh=mesh,
            dp_shard_dim="dp",
            expt_device_mesh=expert_mesh,
            fsdp_unit_modules=[_MODELS[name][1]],
            zero_dp_strategy=3,
        )
        losses = [
            optimizer_step(_loss(model, _tokens(step, rank)), opt, world) for step in range(STEPS)
        ]
        params = full_params(model)  # the experts parameter-shaped: every expert, [E, ...]
        assert params.keys() == ref_params.keys()
        assert_matches_reference(
            losses, params, ref_losses, ref_params, f"{name} ep2 {opt_name}", RTOL, ATOL
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(_MODELS))
def test_transformers_moe_with_expert_parallelism_matches_one_process(name: str) -> None:
    run_on_ranks(_rank_ep_parity, 2, name, timeout=120)


def test_expert_parallel_refuses_modules_it_cannot_serve() -> None:
    with pytest.raises(TypeError, match=r"expected an experts module with 3-D parameters"):
        mf_tp.expert_parallel(nn.Linear(2, 2), None)  # type: ignore[arg-type]
