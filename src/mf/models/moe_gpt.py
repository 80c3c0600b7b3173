"""A small mixture-of-experts GPT: :mod:`mf.models.gpt` with each MLP replaced by experts.

Every block routes each token to ``top_k`` of ``num_experts`` expert MLPs
(:class:`mf_tp.MoELayer`, dropless). With an expert-parallel group, each rank
holds ``num_experts / ep_size`` experts and tokens travel to their experts
and back by all-to-all; without one (``ep_group=None``) a single process
holds every expert: that model is the single-process reference of every
expert-parallel run. Experts are grouped weights (:class:`mf_tp.GroupedExperts`),
parameter-shaped over every expert at any EP size, so state-dict entries
(``blocks.0.moe.experts.fc_weight [E, F, D]``) and values are the same at any
EP size, and a checkpoint moves between EP sizes.

Initialisation draws from torch's default generator in a fixed order (dense
weights by name, then every block's experts, all of them, in global order),
so seeding every rank alike gives the same model at any EP size. The loss
the model returns is the language-model loss plus ``load_balance_coeff``
times the blocks' summed load-balance losses; both parts and the tokens each
expert received are kept for reporting (:meth:`MoEGPT.routing_stats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from mf.models.gpt import GPT, CausalSelfAttention, GPTConfig
from mf.models.gpt_tp import GPTTensorParallel, TensorParallelAttention
from mf_tp import ModelParallelConfig, MoELayer

__all__ = [
    "MOE_PRESETS",
    "MoEBlock",
    "MoEGPT",
    "MoEGPTConfig",
    "MoEGPTTensorParallel",
    "RoutingStats",
]


@dataclass(frozen=True, slots=True)
class MoEGPTConfig(GPTConfig):
    """Shape of a mixture-of-experts GPT (the fields of ``GPTConfig``, plus the experts).

    Attributes:
        num_experts: experts per block.
        top_k: experts each token is sent to.
        expert_ffn_size: hidden units of one expert's MLP.
        load_balance_coeff: weight of the load-balance loss in the returned loss.
    """

    num_experts: int = 4
    top_k: int = 2
    expert_ffn_size: int = 256
    load_balance_coeff: float = 0.01

    def __post_init__(self) -> None:
        GPTConfig.__post_init__(self)
        for name in ("num_experts", "top_k", "expert_ffn_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEGPTConfig: {name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEGPTConfig: top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        if not (math.isfinite(self.load_balance_coeff) and self.load_balance_coeff >= 0):
            raise ValueError(
                "MoEGPTConfig: load_balance_coeff must be finite and >= 0, got "
                f"{self.load_balance_coeff!r}"
            )

    def num_parameters(self) -> int:
        """Count the model's parameters (all experts, tied weights once) without building it."""
        d, f, e = self.d_model, self.expert_ffn_size, self.num_experts
        attention = d * 3 * d + 3 * d + d * d + d
        experts = e * (d * f + f + f * d + d)
        per_block = 2 * 2 * d + attention + e * d + experts
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return (self.vocab_size + self.seq_len) * d + self.n_layers * per_block + 2 * d + head


MOE_PRESETS: dict[str, MoEGPTConfig] = {
    "moe-tiny": MoEGPTConfig(
        vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4, expert_ffn_size=128
    ),
    "moe-small": MoEGPTConfig(
        vocab_size=256,
        seq_len=256,
        d_model=256,
        n_layers=4,
        n_heads=4,
        num_experts=8,
        top_k=2,
        expert_ffn_size=512,
    ),
}


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """What the last forward's routers did.

    Attributes:
        load_balance_loss: the blocks' summed load-balance losses (before the coefficient).
        language_loss: the cross-entropy part of the last loss (None without targets).
        tokens_per_expert: tokens each expert received from this rank, ``[n_layers, E]``.
    """

    load_balance_loss: float
    language_loss: float | None
    tokens_per_expert: torch.Tensor


