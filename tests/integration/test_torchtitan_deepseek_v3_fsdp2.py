"""torchtitan's DeepSeek-V3 at dp_shard 4 or 2 x ep 2, parallelized by torchtitan on mf.

torchtitan 0.3.0's ``parallelize_deepseekv3`` applies expert parallelism to the
routed experts (grouped ``w1``/``w2``/``w3`` DTensors ``Shard(0)`` over ``ep``,
tokens by all-to-all) and then FSDP through ``apply_fsdp_to_mtp_decoder``
(``apply_fsdp_to_decoder`` with ``shard_placement_fn``: routed experts on the
expert-data-parallel mesh, the rest on the data-parallel mesh). With
``fully_shard`` swapped for ``mf_fsdp.fsdp2.fully_shard``, mf runs the same
script as torch's FSDP2 and must agree with it (``_torchtitan_moe.rank_parity``:
first-step gradients, gradient norms, losses and weights over 2 AdamW steps,
fp32, and mf's DCP checkpoint loading into FSDP2).

The model is the DeepSeek-V3 debug model's architecture made tiny for 2 CPU
cores: MLA attention (low-rank key-value projection with its norm, decoupled
rotary dims, yarn RoPE), a dense first layer, then a MoE layer with softmax
top-2 routing over the routed experts plus shared experts, SDPA attention.
Two routed experts at world 4: fewer experts than ``efsdp x ep`` ranks, so
torchtitan asks for ``Shard(1)`` (4 experts, dim 0, also passes: 97 s on 2
cores; the Qwen3 MoE test keeps that layout, so this file runs only the rarer one).
"""

from __future__ import annotations

import pytest
import torch

from tests._multiprocess import preload_in_ranks, run_on_ranks

try:
    from torchtitan.models.common import ComplexRoPE, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from tests.integration._torchtitan_moe import DIM, TitanMoE, rank_parity, tiny_config
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete")
# The ranks import this module (their functions are its), and so torchtitan: seconds of
# CPU per rank, which the forkserver pays once instead (torchtitan imported: no skip here).
preload_in_ranks(__name__)

ROPE_DIM = 8


def _config(experts: int) -> DeepSeekV3Model.Config:
    """The debug model's blocks (MLA, one dense layer, routed + shared experts), tiny."""
    layers = _build_dsv3_layers(
        n_layers=2,
        n_dense_layers=1,
        dim=DIM,
        n_heads=4,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=128,
        moe_hidden_dim=32,
        num_experts=experts,
        num_shared_experts=2,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=ROPE_DIM,
            max_seq_len=256,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=64,
        ),
    )
    return tiny_config(
        DeepSeekV3Model,
        layers=layers,
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        embedding_init=_EMBEDDING_INIT,
        lm_head_init=_output_linear_init(DIM),
        mtp_layers=[],
    )


DEEPSEEK_V3 = TitanMoE(
    config=_config, sharding=set_deepseek_v3_sharding_config, parallelize=parallelize_deepseekv3
)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_torchtitan_deepseek_v3_dp_ep_on_mf_matches_torch_fsdp2(
    tmp_path,
) -> None:
    run_on_ranks(rank_parity, 4, DEEPSEEK_V3, 2, str(tmp_path), timeout=180)
