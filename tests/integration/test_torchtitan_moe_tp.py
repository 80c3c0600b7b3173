"""torchtitan's Qwen3 MoE with tensor parallelism at world 4, parallelized by torchtitan on mf.

torchtitan 0.3.0's ``ParallelDims`` builds two views of the 4 ranks: the dense
``(fsdp, tp)`` mesh and the sparse ``(efsdp, ep)`` mesh, with ``efsdp`` =
``dp_shard x tp / ep``. Its ``parallelize_qwen3`` (backend ``partial_dtensor``)
has no expert-tensor parallelism: with EP the routed experts are DTensors
``Shard(0)`` over ``ep`` alone, with EP off they follow TP (``Shard(1)``/``Shard(2)``
over ``tp``). Two layouts, each with ``fully_shard`` swapped for
``mf_fsdp.fsdp2.fully_shard`` and torch's FSDP2 beside it in the same ranks:

- FSDP 2 x TP 2, no EP: every parameter, experts included, a DTensor over ``tp``
  (sequence parallelism on, torchtitan's default), sharded over ``fsdp``;
- FSDP 2 x TP 2 with EP 2: the dense parameters over ``tp`` sharded over ``fsdp``,
  the experts over ``ep`` placed (``shard_placement_fn``) on ``efsdp``. Here
  ``efsdp`` holds the same ranks as ``fsdp`` and ``ep`` those of ``tp``: the MoE
  block reads the tokens sequence-split over ``tp`` and trades them over ``ep``.

Each runs 3 steps (SGD with momentum, AdamW) in fp32 with torchtitan's loss
scaling (FSDP's division off, the dp rank's loss over the dp size) and must match
one process on the global batch: losses, first-step full gradients, final full
weights, and torchtitan's EP/TP-aware ``clip_grad_norm_`` against torch's on the
whole gradients (1e-5), and the engines' norms each other's. The routed experts'
grouped GEMMs run in fp32 here (torchtitan's run in bf16 whatever the parameter
dtype; see ``_torchtitan_moe._experts_in_fp32``). The model is the Qwen3 MoE
debug model made tiny (2 layers, dim 64, 4 experts, top-2) with SDPA attention.
"""

from __future__ import annotations

import pytest
import torch

from tests._multiprocess import preload_in_ranks, run_on_ranks

try:
    from tests.integration._torchtitan_moe import Layout, rank_layout_parity
    from tests.integration.test_torchtitan_moe_fsdp2 import QWEN3_MOE
except ImportError as error:  # torchtitan 0.3.0 needs a torch newer than the floor
    pytest.skip(
        f"torchtitan does not import with torch {torch.__version__}: {error}",
        allow_module_level=True,
    )

pytestmark = [
    pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete"),
    pytest.mark.filterwarnings("ignore:While redistributing from"),
]
preload_in_ranks(__name__)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("layout", "optim"),
    [
        pytest.param(Layout(dp_shard=2, tp=2, ep=1), "sgd", id="fsdp2-tp2-sgd"),
        pytest.param(Layout(dp_shard=2, tp=2, ep=2), "sgd", id="fsdp2-tp2-ep2-sgd"),
        pytest.param(Layout(dp_shard=2, tp=2, ep=2), "adamw", id="fsdp2-tp2-ep2-adamw"),
    ],
)
def test_torchtitan_qwen3_moe_with_tp_on_mf_matches_torch_fsdp2_and_one_process(
    layout: Layout, optim: str
) -> None:
    run_on_ranks(rank_layout_parity, layout.world, QWEN3_MOE, 4, layout, optim, timeout=180)
