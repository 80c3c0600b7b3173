"""The process-wide tracker: creation, flavours, warnings, swapping, and
the Transformer Engine path's error without TE."""

from __future__ import annotations

import pytest
import torch

from mf_rng import (
    InferenceRNGStatesTracker,
    RNGStatesTracker,
    get_all_rng_states,
    get_cuda_rng_tracker,
    get_rng_tracker,
    initialize_rng_tracker,
    use_rng_tracker,
)
from mf_utils import get_te_version


def test_process_wide_tracker_is_created_once() -> None:
    with use_rng_tracker():
        tracker = get_cuda_rng_tracker()
        assert type(tracker) is RNGStatesTracker
        assert get_rng_tracker() is tracker
        # Options only matter for the first creation (a warning says so) ...
        with pytest.warns(UserWarning, match=r"inference_rng_tracker=True is ignored"):
            assert get_cuda_rng_tracker(inference_rng_tracker=True) is tracker
        with pytest.warns(
            UserWarning,
            match=r"already exists \(RNGStatesTracker\), so use_te_rng_tracker=True, "
            r"inference_rng_tracker=True, device=device\(type='meta', index=0\) is ignored; "
            r"pass force_reset=True",
        ):
            initialize_rng_tracker(
                use_te_rng_tracker=True,
                inference_rng_tracker=True,
                device=torch.device("meta", 0),  # differs from the tracker's device
            )
        assert get_cuda_rng_tracker() is tracker
        # ... or with force_reset.
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True, device="cpu")
        replaced = get_cuda_rng_tracker()
        assert type(replaced) is InferenceRNGStatesTracker
        assert replaced.is_inference_rng_tracker
        assert replaced.device == torch.device("cpu")


def test_failed_force_reset_keeps_the_existing_tracker() -> None:
    before = get_cuda_rng_tracker()
    with pytest.raises(RuntimeError, match=r"use_cudagraphable_rng=True: the cpu generator"):
        initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True, device="cpu")
    with pytest.raises(ValueError, match=r"Transformer Engine's tracker works on cuda only"):
        initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True, device="cpu")
    assert get_cuda_rng_tracker() is before


def test_use_rng_tracker_swaps_and_restores() -> None:
    outer = get_cuda_rng_tracker()
    mine = RNGStatesTracker(device="cpu")
    with use_rng_tracker(mine) as installed:
        assert installed is mine
        assert get_cuda_rng_tracker() is mine
        with use_rng_tracker():
            fresh = get_cuda_rng_tracker()
            assert fresh is not mine
            assert fresh is not outer
        assert get_cuda_rng_tracker() is mine
    assert get_cuda_rng_tracker() is outer
    with (
        pytest.raises(TypeError, match=r"use_rng_tracker: expected an RNG tracker or None, got 3"),
        use_rng_tracker(3),  # type: ignore[arg-type]
    ):
        pass


def test_get_all_rng_states() -> None:
    with (
        use_rng_tracker(),
        pytest.raises(RuntimeError, match=r"the RNG tracker is not initialized"),
    ):
        get_all_rng_states()
    tracker = get_cuda_rng_tracker()
    tracker.add("a", 8)
    states = get_all_rng_states()
    assert list(states) == ["a"]
    assert torch.equal(states["a"], torch.Generator().manual_seed(8).get_state())


@pytest.mark.skipif(get_te_version() is not None, reason="checks the error without TE")
def test_te_tracker_without_te_is_a_clear_error() -> None:
    before = get_cuda_rng_tracker()
    with pytest.raises(RuntimeError, match=r"use_te_rng_tracker=True needs Transformer Engine >="):
        initialize_rng_tracker(use_te_rng_tracker=True, force_reset=True)
    assert get_cuda_rng_tracker() is before
    with use_rng_tracker():
        with pytest.raises(RuntimeError, match=r"installed: None"):
            get_cuda_rng_tracker(use_te_rng_tracker=True, inference_rng_tracker=True)
        # The failed attempt left no tracker behind.
        with pytest.raises(RuntimeError, match="not initialized"):
            get_all_rng_states()
