"""model_parallel_cuda_manual_seed: the reference seed arithmetic in-process,
and dropout masks compared across real gloo ranks.

Masks are compared bitwise: they come straight from the generators.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mf_rng import (
    InferenceRNGStatesTracker,
    get_context_parallel_rng_tracker_name,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_model_and_context_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
    register_model_parallel_group,
    registered_model_parallel_rank,
)
from tests._multiprocess import cpu_mesh, run_on_ranks

SEED = 1234
DROPOUT_P = 0.5
MASK_NUMEL = 256


def _fresh_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


@pytest.mark.parametrize(
    ("seed", "tp_rank", "ep_rank", "etp_rank"),
    [(0, 0, 0, 0), (1234, 1, 0, 0), (42, 3, 2, 1), (7, 0, 5, 3), (2**40, 7, 1, 0)],
)
def test_reference_seed_arithmetic(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)
    states = get_cuda_rng_tracker().get_states()
    assert set(states) == {
        get_data_parallel_rng_tracker_name(),
        get_model_parallel_rng_tracker_name(),
        get_expert_parallel_rng_tracker_name(),
    }
    expected = {
        get_data_parallel_rng_tracker_name(): seed,
        get_model_parallel_rng_tracker_name(): seed + 2718 + tp_rank,
        get_expert_parallel_rng_tracker_name(): seed + 1024 + 100 * ep_rank + etp_rank,
    }
    for name, derived in expected.items():
        assert torch.equal(states[name], _fresh_state(derived)), name
    # The default generator of the device in use is seeded with the plain seed.
    assert torch.equal(torch.get_rng_state(), _fresh_state(seed))


def test_ranks_default_to_zero_without_registered_groups() -> None:
    assert registered_model_parallel_rank("tp") == 0
    model_parallel_manual_seed(SEED)
    states = get_cuda_rng_tracker().get_states()
    assert torch.equal(states[get_model_parallel_rng_tracker_name()], _fresh_state(SEED + 2718))
    assert torch.equal(states[get_expert_parallel_rng_tracker_name()], _fresh_state(SEED + 1024))


def test_reseeding_replaces_the_states() -> None:
    model_parallel_cuda_manual_seed(SEED, tp_rank=0)
    tracker = get_cuda_rng_tracker()
    model_parallel_cuda_manual_seed(SEED + 1, tp_rank=1)  # no duplicate-seed error: reset first
    assert get_cuda_rng_tracker() is tracker
    states = tracker.get_states()
    assert torch.equal(states[get_model_parallel_rng_tracker_name()], _fresh_state(SEED + 2720))


def test_force_reset_and_inference_flavour() -> None:
    model_parallel_cuda_manual_seed(SEED)
    model_parallel_cuda_manual_seed(
        SEED, inference_rng_tracker=True, force_reset_rng=True, device="cpu"
    )
    tracker = get_cuda_rng_tracker()
    assert isinstance(tracker, InferenceRNGStatesTracker)
    assert not tracker.is_initialized()
    assert torch.equal(torch.get_rng_state(), _fresh_state(SEED))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tp_rank": -1}, ValueError, r"tp_rank must be non-negative, got -1"),
        ({"ep_rank": 1.0}, TypeError, r"ep_rank must be an int or None, got 1\.0"),
        ({"etp_rank": True}, TypeError, r"etp_rank must be an int or None, got True"),
        # 100 * 0 + 1694 + 1024 == 2718 + 0: the expert seed would repeat the TP seed.
        (
            {"tp_rank": 0, "etp_rank": 1694},
            ValueError,
            r"derived seeds .*'model-parallel-rng': 3952, 'expert-parallel-rng': 3952\} collide",
        ),
    ],
)
def test_bad_ranks_raise(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        model_parallel_cuda_manual_seed(SEED, **kwargs)  # type: ignore[arg-type]


def test_bad_seed_raises_and_leaves_the_tracker_untouched() -> None:
    with pytest.raises(TypeError, match=r"model_parallel_cuda_manual_seed: seed must be an int"):
        model_parallel_cuda_manual_seed("1")  # type: ignore[arg-type]
    model_parallel_cuda_manual_seed(SEED)
    before = get_cuda_rng_tracker().get_states()
    with pytest.raises(ValueError, match=r"\(model-parallel-rng\): seed must lie in"):
        model_parallel_cuda_manual_seed(2**64 - 2)
    after = get_cuda_rng_tracker().get_states()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_register_rejects_bad_input() -> None:
    with pytest.raises(
        ValueError, match=r"axis must be one of \('tp', 'ep', 'etp', 'cp'\), got 'dp'"
    ):
        register_model_parallel_group("dp", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"group must be a ProcessGroup or None, got 3"):
        register_model_parallel_group("tp", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"axis must be one of"):
        registered_model_parallel_rank("pp")  # type: ignore[arg-type]


def _masks(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dropout mask inside fork(name), dropout mask outside any fork)."""
    ones = torch.ones(MASK_NUMEL)
    with get_cuda_rng_tracker().fork(name):
        inside = F.dropout(ones, DROPOUT_P)
    outside = F.dropout(ones, DROPOUT_P)
    return inside, outside


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