class MoEBlock(nn.Module):
    """Pre-norm transformer block: attention, then a mixture of expert MLPs (the FSDP unit).

    Args:
        config: the model shape.
        ep_group: the expert-parallel group, or None for every expert here.
        attention: the attention module (default: ``CausalSelfAttention``; the TP
            model passes its tensor-parallel one).
    """

    def __init__(
        self,
        config: MoEGPTConfig,
        ep_group: dist.ProcessGroup | None,
        attention: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config) if attention is None else attention
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.moe = MoELayer(
            config.d_model,
            config.expert_ffn_size,
            config.num_experts,
            config.top_k,
            ep_group=ep_group,
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block: [B, S, D] -> [B, S, D]."""
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.moe(self.ln_2(x)))


class _RoutedModel(nn.Module):
    """What the MoE GPTs share: the balance term of the loss and the routing report.

    Listed first among the bases: its ``forward`` wraps the dense model's.
    """

    config: MoEGPTConfig
    blocks: nn.ModuleList

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V]; given ``targets``, the mean cross entropy plus the balance term."""
        out = super().forward(tokens, targets, positions=positions)
        return out if targets is None else self._with_balance(out)

    def _moe_layers(self) -> list[MoELayer]:
        """Every block's MoE layer, in block order."""
        # cast: nn.ModuleList is not generic; the blocks are MoEBlocks
        return [cast(MoEBlock, block).moe for block in self.blocks]

    def _routing(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every MoE layer's load-balance loss and token counts from its last forward.

        Raises:
            RuntimeError: if a layer has run no forward yet.
        """
        losses, tokens = [], []
        for layer in self._moe_layers():
            if layer.load_balance_loss is None or layer.tokens_per_expert is None:
                raise RuntimeError(f"{type(self).__name__}: a MoE layer has run no forward yet")
            losses.append(layer.load_balance_loss)
            tokens.append(layer.tokens_per_expert)
        return losses, tokens

    def _with_balance(self, language_loss: torch.Tensor) -> torch.Tensor:
        """The returned loss: the language loss plus the weighted load-balance losses."""
        self._language_loss = language_loss.detach()
        balance = torch.stack(self._routing()[0]).sum()
        return language_loss + self.config.load_balance_coeff * balance

    def routing_stats(self) -> RoutingStats:
        """The load-balance loss, language loss and per-expert token counts of the last forward.

        Raises:
            RuntimeError: before any forward.
        """
        if getattr(self._moe_layers()[0], "tokens_per_expert", None) is None:
            raise RuntimeError(f"{type(self).__name__}.routing_stats: no forward has run yet")
        losses, tokens = self._routing()
        balance = sum(float(loss.detach()) for loss in losses)
        counts = torch.stack(tokens)
        language = getattr(self, "_language_loss", None)
        return RoutingStats(balance, None if language is None else float(language), counts)


class MoEGPT(_RoutedModel, GPT):
    """:class:`~mf.models.gpt.GPT` whose blocks are :class:`MoEBlock` s.

    Args:
        config: the model shape (e.g. ``MOE_PRESETS["moe-tiny"]``).
        ep_group: the expert-parallel group (its size must divide ``num_experts``), or
            None for one process holding every expert.
    """

    config: MoEGPTConfig  # declared on the class itself: its two bases declare it differently

    def __init__(self, config: MoEGPTConfig, ep_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(config, MoEGPTConfig):
            raise TypeError(f"MoEGPT: config must be a MoEGPTConfig, got {config!r}")
        super().__init__(config, block=lambda _: MoEBlock(config, ep_group))  # GPT passes config

    def _initialises_itself(self, name: str) -> bool:
        return ".moe." in name  # drawn by reset_parameters, after the dense weights

    def reset_parameters(self) -> None:
        """GPT-2 style init for the dense weights, then every block's experts in global order."""
        super().reset_parameters()
        for layer in self._moe_layers():
            layer.reset_parameters()


class MoEGPTTensorParallel(_RoutedModel, GPTTensorParallel):
    """:class:`MoEGPT` with attention, embedding and head split over ``tp_group``.

    Load a plain ``MoEGPT``'s full weights (every expert) with
    :meth:`load_full_weights`: each rank takes its TP pieces and its experts.

    Args:
        config: the model shape.
        tp_group: the tensor-parallel group.
        ep_group: the expert-parallel group (ranks of the same TP rank), or None.
    """

    config: MoEGPTConfig  # declared on the class itself: its two bases declare it differently

    def __init__(
        self,
        config: MoEGPTConfig,
        tp_group: dist.ProcessGroup,
        ep_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config, tp_group)
        mp_config = ModelParallelConfig(
            tensor_model_parallel_size=dist.get_world_size(tp_group), use_cpu_initialization=True
        )
        self.blocks = nn.ModuleList(
            MoEBlock(config, ep_group, TensorParallelAttention(config, mp_config, tp_group))
            for _ in range(config.n_layers)
        )
