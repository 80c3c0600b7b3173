"""Scale simulation: per-rank model-state bytes under mf's, FSDP2's and Megatron-FSDP's sharding.

For each model and data-parallel world size ``N`` it prints what one rank holds of
the model state, 16 bytes per parameter element (fp32 weight, fp32 grad, two fp32
Adam moments), under three ways of cutting the parameters into ``N`` shards:

- ``mf``: the real engine layout, ``mf_fsdp.plan_bucket_layouts`` on a meta-device
  model (per rank: the sum of ``layout.shard_size`` over the buckets; every shard
  boundary falls between two rows of a tensor, see [Note: row-aligned shards] in
  ``mf_fsdp.buckets.layout``);
- ``FSDP2``: torch's per-parameter rule, each parameter padded to a multiple of
  ``N`` dim-0 rows (per rank: ``ceil(rows / N) * row_numel`` summed over the
  parameters; a 0-d or 1-d tensor's rows are its elements);
- ``LCM``: Megatron-FSDP's rule, each bucket (one per FSDP unit, the parameters
  outside every unit forming the root bucket: mf's grouping) padded to a multiple
  of ``N x`` the LCM of the row sizes of its tensors (per rank: that over ``N``).

Each is set against the ideal ``16 * Psi / N`` (``Psi`` = parameter count).

How to read a table (one per model, a row per ``N``): ``ideal``, ``mf``, ``FSDP2``
and ``LCM`` are per-rank MiB; ``x mf``, ``x FSDP2`` and ``x LCM`` are each rule's
ratio to ideal (1.0000 = no padding at all); ``blk pad%`` and ``emb pad%`` are the
share of mf's block bucket(s) and of its embedding (root) bucket(s) that is
padding; ``bkt`` is the number of buckets mf cuts one block into at that ``N``
(more than one where splitting by row size saves more padding than a collective
costs, see ``mf_fsdp.partition_bucket``).

Models, all built on the meta device (no weights, no downloads): mf's GPT presets
``25m`` and ``150m`` (unit ``Block``, embeddings tied) and two Llama-3 shapes,
``llama3-8b`` and ``llama3-70b`` (unit ``LlamaDecoderLayer``, untied LM head). The
blocks of a model are identical, so each model is built with one block, its
layouts computed, and the block's bytes multiplied by the real layer count; the
header of each table shows the block and root parameter counts.

Run: ``uv run --no-sync python benchmarks/padding.py [--models 25m llama3-8b --worlds 8 1024]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mf.models import GPT, PRESETS, Block
from mf_fsdp import planning
from mf_fsdp.buckets.layout import BucketLayout, row_numel

BYTES_PER_ELEMENT = 16
"""fp32 weight + fp32 grad + two fp32 Adam moments."""

_MIB = 1 << 20

DEFAULT_WORLDS = (8, 64, 512, 1024)


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The sizes that fix a Llama-3 model's parameter shapes.

    Attributes:
        d_model: hidden size.
        ffn: MLP inner size.
        kv: key/value projection rows (kv heads x head dim).
        vocab: vocabulary size.
        n_layers: decoder layers.
    """

    d_model: int
    ffn: int
    kv: int
    vocab: int
    n_layers: int


LLAMA3_8B = LlamaShape(d_model=4096, ffn=14336, kv=1024, vocab=128256, n_layers=32)
LLAMA3_70B = LlamaShape(d_model=8192, ffn=28672, kv=1024, vocab=128256, n_layers=80)


class LlamaAttention(nn.Module):
    """Parameters of Llama's grouped-query attention (no forward: layout only)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        d, kv = shape.d_model, shape.kv
        self.q_proj = nn.Linear(d, d, bias=False)  # [d, d]
        self.k_proj = nn.Linear(d, kv, bias=False)  # [kv, d]
        self.v_proj = nn.Linear(d, kv, bias=False)  # [kv, d]
        self.o_proj = nn.Linear(d, d, bias=False)  # [d, d]


class LlamaMLP(nn.Module):
    """Parameters of Llama's SwiGLU MLP (no forward: layout only)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        d, ffn = shape.d_model, shape.ffn
        self.gate_proj = nn.Linear(d, ffn, bias=False)  # [ffn, d]
        self.up_proj = nn.Linear(d, ffn, bias=False)  # [ffn, d]
        self.down_proj = nn.Linear(ffn, d, bias=False)  # [d, ffn]


