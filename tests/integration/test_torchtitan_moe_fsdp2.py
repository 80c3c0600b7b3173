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

import pytest
import torch

from tests._multiprocess import preload_in_ranks, run_on_ranks

try:
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

HEAD_DIM = 16


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
    return tiny_config(
        Qwen3Model,
        layers=layers,
        norm=_qwen3_norm(DIM),
        embedding_init=_EMBEDDING_INIT,
        lm_head_init=_LINEAR_INIT,
    )


QWEN3_MOE = TitanMoE(
    config=_config, sharding=set_qwen3_sharding_config, parallelize=parallelize_qwen3
)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "experts"), [(4, 4), (4, 2), (2, 4)])
def test_torchtitan_qwen3_moe_dp_ep_on_mf_matches_torch_fsdp2(
    tmp_path, world: int, experts: int
) -> None:
    run_on_ranks(rank_parity, world, QWEN3_MOE, experts, str(tmp_path), timeout=180)
