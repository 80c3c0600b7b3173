"""VocabParallelEmbedding: an embedding table split along the vocabulary.

Responsibility: look up token ids in this rank's vocab rows, zero the rows of
ids owned by other ranks, and sum (or reduce-scatter along the sequence) over
the TP group. Legend: ``B`` batch, ``S`` sequence, ``H`` embedding dim, ``V``
vocab, ``t`` the TP group size.

It must not: accept ids outside ``[0, V)`` (they would silently embed to zero).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mf_tp.config import ModelParallelConfig
from mf_tp.init import allocate_sharded_weight
from mf_tp.layer_checks import check_config_tp_size, check_positive_size, per_partition_size
from mf_tp.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mf_tp.parallel_state import resolve_tp_group
from mf_tp.partition import VocabUtility
from mf_utils import get_group_device

__all__ = ["VocabParallelEmbedding", "check_index_range"]


def check_index_range(index: torch.Tensor, size: int, argument: str, where: str) -> None:
    """Raise ValueError unless every entry of the integer tensor ``index`` is in ``[0, size)``.

    Reads the min and max back to the host (one sync on an accelerator).
    """
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(f"{where}: {argument} must be an integer tensor, got dtype {index.dtype}")
    if index.numel() == 0:
        return
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= size:
        raise ValueError(
            f"{where}: {argument} must lie in [0, {size}), got values in [{low}, {high}]"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose ``[V, H]`` table is split into ``[V/t, H]`` row blocks.

    Input ids ``[B, S]``; output ``[B, S, H]``, or ``[S/t, B, H]`` with
    ``reduce_scatter_embeddings`` (the sequence-parallel layout: transposed to
    sequence-first, then reduce-scattered along the sequence).

    Args:
        num_embeddings: vocabulary size ``V`` (divisible by the TP size).
        embedding_dim: ``H``.
        init_method: fills the full master table in place.
        reduce_scatter_embeddings: reduce-scatter instead of all-reduce.
        config: ``params_dtype`` and the initialisation options.
        tp_group: the TP group (default: the initialised one).

    Raises:
        TypeError: if ``config`` is not a ``ModelParallelConfig``.
        ValueError: if ``num_embeddings`` or ``embedding_dim`` is not a positive
            int, ``num_embeddings`` is not divisible by the TP size, or
            ``config.tensor_model_parallel_size`` is not the size of ``tp_group``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable[[torch.Tensor], object],
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        where = "VocabParallelEmbedding"
        self.num_embeddings = check_positive_size(num_embeddings, "num_embeddings", where)
        self.embedding_dim = check_positive_size(embedding_dim, "embedding_dim", where)
        if not isinstance(config, ModelParallelConfig):
            raise TypeError(f"{where}: config must be a ModelParallelConfig, got {config!r}")
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = resolve_tp_group(tp_group)
        self.tp_rank = dist.get_rank(self.tp_group)
        self.tp_size = dist.get_world_size(self.tp_group)
        check_config_tp_size(config, self.tp_size, where)
        self.num_embeddings_per_partition = per_partition_size(
            num_embeddings, self.tp_size, "num_embeddings", where
        )
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(
                num_embeddings, self.tp_rank, self.tp_size
            )
        )
        self.weight, _ = allocate_sharded_weight(
            (self.num_embeddings_per_partition, embedding_dim),
            (num_embeddings, embedding_dim),
            0,
            config=config,
            init_method=init_method,
            stride=1,
            rank=self.tp_rank,
            world_size=self.tp_size,
            device=get_group_device(self.tp_group),
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embed ``input_`` ids; see the class docstring for the output layout.

        Raises:
            TypeError, ValueError: for non-integer ids or ids outside ``[0, V)``.
        """
        check_index_range(input_, self.num_embeddings, "input_", "VocabParallelEmbedding")
        if self.tp_size > 1:
            foreign = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(foreign, 0)
            output_parallel = F.embedding(local_ids, self.weight)
            output_parallel = output_parallel.masked_fill(foreign.unsqueeze(-1), 0.0)
        else:
            output_parallel = F.embedding(input_, self.weight)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [S, B, H]
            return reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)
