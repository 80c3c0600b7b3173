"""Activation bytes of one micro-batch, measured by running the model on fake tensors.

[Note: activations are run, not estimated]
No formula for what a layer saves: the planned model is built and run. Under
torch's ``FakeTensorMode`` every tensor has a size, a dtype and a device but no
data, so a forward and a backward of a 150M-parameter model cost seconds and no
memory; torch's ``MemTracker`` watches that run and records, for the root
module, the peak of the forward and the peak of the backward. What is kept is
the bytes beyond the weights: activations saved for the backward, the
backward's temporaries (the logits' gradient, the gradients flowing between
layers) and the loss's own buffers.

The weights are the planned model's, built under a default dtype of the compute
dtype (bf16 weights, bf16 activations, as mf-fsdp's engine computes); each
weight's gradient is dropped as soon as it is accumulated, because the engine
moves gradients into its own buckets, which the model state and the gathered
window count (``mf.plan.phases``).

Depth: the model is run at one and at two layers, and the peaks are extended
linearly to the planned depth, ``peak(L) = peak(1) + (L - 1) * (peak(2) - peak(1))``.
This is exact for a stack of identical layers, as mf's GPT presets are: each
layer saves the same tensors, and both peaks fall outside the layers (at the
loss, and as the backward enters the last layer), so one more layer adds the
same bytes to each. A 70B model is planned from two layers, not eighty. The
tests check the extension against a run at full depth.

Activation checkpointing (``checkpointing``): each layer runs under torch's
non-reentrant ``checkpoint``, so it saves only its input and recomputes the
rest in the backward, one layer at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from mf.models import GPT, PRESETS
from mf.plan.meta_model import ModelSource

__all__ = ["Activations", "checkpoint_layers", "fake_peaks", "plan_activations"]


@dataclass(frozen=True, slots=True)
class Activations:
    """Bytes beyond the weights while one micro-batch runs (one rank, unsharded activations).

    Attributes:
        micro_batch: sequences per rank per micro-batch.
        seq_len: tokens per sequence on this rank.
        checkpointing: whether each layer recomputes its activations in the backward.
        forward_peak: the forward's peak (activations saved so far and the loss's buffers).
        backward_peak: the backward's peak (saved activations and the backward's temporaries).
        per_layer: what one more layer adds to the forward's peak.
    """

    micro_batch: int
    seq_len: int
    checkpointing: bool
    forward_peak: int
    backward_peak: int
    per_layer: int

    def as_dict(self) -> dict[str, int | bool]:
        """The fields, for JSON."""
        return asdict(self)


def checkpoint_layers(model: GPT) -> None:
    """Run each of ``model``'s layers under torch's non-reentrant activation checkpointing.

    The layer's ``forward`` is replaced on the instance, so hooks on the layer
    module (an FSDP engine's) still run around the checkpointed call.
    """
    for block in model.blocks:
        inner = block.forward

        def forward(
            x: torch.Tensor, inner: Callable[[torch.Tensor], torch.Tensor] = inner
        ) -> torch.Tensor:
            return checkpoint(inner, x, use_reentrant=False)

        block.forward = forward


_PEAK_STATES = ("Peak-Forward", "Peak-Backward")
"""MemTracker's names of the root module's two peak snapshots."""


def _peaks(
    depth_model: GPT, micro_batch: int, seq_len: int, checkpointing: bool
) -> tuple[int, int]:
    """(forward peak, backward peak) beyond the weights of one fake forward and backward."""
    if checkpointing:
        checkpoint_layers(depth_model)
    vocab = depth_model.config.vocab_size
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1))
    tracker = MemTracker()
    tracker.track_external(depth_model)
    with tracker:
        loss = depth_model(tokens[:, :-1], tokens[:, 1:])
        # Registered after the forward, when the tracker has hooked each weight to read its
        # gradient as it is accumulated: the tracker reads it, then it is dropped.
        for p in depth_model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        loss.backward()
    stats = tracker.memory_tracking[depth_model]
    weights = sum(p.numel() * p.element_size() for p in depth_model.parameters())
    weights += sum(b.numel() * b.element_size() for b in depth_model.buffers())
    forward, backward = (
        max(snap["Total"] for snap in stats.snapshots[state][-1].values()) - weights
        for state in _PEAK_STATES
    )
    return forward, backward


def _model_at_depth(source: ModelSource, layers: int, dtype: torch.dtype) -> GPT:
    config = dataclasses.replace(PRESETS[source.name], n_layers=layers)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = GPT(config)
    finally:
        torch.set_default_dtype(default)
    return model


def fake_peaks(
    source: ModelSource,
    layers: int,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str,
    checkpointing: bool,
) -> tuple[int, int]:
    """(forward peak, backward peak) beyond the weights of ``source`` (a preset) cut to ``layers``.

    One forward and backward on fake tensors, watched by MemTracker.
    """
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    with FakeTensorMode():
        return _peaks(_model_at_depth(source, layers, dtype), micro_batch, seq_len, checkpointing)


def plan_activations(
    source: ModelSource,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str,
    checkpointing: bool = False,
) -> Activations:
    """The activation peaks of one micro-batch of ``source`` (a preset) at its full depth.

    See [Note: activations are run, not estimated].

    Raises:
        ValueError: ``source`` is a folder (only presets are run so far), or
            ``seq_len`` exceeds the model's positions.
    """
    if source.folder is not None:
        raise ValueError("activations are planned for mf's presets only so far")
    positions = PRESETS[source.name].seq_len
    if not 0 < seq_len <= positions:
        raise ValueError(
            f"seq_len must be in [1, {positions}] (the {source.name!r} model's positions), "
            f"got {seq_len}"
        )
    one, two = (
        fake_peaks(
            source,
            depth,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=precision,
            checkpointing=checkpointing,
        )
        for depth in (1, 2)
    )
    extra = source.layers - 1
    return Activations(
        micro_batch=micro_batch,
        seq_len=seq_len,
        checkpointing=checkpointing,
        forward_peak=one[0] + extra * (two[0] - one[0]),
        backward_peak=one[1] + extra * (two[1] - one[1]),
        per_layer=two[0] - one[0],
    )
