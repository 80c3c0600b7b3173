"""The process-wide RNG tracker that layers and checkpointing share.

Model code asks :func:`get_cuda_rng_tracker` for "the" tracker rather than
threading one through every call, as in the reference. The first call (or
:func:`initialize_rng_tracker`) decides its flavour: mf's pure-torch
tracker, Transformer Engine's, and either of them as an inference no-op
tracker. Later calls return the same object until ``force_reset``.

Tests and nested programs swap the tracker with :func:`use_rng_tracker`
instead of touching this module's globals.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from mf_rng.device_state import resolve_device
from mf_rng.tracker import (
    InferenceRNGStatesTracker,
    RNGStatesTracker,
    RNGTracker,
    te_rng_tracker_class,
)

__all__ = [
    "get_all_rng_states",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "initialize_rng_tracker",
    "use_rng_tracker",
]

_tracker: RNGTracker | None = None


def _new_tracker(
    use_te_rng_tracker: bool,
    inference_rng_tracker: bool,
    use_cudagraphable_rng: bool,
    device: torch.device | str | int | None,
) -> RNGTracker:
    if use_te_rng_tracker:
        if device is not None and resolve_device(device).type != "cuda":
            raise ValueError(
                f"initialize_rng_tracker: Transformer Engine's tracker works on cuda only, "
                f"got device={device!r}"
            )
        tracker_class = te_rng_tracker_class(bool(inference_rng_tracker))
        return tracker_class(is_inference_rng_tracker=bool(inference_rng_tracker))
    tracker_class = InferenceRNGStatesTracker if inference_rng_tracker else RNGStatesTracker
    return tracker_class(
        use_cudagraphable_rng=use_cudagraphable_rng,
        is_inference_rng_tracker=inference_rng_tracker,
        device=device,
    )


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
    *,
    device: torch.device | str | int | None = None,
) -> None:
    """Create the process-wide tracker unless one exists (or ``force_reset`` asks to replace it).

    The options describe the tracker to create; they change nothing about an
    existing one (as in the reference), and a warning says so when an option
    explicitly asked for (a True flag, a device) differs from it.

    Args:
        use_te_rng_tracker: use Transformer Engine's tracker (graph-safe,
            FP8-aware) instead of mf's; TE >= 1.5 must be installed.
        inference_rng_tracker: make add/set_states/fork no-ops.
        use_cudagraphable_rng: keep graph-safe states in mf's tracker (CUDA only;
            TE's tracker is graph-safe anyway).
        force_reset: replace the existing tracker with a new one.
        device: the device whose generator the tracker swaps; ``None`` follows
            :func:`mf_utils.default_device` (pass ``"cpu"`` to track the CPU
            generator on a machine that has an accelerator).

    Raises:
        RuntimeError: if TE is asked for but missing, or graph-safe states are
            asked for on a device without them; the existing tracker is kept then.
        ValueError: if TE's tracker is asked for on a device other than cuda.
    """
    _initialize(
        use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset, device
    )


def _initialize(
    use_te_rng_tracker: bool,
    inference_rng_tracker: bool,
    use_cudagraphable_rng: bool,
    force_reset: bool,
    device: torch.device | str | int | None,
) -> RNGTracker:
    global _tracker
    if _tracker is None or force_reset:
        # Build first, then replace: a failed build keeps the existing tracker.
        _tracker = _new_tracker(
            use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, device
        )
        return _tracker
    ignored = _unmet_requests(
        _tracker, use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, device
    )
    if ignored:
        warnings.warn(
            f"the process-wide RNG tracker already exists ({type(_tracker).__name__}), so "
            f"{', '.join(ignored)} is ignored; pass force_reset=True (force_reset_rng=True "
            "when seeding) to rebuild it",
            UserWarning,
            stacklevel=3,
        )
    return _tracker


def _unmet_requests(
    tracker: RNGTracker,
    use_te_rng_tracker: bool,
    inference_rng_tracker: bool,
    use_cudagraphable_rng: bool,
    device: torch.device | str | int | None,
) -> list[str]:
    """The options explicitly asked for that the existing ``tracker`` does not have.

    Defaults never count: most callers ask for "the" tracker without options.
    """
    unmet = []
    if use_te_rng_tracker and not getattr(tracker, "uses_transformer_engine", False):
        unmet.append("use_te_rng_tracker=True")
    if inference_rng_tracker and not getattr(tracker, "is_inference_rng_tracker", False):
        unmet.append("inference_rng_tracker=True")
    if (
        use_cudagraphable_rng
        and not use_te_rng_tracker
        and not getattr(tracker, "use_cudagraphable_rng", False)
    ):
        unmet.append("use_cudagraphable_rng=True")
    if device is not None and resolve_device(device) != tracker.device:
        unmet.append(f"device={device!r}")
    return unmet


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> RNGTracker:
    """Return the process-wide tracker, creating it with these options on first use.

    The options only matter when no tracker exists yet; see
    :func:`initialize_rng_tracker`. The name is the reference's: the tracker
    works on whatever device is in use, CPU included.
    """
    return _initialize(
        use_te_rng_tracker,
        inference_rng_tracker,
        use_cudagraphable_rng,
        force_reset=False,
        device=None,
    )


get_rng_tracker = get_cuda_rng_tracker
"""Device-neutral name of :func:`get_cuda_rng_tracker`."""


def get_all_rng_states() -> dict[str, Any]:
    """Return a snapshot of every named state of the process-wide tracker.

    Raises:
        RuntimeError: if no tracker was initialised yet.
    """
    if _tracker is None:
        raise RuntimeError(
            "get_all_rng_states: the RNG tracker is not initialized; call "
            "initialize_rng_tracker() or model_parallel_cuda_manual_seed() first"
        )
    return _tracker.get_states()


@contextlib.contextmanager
def use_rng_tracker(tracker: RNGTracker | None = None) -> Iterator[RNGTracker | None]:
    """Make ``tracker`` the process-wide tracker inside the block, then restore the previous one.

    With ``None`` the block starts with no tracker, so the first
    :func:`get_cuda_rng_tracker` or :func:`initialize_rng_tracker` inside it
    builds a fresh one that is dropped on exit (test isolation).

    Raises:
        TypeError: if ``tracker`` does not provide the :class:`RNGTracker` methods.
    """
    global _tracker
    if tracker is not None and not isinstance(tracker, RNGTracker):
        raise TypeError(f"use_rng_tracker: expected an RNG tracker or None, got {tracker!r}")
    previous, _tracker = _tracker, tracker
    try:
        yield tracker
    finally:
        _tracker = previous
