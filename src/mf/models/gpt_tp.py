"""The GPT of :mod:`mf.models.gpt`, tensor-parallel with mf-tp layers.

Same config, same presets, same parameter names and the same function: with
the full weights of a plain :class:`~mf.models.gpt.GPT` loaded through
:meth:`GPTTensorParallel.load_full_weights`, :class:`GPTTensorParallel` computes the same loss
on every TP rank. Per block, attention heads and the MLP's hidden units are
split over the TP group (Megatron's column-then-row pattern: one all-reduce
after attention, one after the MLP); the token embedding is split over the
vocabulary, and the LM head reuses it, so the logits stay vocab-parallel
into :func:`mf_tp.vocab_parallel_cross_entropy`. Norms and the position
table are replicated on the TP ranks; their gradients agree there because
the column layers all-reduce the input gradient.

Weights are drawn on the CPU from the default generator (the full master
weight, then this rank's piece), so seeding every rank alike gives one
consistent model at any TP size. The FQN-to-shard rule lives on the
parameters themselves (mf_utils' tensor-parallel attributes), which is also
what mf-fsdp reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from mf.models.gpt import GPTConfig, layer_drop, token_positions
from mf_tp import (
    ColumnParallelLinear,
    ModelParallelConfig,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from mf_utils import get_mcore_tensor_parallel_partition_dim, is_mcore_tensor_model_parallel

__all__ = ["GPTTensorParallel", "TensorParallelBlock"]


def _check_divisible(config: GPTConfig, tp_size: int) -> None:
    for name in ("n_heads", "vocab_size"):
        value = getattr(config, name)
        if value % tp_size != 0:
            raise ValueError(
                f"GPTTensorParallel: {name}={value} is not divisible by the TP size {tp_size}"
            )


class TensorParallelAttention(nn.Module):
    """Causal self-attention with this rank's ``n_heads / t`` heads.

    ``qkv`` is a column layer of stride 3: rank ``r`` holds the q, k and v rows
    of its own heads, so the fused weight loads from the plain model's.
    """

    def __init__(
        self, config: GPTConfig, mp_config: ModelParallelConfig, tp_group: dist.ProcessGroup
    ) -> None:
        super().__init__()
        d = config.d_model
        self.local_heads = config.n_heads // dist.get_world_size(tp_group)
        self.dropout = config.dropout
        self.qkv = ColumnParallelLinear(
            d, 3 * d, config=mp_config, init_method=_normal(0.02), stride=3, tp_group=tp_group
        )
        self.proj = _residual_projection(d, config, mp_config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions: [B, S, D] -> [B, S, D] (all-reduced)."""
        batch, seq, _ = x.shape
        qkv, _ = self.qkv(x)
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (t.view(batch, seq, self.local_heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        out, _ = self.proj(y.transpose(1, 2).reshape(batch, seq, -1))
        return out


class TensorParallelBlock(nn.Module):
    """Pre-norm transformer block with TP attention and a column/row MLP (the FSDP unit)."""

    def __init__(
        self, config: GPTConfig, mp_config: ModelParallelConfig, tp_group: dist.ProcessGroup
    ) -> None:
        super().__init__()
        d = config.d_model
        self.ln_1 = nn.LayerNorm(d)
        self.attn = TensorParallelAttention(config, mp_config, tp_group)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = ColumnParallelLinear(
            d, 4 * d, config=mp_config, init_method=_normal(0.02), tp_group=tp_group
        )
        self.out = _residual_projection(4 * d, config, mp_config, tp_group)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block: [B, S, D] -> [B, S, D]."""
        x = x + self.drop(self.attn(self.ln_1(x)))
        hidden, _ = self.fc(self.ln_2(x))
        out, _ = self.out(F.gelu(hidden))
        return x + self.drop(out)


class GPTTensorParallel(nn.Module):
    """:class:`~mf.models.gpt.GPT` with its weights split over ``tp_group``.

    Args:
        config: the model shape (a preset from :data:`mf.models.PRESETS`).
        tp_group: the tensor-parallel process group (e.g. ``mesh["tp"].get_group()``).

    Attributes:
        layer_drop, layer_drop_generator: LayerDrop in training, as ``GPT``'s (the ranks
            of one TP group must draw alike: seed their generators the same).

    Raises:
        ValueError: if the TP size does not divide ``n_heads`` or ``vocab_size``.
    """

    layer_drop: float = 0.0
    layer_drop_generator: torch.Generator | None = None

    def __init__(self, config: GPTConfig, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        tp_size = dist.get_world_size(tp_group)
        _check_divisible(config, tp_size)
        mp_config = ModelParallelConfig(
            tensor_model_parallel_size=tp_size, use_cpu_initialization=True
        )
        self.config = config
        self.tp_group = tp_group
        self.wte = VocabParallelEmbedding(
            config.vocab_size,
            config.d_model,
            init_method=_normal(0.02),
            config=mp_config,
            tp_group=tp_group,
        )
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            TensorParallelBlock(config, mp_config, tp_group) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = ColumnParallelLinear(
            config.d_model,
            config.vocab_size,
            config=mp_config,
            init_method=_normal(0.02),
            bias=False,
            skip_weight_param_allocation=config.tie_embeddings,
            tp_group=tp_group,
        )
        if config.tie_embeddings:
            # Registered under both names, as the plain GPT does, so the state dicts match.
            self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return full logits [B, S, V], or the mean cross-entropy loss given ``targets``.

        ``positions`` as in :meth:`mf.models.gpt.GPT.forward`.
        """
        positions = token_positions(self.config, tokens, positions, "GPTTensorParallel.forward")
        x = self.wte(tokens) + self.wpe(positions)
        blocks: Iterable[nn.Module] = self.blocks
        if self.training and self.layer_drop > 0:
            blocks = layer_drop(self.blocks, self.layer_drop, self.layer_drop_generator)
        for block in blocks:
            x = block(x)
        head_weight = self.wte.weight if self.config.tie_embeddings else None
        logits, _ = self.lm_head(self.ln_f(x), weight=head_weight)
        if targets is None:
            return gather_from_tensor_model_parallel_region(logits, self.tp_group)
        return vocab_parallel_cross_entropy(logits, targets, group=self.tp_group).mean()

    @torch.no_grad()
    def load_full_weights(self, full_state: Mapping[str, torch.Tensor]) -> None:
        """Copy full (unsharded) weights, e.g. a plain GPT's ``state_dict()``, into this model.

        Each tensor-parallel parameter takes this rank's piece along its
        ``partition_dim``, honouring ``partition_stride`` (the fused qkv
        weight); replicated parameters take the whole tensor. Call it before
        sharding with mf-fsdp.

        Raises:
            KeyError: if ``full_state`` lacks one of the model's parameters.
            ValueError: if a tensor's shape does not fit the parameter.
        """
        rank, size = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
        for name, param in self.named_parameters():
            if name not in full_state:
                raise KeyError(f"load_full_weights: full_state has no {name!r}")
            full = full_state[name]
            target: torch.Tensor = param
            if isinstance(param, DTensor):  # grouped experts: Shard(0) over the EP group
                (placement,) = param.placements
                assert isinstance(placement, Shard)  # mf-tp's grouped experts are sharded
                mesh = param.device_mesh
                full = full.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
                target = param.to_local()
            elif is_mcore_tensor_model_parallel(param):
                dim = get_mcore_tensor_parallel_partition_dim(param)
                assert dim is not None  # a tensor-parallel parameter has its partition dim
                stride = getattr(param, "partition_stride", 1)
                full = torch.cat(full.chunk(size * stride, dim=dim)[rank::size], dim=dim)
            if full.shape != target.shape:
                raise ValueError(
                    f"load_full_weights: {name!r} has shape {tuple(target.shape)} on this rank, "
                    f"the full tensor gives {tuple(full.shape)}"
                )
            target.copy_(full)


def _residual_projection(
    in_features: int,
    config: GPTConfig,
    mp_config: ModelParallelConfig,
    tp_group: dist.ProcessGroup,
) -> RowParallelLinear:
    """The row-parallel layer that ends a residual branch (attention out, MLP out)."""
    return RowParallelLinear(
        in_features,
        config.d_model,
        config=mp_config,
        init_method=_normal(_residual_std(config)),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=tp_group,
    )


def _normal(std: float):
    return partial(nn.init.normal_, std=std)


def _residual_std(config: GPTConfig) -> float:
    return 0.02 / math.sqrt(2 * config.n_layers)
