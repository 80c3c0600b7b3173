"""A small decoder-only GPT in plain PyTorch.

It is the model mf trains, benchmarks and tests against: plain torch
modules (no mf imports), so the single-process run is an honest reference
for every sharded or tensor-parallel variant. ``Block`` is the natural FSDP
unit; the token embedding and the LM head share one weight when
``tie_embeddings`` is set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "PRESETS", "Block", "GPTConfig", "layer_drop"]


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape of a GPT model.

    Attributes:
        vocab_size: number of token ids.
        seq_len: longest sequence (size of the learned position table).
        d_model: hidden size; must divide by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        dropout: dropout probability after attention and MLP.
        tie_embeddings: share the token embedding with the LM head.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")

    def num_parameters(self) -> int:
        """Count the model's parameters (tied weights once) without building it."""
        d, v = self.d_model, self.vocab_size
        per_block = (
            2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        )
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.seq_len * d + self.n_layers * per_block + 2 * d + head


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "small": GPTConfig(vocab_size=256, seq_len=256, d_model=256, n_layers=4, n_heads=4),
    "25m": GPTConfig(vocab_size=8192, seq_len=256, d_model=512, n_layers=7, n_heads=8),
    "150m": GPTConfig(vocab_size=32768, seq_len=512, d_model=896, n_layers=12, n_heads=14),
    "880m": GPTConfig(vocab_size=32768, seq_len=2048, d_model=2048, n_layers=16, n_heads=16),
    "4b": GPTConfig(vocab_size=32768, seq_len=2048, d_model=4096, n_layers=20, n_heads=32),
    # Long sequences, small everything else: attention's share of the work and activations
    # grows with the length, which context parallelism splits (mf-bench --cp).
    "long": GPTConfig(vocab_size=256, seq_len=8192, d_model=128, n_layers=2, n_heads=4),
}


def token_positions(
    config: GPTConfig, tokens: torch.Tensor, positions: torch.Tensor | None, caller: str
) -> torch.Tensor:
    """The position of each token of ``tokens`` [B, S]: ``positions``, or ``0 .. S-1``.

    A context-parallel rank holds ``S / N`` positions of each sequence, not the
    first ones (see ``mf_tp.context_parallel``), so it passes them in, ``[S]``
    for every sequence alike or ``[B, S]``.

    Raises:
        ValueError: if ``S`` exceeds ``config.seq_len``, or ``positions`` is not
            an integer tensor of shape ``[S]`` or ``[B, S]``.
    """
    seq = tokens.shape[1]
    if seq > config.seq_len:
        raise ValueError(
            f"{caller}: tokens has {seq} positions, the model takes at most {config.seq_len}"
        )
    if positions is None:
        return torch.arange(seq, device=tokens.device)
    if positions.is_floating_point() or tuple(positions.shape) not in ((seq,), tuple(tokens.shape)):
        raise ValueError(
            f"{caller}: positions must be integers of shape ({seq},) or {tuple(tokens.shape)}, "
            f"one per token, got {positions.dtype} of shape {tuple(positions.shape)}"
        )
    return positions


def layer_drop(
    blocks: nn.ModuleList, rate: float, generator: torch.Generator | None
) -> list[nn.Module]:
    """The blocks a training forward runs under LayerDrop: each skipped with probability ``rate``.

    LayerDrop (Fan et al., 2019) regularises depth by skipping whole blocks at
    random while training. The draws are on the CPU ``generator`` (no device
    sync); seeded per rank, different ranks skip different blocks, which an
    FSDP engine must handle (mf-fsdp does: see docs/rank-paths.md).
    """
    keep = torch.rand(len(blocks), generator=generator).ge(rate).tolist()
    return [block for block, kept in zip(blocks, keep, strict=True) if kept]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions: [B, S, D] -> [B, S, D]."""
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.out = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block: [B, S, D] -> [B, S, D]."""
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """Token + position embedding, ``n_layers`` blocks, final norm and LM head.

    Args:
        config: the model shape.
        block: builds each block from the config (``Block``; the MoE GPT's differ).

    Attributes:
        layer_drop: LayerDrop rate in training (0: every block runs; see ``layer_drop``).
        layer_drop_generator: the CPU generator its draws come from (None: torch's default).
    """

    layer_drop: float = 0.0
    layer_drop_generator: torch.Generator | None = None

    def __init__(self, config: GPTConfig, block: Callable[[GPTConfig], nn.Module] = Block) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.device.type == "meta" or self._initialises_itself(name):
                continue
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif "ln" in name:
                nn.init.ones_(param)
            elif name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=0.02)

    def _initialises_itself(self, name: str) -> bool:
        """Whether parameter ``name`` is left to its own module's init (none here)."""
        return False

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return logits [B, S, V], or the mean cross-entropy loss when ``targets`` are given.

        ``positions`` ([S] or [B, S]) are the tokens' places in their sequences,
        ``0 .. S-1`` when None; under context parallelism, this rank's share.
        """
        positions = token_positions(self.config, tokens, positions, "GPT.forward")
        x = self.wte(tokens) + self.wpe(positions)
        blocks: Iterable[nn.Module] = self.blocks
        if self.training and self.layer_drop > 0:
            blocks = layer_drop(self.blocks, self.layer_drop, self.layer_drop_generator)
        for block in blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