class LlamaDecoderLayer(nn.Module):
    """One Llama decoder layer's parameters, in Hugging Face's order (the FSDP unit)."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(shape)
        self.mlp = LlamaMLP(shape)
        self.input_layernorm = nn.RMSNorm(shape.d_model)  # [d]
        self.post_attention_layernorm = nn.RMSNorm(shape.d_model)  # [d]


class Llama(nn.Module):
    """A Llama-3-shaped model: embeddings, decoder layers, final norm, untied LM head."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab, shape.d_model)  # [vocab, d]
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape) for _ in range(shape.n_layers))
        self.norm = nn.RMSNorm(shape.d_model)  # [d]
        self.lm_head = nn.Linear(shape.d_model, shape.vocab, bias=False)  # [vocab, d]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How to build a model with a given number of blocks, and its FSDP unit.

    Attributes:
        build: makes the model with that many blocks (called under the meta device).
        n_layers: the real number of blocks.
        unit: the FSDP unit class (one block).
    """

    build: Callable[[int], nn.Module]
    n_layers: int
    unit: type[nn.Module]


def _gpt(preset: str) -> ModelSpec:
    config = PRESETS[preset]
    return ModelSpec(lambda n: GPT(dataclasses.replace(config, n_layers=n)), config.n_layers, Block)


def _llama(shape: LlamaShape) -> ModelSpec:
    return ModelSpec(
        lambda n: Llama(dataclasses.replace(shape, n_layers=n)), shape.n_layers, LlamaDecoderLayer
    )


MODELS: dict[str, ModelSpec] = {
    "25m": _gpt("25m"),
    "150m": _gpt("150m"),
    "llama3-8b": _llama(LLAMA3_8B),
    "llama3-70b": _llama(LLAMA3_70B),
}


@dataclass(frozen=True, slots=True)
class PartElements:
    """Per-rank elements of one part of a model (one block, or the root) under each rule.

    Attributes:
        numel: real elements of the part.
        world: number of ranks.
        mf: per-rank elements of mf's layout (sum of the buckets' shard sizes).
        fsdp2: per-rank elements under FSDP2's per-parameter rule.
        lcm: per-rank elements under Megatron-FSDP's LCM rule.
        buckets: how many buckets mf cuts the part into.
    """

    numel: int
    world: int
    mf: int
    fsdp2: int
    lcm: int
    buckets: int

    @property
    def mf_padding(self) -> float:
        """Share of mf's buckets for this part that is padding, in [0, 1)."""
        return 1.0 - self.numel / (self.mf * self.world) if self.mf else 0.0


@dataclass(frozen=True, slots=True)
class PaddingRow:
    """One model at one world size: per-rank model state under each rule.

    Attributes:
        model: the model's name in ``MODELS``.
        world: number of ranks ``N``.
        n_layers: number of (identical) blocks.
        block: one block's elements.
        root: the root (embedding) bucket's elements.
    """

    model: str
    world: int
    n_layers: int
    block: PartElements
    root: PartElements

    @property
    def params(self) -> int:
        """Parameter count ``Psi`` of the whole model."""
        return self.root.numel + self.n_layers * self.block.numel

    @property
    def ideal_bytes(self) -> float:
        """``16 * Psi / N``: the model state split evenly with no padding."""
        return BYTES_PER_ELEMENT * self.params / self.world

    def rule_bytes(self, rule: str) -> int:
        """Per-rank model-state bytes of the whole model under ``rule`` (mf, fsdp2 or lcm)."""
        if rule not in ("mf", "fsdp2", "lcm"):
            raise ValueError(f"rule must be 'mf', 'fsdp2' or 'lcm', got {rule!r}")
        elements = getattr(self.root, rule) + self.n_layers * getattr(self.block, rule)
        return BYTES_PER_ELEMENT * elements

    def ratio(self, rule: str) -> float:
        """``rule``'s per-rank bytes over the ideal."""
        return self.rule_bytes(rule) / self.ideal_bytes


