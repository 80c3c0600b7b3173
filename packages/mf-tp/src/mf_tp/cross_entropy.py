"""Cross entropy over logits whose vocab dim is split across the TP group.

Responsibility: per-token loss and its gradient equal to
``torch.nn.functional.cross_entropy(full_logits, target, reduction="none",
label_smoothing=...)`` without ever gathering the ``[N, V]`` logits: only three
``[N]`` vectors are all-reduced (plus one max). Legend: ``N`` tokens (all
leading dims flattened), ``V`` full vocab, ``t`` the TP group size.

[Note: label smoothing] torch spreads ``eps`` over all ``V`` classes:
``loss = logZ - (1 - eps) z_target - eps * mean(z)`` for logits ``z`` shifted
by their max, and ``dloss/dz = softmax - (1 - eps) onehot - eps / V``. The
reference instead rescales ``eps`` by ``V / (V - 1)`` and averages the log
probabilities of the local shard only; we follow torch, which is the contract.

It must not: accept targets outside ``[0, V)`` (torch's ``ignore_index`` is not
supported, as in the reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mf_tp import _collectives as C
from mf_tp.embedding import check_index_range
from mf_tp.parallel_state import resolve_tp_group
from mf_tp.partition import VocabUtility

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]


class VocabParallelCrossEntropy:
    """The per-shard steps of vocab-parallel cross entropy (no collectives in here)."""

    @staticmethod
    def calculate_logits_max(
        vocab_parallel_logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the logits in fp32 and their local max over the vocab dim (``[N]``)."""
        logits = vocab_parallel_logits.float()
        return logits, logits.max(dim=-1).values

    @staticmethod
    def calculate_predicted_logits(
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        logits_max: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shift by the (global) max and read the target logits this shard owns.

        Args:
            vocab_parallel_logits: ``[N, V/t]`` fp32 logits of this shard.
            target: ``[N]`` global class ids.
            logits_max: ``[N]`` max over the full vocab.
            vocab_start_index: first id this shard owns.
            vocab_end_index: one past the last id this shard owns.

        Returns:
            ``(target_mask, masked_target_1d, predicted_logits, sum_exp_logits,
            exp_logits)``: True where another shard owns the target; local target
            ids (0 where masked); shifted target logits (0 where masked); local sums
            of ``exp``; ``exp`` of the shifted logits.
        """
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target_1d = (target - vocab_start_index).masked_fill(target_mask, 0).reshape(-1)
        rows = torch.arange(shifted.shape[0], device=shifted.device)
        predicted_logits = shifted[rows, masked_target_1d].masked_fill(target_mask.reshape(-1), 0)
        exp_logits = shifted.exp()
        return target_mask, masked_target_1d, predicted_logits, exp_logits.sum(-1), exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(
        exp_logits: torch.Tensor, predicted_logits: torch.Tensor, sum_exp_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(softmax [N, V/t], loss [N])`` from the globally summed statistics."""
        loss = sum_exp_logits.log() - predicted_logits
        return exp_logits / sum_exp_logits.unsqueeze(-1), loss

    @staticmethod
    def prepare_gradient_calculation_operands(
        softmax: torch.Tensor, target_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(grad_2d, arange_1d, softmax_update, grad_input)`` for the gradient step.

        ``grad_input`` is a copy of the softmax and ``grad_2d`` its ``[N, V/t]``
        view; ``softmax_update`` is 1 where this shard owns the target, else 0.
        """
        grad_input = softmax.clone()
        grad_2d = grad_input.view(-1, softmax.shape[-1])
        arange_1d = torch.arange(grad_2d.shape[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.reshape(-1).float()
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def calculate_gradients(
        grad_2d: torch.Tensor,
        arange_1d: torch.Tensor,
        masked_target_1d: torch.Tensor,
        softmax_update: torch.Tensor,
        grad_input: torch.Tensor,
        grad_output: torch.Tensor,
    ) -> torch.Tensor:
        """Subtract ``softmax_update`` at the targets and scale by ``grad_output`` ``[N]``."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.reshape(-1, 1))
        return grad_input


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocab-sharded logits.

    | pass     | input                               | output          | collective            |
    |----------|-------------------------------------|-----------------|-----------------------|
    | forward  | logits [N, V/t], target [N]         | loss [N]        | all-reduce max [N];   |
    |          |                                     |                 | all-reduce sum [3, N] |
    | backward | dloss [N]                           | dlogits [N,V/t] | none                  |
    """

    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        rank, world_size = C.world(group)
        partition_vocab = vocab_parallel_logits.shape[-1]
        vocab_size = partition_vocab * world_size
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(
            vocab_parallel_logits.reshape(-1, partition_vocab)
        )
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab, rank, world_size
        )
        target_1d = target.reshape(-1)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, target_1d, logits_max, start, end
            )
        )
        sum_logits = (logits - logits_max.unsqueeze(-1)).sum(-1)
        stats = C.all_reduce(torch.stack([predicted, sum_exp, sum_logits]), group, inplace=True)
        predicted, sum_exp, sum_logits = stats.unbind(0)
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted, sum_exp
        )
        if label_smoothing > 0:
            # [Note: label smoothing]
            loss = loss - label_smoothing * (sum_logits / vocab_size - predicted)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.logits_shape = vocab_parallel_logits.shape
        ctx.logits_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss.reshape(target.shape)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        smoothing = ctx.label_smoothing
        if smoothing > 0:
            softmax_update = softmax_update * (1.0 - smoothing)
            grad_2d -= smoothing / ctx.vocab_size
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_output.float()
        )
        return grad_input.reshape(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocab over ``group``.

    Equal in value and gradient to ``F.cross_entropy`` of the gathered logits
    with ``reduction="none"`` and the same ``label_smoothing``.

    Args:
        vocab_parallel_logits: ``[*, V/t]`` this rank's contiguous vocab block.
        target: ``[*]`` global class ids in ``[0, V)``.
        label_smoothing: in ``[0, 1]``.
        group: the TP group (default: the initialised one).

    Returns:
        ``[*]`` losses (fp32).

    Raises:
        ValueError: for mismatched shapes, an empty vocab shard, a target
            outside ``[0, V)`` or a smoothing outside ``[0, 1]``.
        TypeError: for non-integer targets.
    """
    where = "vocab_parallel_cross_entropy"
    group = resolve_tp_group(group)
    if vocab_parallel_logits.dim() == 0 or vocab_parallel_logits.shape[-1] == 0:
        raise ValueError(
            f"{where}: vocab_parallel_logits must be [*, V/t] with V/t > 0, "
            f"got shape {tuple(vocab_parallel_logits.shape)}"
        )
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise ValueError(
            f"{where}: target must have shape {tuple(vocab_parallel_logits.shape[:-1])} "
            f"(the logits without the vocab dim), got {tuple(target.shape)}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    vocab_size = vocab_parallel_logits.shape[-1] * dist.get_world_size(group)
    check_index_range(target, vocab_size, "target", where)
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, float(label_smoothing), group
    )
