"""Each context-parallel rank's share of its data-parallel rank's sequences.

Under ``--cp N`` the N ranks of a data-parallel rank load the same batch
(``--micro-batch`` sequences, as one rank would without CP); inside
:func:`sequence_shards` each holds its ``S / N`` positions of every sequence
(``mf_tp.context_parallel``'s head-tail chunks) and the model, given those
positions, attends over the whole sequence. Each rank's loss is then the
sum of its positions' token losses over the global batch's count
(``mf.train.rank.step``), so the ranks' shares add up to the global mean.

It must not: change the batch without CP (``--cp 1`` runs exactly as before).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import DeviceMesh

import mf_tp

__all__ = ["sequence_shards"]


@contextmanager
def sequence_shards(
    cp_mesh: DeviceMesh | None,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    packed: torch.Tensor | None = None,
) -> Iterator[torch.Tensor | None]:
    """Shard ``inputs`` and ``targets`` [B, S] over ``cp_mesh``; yield this rank's positions.

    Run the forward and backward inside. Without a cp mesh, or with one rank in
    it, it yields None (the model's own positions), or the positions [B, S] of
    ``packed`` rows (``mf.train.data.packing``), and shards nothing.

    Raises:
        ValueError: packed rows under more than one cp rank (the launcher refuses
            the run first: ``mf.train.data.run_data``).
    """
    if cp_mesh is None or cp_mesh.size() == 1:
        yield packed
        return
    if packed is not None:
        raise ValueError("--cp does not serve packed examples; pass --no-pack")
    positions = torch.arange(inputs.shape[1], device=inputs.device)
    buffers = [inputs, targets, positions]
    with mf_tp.context_parallel(
        cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)
    ):
        yield positions