def fsdp2_rank_numel(shapes: Sequence[Sequence[int]], world: int) -> int:
    """Per-rank elements when every tensor is padded to a multiple of ``world`` dim-0 rows."""
    total = 0
    for shape in shapes:
        rows = shape[0] if len(shape) > 1 else math.prod(shape)
        total += -(-rows // world) * row_numel(shape)
    return total


def lcm_rank_numel(shapes: Sequence[Sequence[int]], world: int) -> int:
    """Per-rank elements of one bucket padded to ``world x`` the LCM of its row sizes."""
    multiple = world * math.lcm(1, *(row_numel(shape) for shape in shapes))
    return -(-sum(math.prod(shape) for shape in shapes) // multiple) * multiple // world


def _part(layouts: list[BucketLayout], world: int) -> PartElements:
    shapes = [shape for layout in layouts for shape in layout.shapes]
    return PartElements(
        numel=sum(layout.numel for layout in layouts),
        world=world,
        mf=sum(layout.shard_size for layout in layouts),
        fsdp2=fsdp2_rank_numel(shapes, world),
        lcm=lcm_rank_numel(shapes, world),
        buckets=len(layouts),
    )


def padding_row(model: str, world: int) -> PaddingRow:
    """Per-rank model state of ``model`` at ``world`` ranks under each rule.

    The model is built with one block on the meta device; mf's buckets come from
    ``planning.plan_bucket_layouts`` and the other rules use the same grouping (one bucket
    per unit, the rest in the root).

    Raises:
        ValueError: for an unknown ``model`` or a non-positive ``world``.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)!r}, got {model!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    spec = MODELS[model]
    with torch.device("meta"):
        module = spec.build(1)
    plans = planning.plan_bucket_layouts(module, world, fsdp_unit_modules=[spec.unit])
    by_unit: dict[str, list[BucketLayout]] = {}
    for name, layout in plans:
        by_unit.setdefault(name, []).append(layout)
    root = by_unit.pop("", [])
    if len(by_unit) != 1:
        raise AssertionError(f"{model}: expected one block unit, got {sorted(by_unit)!r}")
    (block,) = by_unit.values()
    return PaddingRow(model, world, spec.n_layers, _part(block, world), _part(root, world))


def padding_table(model: str, worlds: Sequence[int] = DEFAULT_WORLDS) -> list[PaddingRow]:
    """``padding_row`` for each world size."""
    return [padding_row(model, world) for world in worlds]


_HEADER = (
    f"{'N':>5} {'ideal':>10} {'mf':>10} {'FSDP2':>10} {'LCM':>10} "
    f"{'x mf':>7} {'x FSDP2':>7} {'x LCM':>7} {'blk pad%':>8} {'emb pad%':>8} {'bkt':>3}"
)


def format_table(rows: Sequence[PaddingRow]) -> str:
    """One model's table: a title line, a header, and a row per world size (MiB per rank)."""
    first = rows[0]
    title = (
        f"{first.model}: {first.params / 1e6:,.1f}M params = root {first.root.numel / 1e6:,.1f}M"
        f" + {first.n_layers} x block {first.block.numel / 1e6:,.1f}M"
        "  (MiB per rank at 16 B/element)"
    )
    lines = [title, _HEADER, "-" * len(_HEADER)]
    for row in rows:
        mib = [row.ideal_bytes / _MIB] + [row.rule_bytes(r) / _MIB for r in ("mf", "fsdp2", "lcm")]
        ratios = [row.ratio(r) for r in ("mf", "fsdp2", "lcm")]
        lines.append(
            f"{row.world:>5} "
            + " ".join(f"{value:>10.2f}" for value in mib)
            + " "
            + " ".join(f"{value:>7.4f}" for value in ratios)
            + f" {100 * row.block.mf_padding:>8.3f} {100 * row.root.mf_padding:>8.3f}"
            + f" {row.block.buckets:>3}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print one table per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=list(MODELS), help="models"
    )
    parser.add_argument(
        "--worlds", nargs="+", type=int, default=list(DEFAULT_WORLDS), help="world sizes N"
    )
    args = parser.parse_args(argv)
    if any(world < 1 for world in args.worlds):
        parser.error(f"--worlds: expected positive ints, got {args.worlds!r}")
    print("\n\n".join(format_table(padding_table(m, args.worlds)) for m in args.models))


if __name__ == "__main__":
    main()
