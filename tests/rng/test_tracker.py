"""RNGStatesTracker and the inference tracker, in-process.

Every equality here is bitwise (``torch.equal``): forking only moves generator
states around, no arithmetic happens that could round differently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mf_rng import (
    CudaRNGStatesTracker,
    InferenceRNGStatesTracker,
    RNGStatesTracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
)

seeds = st.integers(min_value=0, max_value=2**63 - 1)


def _fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=25, deadline=None)
@given(seed=seeds, default_seed=seeds)
def test_fork_draws_what_a_fresh_generator_with_that_seed_draws(
    seed: int, default_seed: int
) -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("stream", seed)
    torch.manual_seed(default_seed)
    with tracker.fork("stream"):
        uniform, normal, ints = torch.rand(7), torch.randn(5), torch.randint(0, 1000, (6,))
    reference = _fresh(seed)
    assert torch.equal(uniform, torch.rand(7, generator=reference))
    assert torch.equal(normal, torch.randn(5, generator=reference))
    assert torch.equal(ints, torch.randint(0, 1000, (6,), generator=reference))


def test_fork_dropout_mask_equals_dropout_under_that_seed() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("stream", 31)
    with tracker.fork("stream"):
        mask = F.dropout(torch.ones(64), 0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(31)
        assert torch.equal(mask, F.dropout(torch.ones(64), 0.5))


def test_default_state_is_unchanged_by_a_fork() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("stream", 3)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    with tracker.fork("stream"):
        torch.randn(100)
    assert torch.equal(torch.get_rng_state(), before)
    after_fork = torch.randn(10)
    torch.manual_seed(11)
    assert torch.equal(after_fork, torch.randn(10))


def test_default_state_is_restored_when_the_block_raises() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("stream", 3)
    before = torch.get_rng_state()

    def draw_then_fail() -> None:
        with tracker.fork("stream"):
            torch.rand(4)
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        draw_then_fail()
    assert torch.equal(torch.get_rng_state(), before)
    # The draws made before the error still advanced the named stream.
    with tracker.fork("stream"):
        next_draw = torch.rand(4)
    reference = _fresh(3)
    torch.rand(4, generator=reference)
    assert torch.equal(next_draw, torch.rand(4, generator=reference))


def test_states_advance_across_forks_and_streams_are_independent() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("a", 100)
    tracker.add("b", 200)
    with tracker.fork("a"):
        a1 = torch.rand(5)
    with tracker.fork("b"):
        b1 = torch.rand(5)
    with tracker.fork("a"):
        a2 = torch.rand(5)
        with tracker.fork("b"):  # nesting different names works
            b2 = torch.rand(5)
        a3 = torch.rand(5)
    assert torch.equal(torch.cat([a1, a2, a3]), torch.rand(15, generator=_fresh(100)))
    assert torch.equal(torch.cat([b1, b2]), torch.rand(10, generator=_fresh(200)))


def test_nested_fork_of_the_same_name_is_refused() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
        with (
            pytest.raises(RuntimeError, match=r"fork: the RNG state 'a' is already forked"),
            tracker.fork("a"),
        ):
            pass
        second = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    # The refused fork changed nothing: the stream ran on without repeats.
    assert torch.equal(torch.cat([first, second]), torch.rand(8, generator=_fresh(1)))
    with tracker.fork("a"):  # the name is free again after its block
        pass


def test_default_fork_name_is_the_model_parallel_state() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add(get_model_parallel_rng_tracker_name(), 9)
    with tracker.fork():
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=_fresh(9)))


def test_tracker_names_are_the_reference_names() -> None:
    assert get_model_parallel_rng_tracker_name() == "model-parallel-rng"
    assert get_data_parallel_rng_tracker_name() == "data-parallel-rng"
    assert get_expert_parallel_rng_tracker_name() == "expert-parallel-rng"


def test_duplicate_names_and_seeds_raise() -> None:
    tracker = CudaRNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match=r"add: seed 1 is already in use \(name 'b'\)"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match=r"add: an RNG state named 'a' already exists"):
        tracker.add("a", 2)
    # A failed add leaves nothing behind: seed 2 and name "b" are still free.
    tracker.add("b", 2)
    assert sorted(tracker.get_states()) == ["a", "b"]


@pytest.mark.parametrize(
    ("name", "seed", "error", "match"),
    [
        (1, 5, TypeError, r"add: name must be a str, got 1"),
        ("x", "5", TypeError, r"add: seed must be an int, got '5'"),
        ("x", 2**64, ValueError, r"add: seed must lie in"),
    ],
)
def test_add_rejects_bad_arguments(
    name: object, seed: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RNGStatesTracker(device="cpu").add(name, seed)  # type: ignore[arg-type]


def test_fork_of_unknown_name_raises() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    with (
        pytest.raises(ValueError, match=r"fork: no RNG state named 'z'; added states: \['a'\]"),
        tracker.fork("z"),
    ):
        pass


def test_get_states_is_a_snapshot_and_set_states_rewinds() -> None:
    tracker = RNGStatesTracker(device="cpu")
    assert not tracker.is_initialized()
    tracker.add("a", 1)
    assert tracker.is_initialized()
    snapshot = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(6)
    assert not torch.equal(snapshot["a"], tracker.get_states()["a"])
    tracker.set_states(snapshot)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(6), first)


def test_reset_forgets_states_and_seeds() -> None:
    tracker = RNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    tracker.reset()
    assert not tracker.is_initialized()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # neither the name nor the seed is taken any more
    tracker.reset()
    tracker.set_states({})
    assert tracker.is_initialized()


@pytest.mark.parametrize(
    ("states", "match"),
    [
        ([("a", torch.zeros(1))], r"set_states: states must be a mapping"),
        ({"a": 3}, r"set_states: expected str -> Tensor entries, got 'a' -> int"),
        ({1: torch.get_rng_state()}, r"expected str -> Tensor entries, got 1 -> Tensor"),
    ],
)
def test_set_states_rejects_bad_input(states: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        RNGStatesTracker(device="cpu").set_states(states)  # type: ignore[arg-type]


def test_cudagraphable_tracker_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"use_cudagraphable_rng=True: the cpu generator has no"):
        RNGStatesTracker(use_cudagraphable_rng=True, device="cpu")


def test_tracker_on_a_device_without_generator_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"torch has no device module for 'meta'"):
        RNGStatesTracker(device="meta")


def test_tracker_follows_the_default_device_when_none_is_given() -> None:
    from mf_utils import default_device

    assert RNGStatesTracker().device == default_device()
    assert RNGStatesTracker(device="cpu").device == torch.device("cpu")


def test_inference_tracker_makes_add_set_states_and_fork_no_ops() -> None:
    tracker = InferenceRNGStatesTracker(device="cpu")
    tracker.add("a", 1)
    tracker.add("a", 1)  # no duplicate error: nothing was added
    tracker.set_states({"a": torch.get_rng_state()})
    assert not tracker.is_initialized()
    assert tracker.get_states() == {}
    torch.manual_seed(4)
    with tracker.fork("anything"):
        inside = torch.rand(5)
    torch.manual_seed(4)
    assert torch.equal(inside, torch.rand(5))  # drawn from the default stream