def _expected_mask(seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return F.dropout(torch.ones(MASK_NUMEL), DROPOUT_P)


def _rank_two_tp_ranks(rank: int, world_size: int) -> None:
    initialize_rng_tracker(device="cpu")
    tp_group = dist.new_group(list(range(world_size)))
    register_model_parallel_group("tp", tp_group)
    register_model_parallel_group("ep", tp_group)
    assert registered_model_parallel_rank("tp") == rank
    model_parallel_cuda_manual_seed(SEED)  # ranks from the registered groups

    tp_inside, tp_outside = _masks(get_model_parallel_rng_tracker_name())
    ep_inside, _ = _masks(get_expert_parallel_rng_tracker_name())
    dp_inside, _ = _masks(get_data_parallel_rng_tracker_name())

    # Each stream is the reference's: a fresh generator with the derived seed.
    assert torch.equal(tp_inside, _expected_mask(SEED + 2718 + rank))
    assert torch.equal(ep_inside, _expected_mask(SEED + 1024 + 100 * rank))
    assert torch.equal(dp_inside, _expected_mask(SEED))
    assert torch.equal(tp_outside, _expected_mask(SEED))

    tp_all, out_all = _gather(tp_inside), _gather(tp_outside)
    ep_all, dp_all = _gather(ep_inside), _gather(dp_inside)
    assert not torch.equal(tp_all[0], tp_all[1]), "dropout inside fork() must differ across TP"
    assert not torch.equal(ep_all[0], ep_all[1]), "expert dropout must differ across EP"
    assert torch.equal(out_all[0], out_all[1]), "dropout outside fork() must match across TP"
    assert torch.equal(dp_all[0], dp_all[1]), "the data-parallel state must match everywhere"

    # Explicit ranks override the registered groups.
    model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0)
    tp_inside, _ = _masks(get_model_parallel_rng_tracker_name())
    same = _gather(tp_inside)
    assert torch.equal(same[0], same[1])


@pytest.mark.multiprocess
def test_dropout_across_two_tp_ranks() -> None:
    run_on_ranks(_rank_two_tp_ranks, 2)


