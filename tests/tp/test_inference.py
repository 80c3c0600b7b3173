"""Inference layers against plain-torch math, and the fused path against the unfused chain.

The column layer's ``RMSNorm -> all-gather -> GEMM`` and the row layer's
``GEMM -> reduce-scatter`` are compared with the single-process computation on
the gathered weights (rtol 1e-5, atol 1e-6: fp32, different summation order).
The fused ``reduce-scatter + residual + RMSNorm + all-gather`` runs the same
ops as the unfused chain, so it must match it exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mf_tp
from tests._multiprocess import run_on_ranks

S, B, H, FFN = 4, 2, 8, 12


def _gather(shard: torch.Tensor, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard.contiguous())
    return torch.cat(pieces, dim=dim)


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rank_inference(rank: int, world: int) -> None:
    config = mf_tp.ModelParallelConfig(
        tensor_model_parallel_size=world,
        sequence_parallel=True,
        use_cpu_initialization=True,
        layernorm_epsilon=1e-6,
    )
    torch.manual_seed(0)
    column = mf_tp.InferenceLayerNormColumnParallelLinear(
        H,
        FFN,
        config=config,
        init_method=torch.nn.init.normal_,
        gather_output=False,
        bias=True,
        skip_bias_add=False,
        is_expert=False,
        tp_group=dist.group.WORLD,
    )
    row = mf_tp.InferenceRowParallelLinear(
        FFN,
        H,
        config=config,
        init_method=torch.nn.init.normal_,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        is_expert=False,
        tp_group=dist.group.WORLD,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        column.layer_norm_weight.copy_(torch.rand(H, generator=gen) + 0.5)
        column.bias.copy_(torch.randn(FFN, generator=gen).chunk(world)[rank])
        row.bias.copy_(torch.randn(H, generator=gen))
    w1, b1 = _gather(column.weight.detach(), 0), _gather(column.bias.detach(), 0)
    w2 = _gather(row.weight.detach(), 1)
    x = torch.randn(S, B, H, generator=gen)
    residual_full = torch.randn(S, B, H, generator=gen)
    next_norm = torch.rand(H, generator=gen) + 0.5
    rows = lambda t: t.chunk(world, dim=0)[rank]  # noqa: E731

    hidden_ref = _reference_rms_norm(x, column.layer_norm_weight.detach(), 1e-6) @ w1.t() + b1
    out_ref = hidden_ref @ w2.t() + row.bias.detach()
    hidden, hidden_bias = column(rows(x))
    assert hidden_bias is None
    torch.testing.assert_close(hidden, hidden_ref.chunk(world, dim=-1)[rank], rtol=1e-5, atol=1e-6)
    out, _ = row(hidden)
    torch.testing.assert_close(out, rows(out_ref), rtol=1e-5, atol=1e-6)

    # Unfused: residual add on my rows, then what the next column layer does before its GEMM.
    new_residual = rows(residual_full) + out
    unfused = _gather(mf_tp.rms_norm(new_residual, next_norm, 1e-6), 0)
    row.set_next_layer_norm_weights(next_norm)
    residual = rows(residual_full).clone()
    fused, _ = row(hidden, residual)
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
    torch.testing.assert_close(residual, new_residual, rtol=0, atol=0)
    expected = _reference_rms_norm(residual_full + out_ref, next_norm, 1e-6)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match=r"x must have last dim 8, got shape \(2, 3\)"):
        column(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"weights must have shape \(8,\)"):
        row.set_next_layer_norm_weights(torch.ones(3))
    with pytest.raises(ValueError, match="input_is_parallel must be True"):
        mf_tp.InferenceRowParallelLinear(
            FFN,
            H,
            config=config,
            init_method=torch.nn.init.normal_,
            bias=False,
            input_is_parallel=False,
            skip_bias_add=False,
            is_expert=False,
            tp_group=dist.group.WORLD,
        )


@pytest.mark.multiprocess
def test_inference_layers() -> None:
    run_on_ranks(_rank_inference, 2)
