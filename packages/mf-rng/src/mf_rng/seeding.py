"""Seed the process-wide tracker for data, tensor and expert parallelism.

The seed arithmetic is the reference's, so runs are reproducible against it:

* the device's default generator and the data-parallel state get ``seed``
  (equal on every rank: use it for anything that must match across ranks);
* the model-parallel state gets ``seed + 2718 + tp_rank`` (distinct per
  tensor-parallel rank: dropout on tensor-parallel shards);
* the expert-parallel state gets ``seed + 1024 + 100 * ep_rank + etp_rank``;
* while context parallelism is on, two more states (see [Note: dropout under
  context parallelism]).

Ranks come from the caller, or from process groups registered with
:func:`register_model_parallel_group` (mf-tp registers its groups there, so
mf-rng never imports mf-tp), or are 0 when nothing is registered.

[Note: dropout under context parallelism] The reference gives the ranks of a
context-parallel (cp) group the same default generator and the same data-,
model- and expert-parallel states: its seed counts pipeline stages and,
optionally, data-parallel ranks without cp, and no state depends on a cp
rank. That is right for whatever must agree over the cp group: the weights
are replicated over it, so their initialisation must draw alike. It is wrong
for dropout on the activations cp splits: every cp rank then draws the same
mask for different tokens of one sequence (token ``i`` of each rank's shard
shares its mask), where one process draws independent ones. mf keeps the
reference's states as they are and, while cp is on, adds:

* ``context-parallel-rng``: ``seed + 65536 * (1 + cp_rank)``, equal on the
  tensor-parallel ranks of a cp rank (they hold the same activations), for
  dropout on hidden states outside a sequence-parallel region;
* ``model-and-context-parallel-rng``: ``seed + 2718 + tp_rank + 65536 * (1 +
  cp_rank)``, distinct on every (tp, cp) rank, for dropout on activations split
  by both (attention heads, sequence-parallel hidden states).

Both are equal across data-parallel ranks, as the reference's model-parallel
state is. The 65536 stride keeps them clear of the reference's seeds (tp ranks
and expert offsets below it). With cp off nothing is added, so the tracker,
and the states a checkpoint saves, are the reference's.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from mf_rng.default_tracker import get_cuda_rng_tracker, initialize_rng_tracker
from mf_rng.device_state import check_seed, seed_device
from mf_rng.tracker import (
    get_context_parallel_rng_tracker_name,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_model_and_context_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
)

__all__ = [
    "ParallelAxis",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "register_model_parallel_group",
    "registered_model_parallel_rank",
]

ParallelAxis = Literal["tp", "ep", "etp", "cp"]
"""Which rank a registered group gives: tensor-, expert-, expert-tensor- or context-parallel."""

_AXES: tuple[str, ...] = ("tp", "ep", "etp", "cp")
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024
_EXPERT_RANK_STRIDE = 100
_CP_RANK_STRIDE = 65536

_groups: dict[str, dist.ProcessGroup] = {}


def _check_axis(axis: str, where: str) -> None:
    if axis not in _AXES:
        raise ValueError(f"{where}: axis must be one of {_AXES}, got {axis!r}")


def register_model_parallel_group(axis: ParallelAxis, group: dist.ProcessGroup | None) -> None:
    """Make ``group``'s rank the default ``axis`` rank of :func:`model_parallel_cuda_manual_seed`.

    ``None`` unregisters the axis (its rank defaults to 0 again). The rank is
    read from the group at seeding time, not now.

    Raises:
        ValueError: if ``axis`` is not ``"tp"``, ``"ep"`` or ``"etp"``.
        TypeError: if ``group`` is neither a ProcessGroup nor None.
    """
    _check_axis(axis, "register_model_parallel_group")
    if group is None:
        _groups.pop(axis, None)
        return
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"register_model_parallel_group: group must be a ProcessGroup or None, got {group!r}"
        )
    _groups[axis] = group


def registered_model_parallel_rank(axis: ParallelAxis) -> int:
    """Return this process's rank in the group registered for ``axis``, or 0 if none is.

    Raises:
        ValueError: if ``axis`` is unknown.
        RuntimeError: if this process is not a member of the registered group.
    """
    _check_axis(axis, "registered_model_parallel_rank")
    group = _groups.get(axis)
    if group is None:
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(
            f"registered_model_parallel_rank: this process (global rank {dist.get_rank()}) "
            f"is not a member of the group registered for axis {axis!r}"
        )
    return rank


def _resolve_rank(rank: int | None, axis: ParallelAxis) -> int:
    if rank is None:
        return registered_model_parallel_rank(axis)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{axis}_rank must be an int or None, got {rank!r}")
    if rank < 0:
        raise ValueError(f"{axis}_rank must be non-negative, got {rank!r}")
    return rank


def _resolve_cp_rank(cp_rank: int | None) -> int | None:
    """The cp rank while context parallelism is on, else None.

    On: ``cp_rank`` is given, or a ``"cp"`` group of more than one rank is registered.
    """
    if cp_rank is None:
        group = _groups.get("cp")
        if group is None or dist.get_world_size(group) == 1:
            return None
    return _resolve_rank(cp_rank, "cp")


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    cp_rank: int | None = None,
    force_reset_rng: bool = False,
    device: torch.device | str | int | None = None,
) -> None:
    """Seed the device generator and the process-wide tracker for model parallelism.

    Call it once after the parallel groups exist and before building the
    model, with the same ``seed`` on every rank.

    Args:
        seed: the run's seed; the default generator of the tracker's device
            and the data-parallel state get it unchanged.
        te_rng_tracker: create TE's tracker if none exists yet.
        inference_rng_tracker: create the no-op inference tracker if none exists yet.
        use_cudagraphable_rng: create a graph-safe tracker if none exists yet.
        tp_rank: tensor-parallel rank; default: the registered ``"tp"`` group's, else 0.
        ep_rank: expert-parallel rank; default: the registered ``"ep"`` group's, else 0.
        etp_rank: expert-tensor-parallel rank; default: the ``"etp"`` group's, else 0.
        cp_rank: context-parallel rank; giving it, or registering a ``"cp"``
            group of more than one rank, adds the two context-parallel states
            (see [Note: dropout under context parallelism]); otherwise there are none.
        force_reset_rng: replace the existing tracker with a new one of the
            requested flavour.
        device: the device of a tracker created here (see
            :func:`initialize_rng_tracker`); an existing tracker keeps its own.

    Raises:
        TypeError: for a seed or rank that is not an int.
        ValueError: for a seed outside torch's range, a negative rank, or
            derived seeds that coincide (ranks beyond the reference's ranges,
            e.g. ``etp_rank >= 100``) or leave torch's seed range; the tracker
            is left untouched then.
    """
    check_seed(seed, "model_parallel_cuda_manual_seed")
    tp_rank = _resolve_rank(tp_rank, "tp")
    ep_rank = _resolve_rank(ep_rank, "ep")
    etp_rank = _resolve_rank(etp_rank, "etp")
    cp_rank = _resolve_cp_rank(cp_rank)
    initialize_rng_tracker(
        te_rng_tracker,
        inference_rng_tracker,
        use_cudagraphable_rng,
        force_reset=force_reset_rng,
        device=device,
    )
    derived = {
        get_data_parallel_rng_tracker_name(): seed,
        get_model_parallel_rng_tracker_name(): seed + _TP_SEED_OFFSET + tp_rank,
        get_expert_parallel_rng_tracker_name(): (
            seed + _EXPERT_SEED_OFFSET + _EXPERT_RANK_STRIDE * ep_rank + etp_rank
        ),
    }
    if cp_rank is not None:
        cp_offset = _CP_RANK_STRIDE * (1 + cp_rank)
        derived[get_context_parallel_rng_tracker_name()] = seed + cp_offset
        derived[get_model_and_context_parallel_rng_tracker_name()] = (
            seed + _TP_SEED_OFFSET + tp_rank + cp_offset
        )
    if len(set(derived.values())) != len(derived):
        raise ValueError(
            f"model_parallel_cuda_manual_seed: the derived seeds {derived} collide for "
            f"tp_rank={tp_rank}, ep_rank={ep_rank}, etp_rank={etp_rank}, cp_rank={cp_rank}; "
            "the reference arithmetic needs etp_rank < 100 and tp_rank, ep_rank small enough "
            "to stay apart"
        )
    for name, derived_seed in derived.items():
        check_seed(derived_seed, f"model_parallel_cuda_manual_seed ({name})")
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    seed_device(seed, tracker.device)
    for name, derived_seed in derived.items():
        tracker.add(name, derived_seed)


model_parallel_manual_seed = model_parallel_cuda_manual_seed
"""Device-neutral name of :func:`model_parallel_cuda_manual_seed`."""