def _rank_dp_by_tp(rank: int, world_size: int) -> None:
    initialize_rng_tracker(device="cpu")
    mesh = cpu_mesh((2, 2), ("dp", "tp"))
    register_model_parallel_group("tp", mesh.get_group("tp"))
    model_parallel_cuda_manual_seed(SEED)
    dp_rank, tp_rank = divmod(rank, 2)
    assert (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")) == (dp_rank, tp_rank)
    assert registered_model_parallel_rank("tp") == tp_rank

    inside, outside = _masks(get_model_parallel_rng_tracker_name())
    inside_all, outside_all = _gather(inside), _gather(outside)
    for other in range(world_size):
        same_tp = other % 2 == tp_rank
        assert torch.equal(inside_all[other], inside) == same_tp, (rank, other)
        assert torch.equal(outside_all[other], outside)


@pytest.mark.multiprocess
def test_dropout_identical_across_dp_ranks_with_equal_tp_rank() -> None:
    run_on_ranks(_rank_dp_by_tp, 4)


# --- context parallelism: [Note: dropout under context parallelism] in mf_rng.seeding -----------


@pytest.mark.parametrize(("seed", "tp_rank", "cp_rank"), [(0, 0, 0), (1234, 1, 3), (2**40, 7, 1)])
def test_context_parallel_states_add_to_the_reference_ones(
    seed: int, tp_rank: int, cp_rank: int
) -> None:
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank)
    reference = get_cuda_rng_tracker().get_states()
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, cp_rank=cp_rank)
    states = get_cuda_rng_tracker().get_states()
    for name, state in reference.items():
        assert torch.equal(states[name], state), f"cp changed the reference's {name}"
    cp_offset = 65536 * (1 + cp_rank)
    added = {
        get_context_parallel_rng_tracker_name(): seed + cp_offset,
        get_model_and_context_parallel_rng_tracker_name(): seed + 2718 + tp_rank + cp_offset,
    }
    assert set(states) == set(reference) | set(added)
    for name, derived in added.items():
        assert torch.equal(states[name], _fresh_state(derived)), name


def test_without_context_parallelism_the_tracker_is_the_references() -> None:
    model_parallel_cuda_manual_seed(SEED)
    assert get_context_parallel_rng_tracker_name() not in get_cuda_rng_tracker().get_states()
    fork = get_cuda_rng_tracker().fork(get_context_parallel_rng_tracker_name())
    with pytest.raises(ValueError, match=r"no RNG state named 'context-parallel-rng'"), fork:
        pass
    with pytest.raises(ValueError, match=r"cp_rank must be non-negative, got -1"):
        model_parallel_cuda_manual_seed(SEED, cp_rank=-1)


def _rank_tp_by_cp(rank: int, world_size: int) -> None:
    initialize_rng_tracker(device="cpu")
    mesh = cpu_mesh((2, 2), ("cp", "tp"))
    cp_rank, tp_rank = divmod(rank, 2)
    # A cp group of one rank leaves context parallelism off: the reference's states only.
    singles = [dist.new_group([r]) for r in range(world_size)]
    register_model_parallel_group("cp", singles[rank])
    model_parallel_cuda_manual_seed(SEED)
    assert get_context_parallel_rng_tracker_name() not in get_cuda_rng_tracker().get_states()

    register_model_parallel_group("tp", mesh.get_group("tp"))
    register_model_parallel_group("cp", mesh.get_group("cp"))
    model_parallel_cuda_manual_seed(SEED)
    assert registered_model_parallel_rank("cp") == cp_rank

    names = {
        "cp": get_context_parallel_rng_tracker_name(),
        "tp x cp": get_model_and_context_parallel_rng_tracker_name(),
        "tp": get_model_parallel_rng_tracker_name(),
        "dp": get_data_parallel_rng_tracker_name(),
    }
    masks = {what: _masks(name)[0] for what, name in names.items()}
    _, default = _masks(names["dp"])
    seeds = {
        "cp": SEED + 65536 * (1 + cp_rank),
        "tp x cp": SEED + 2718 + tp_rank + 65536 * (1 + cp_rank),
        "tp": SEED + 2718 + tp_rank,
        "dp": SEED,
    }
    for what, mask in masks.items():
        assert torch.equal(mask, _expected_mask(seeds[what])), what
    # Which peers draw alike: (same cp rank, same tp rank) -> equal?
    alike = {
        "cp": lambda c, t: c == cp_rank,  # tp peers hold the same activations
        "tp x cp": lambda c, t: c == cp_rank and t == tp_rank,
        "tp": lambda c, t: t == tp_rank,  # the reference: cp peers share it (weights init)
        "dp": lambda c, t: True,
        "default": lambda c, t: True,  # the reference: cp peers share the default generator
    }
    for what, mask in [*masks.items(), ("default", default)]:
        for other, theirs in enumerate(_gather(mask)):
            c, t = divmod(other, 2)
            assert torch.equal(theirs, mask) == alike[what](c, t), (what, rank, other)


@pytest.mark.multiprocess
def test_dropout_streams_over_tp_by_cp() -> None:
    run_on_ranks(_rank_tp_by_cp, 4, timeout=120)
