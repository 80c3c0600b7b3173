"""Named random-generator states that code can step into and out of.

An :class:`RNGStatesTracker` keeps one generator state per name (for example
one shared by all data-parallel ranks and one distinct per tensor-parallel
rank). ``with tracker.fork(name):`` installs the named state into the
device's default generator, lets the block draw from it, stores the advanced
state back under the name and puts the default state back as it was. So code
inside the block sees its own reproducible stream, and code outside never
notices the block ran.

Invariants: names and seeds are unique within a tracker; a fork always
restores the default generator, also when the block raises. The tracker does
no device-specific work itself: it goes through :mod:`mf_rng.device_state`.
It holds no process-wide state; the process-wide tracker lives in
:mod:`mf_rng.default_tracker`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from mf_rng.device_state import (
    RNGState,
    check_seed,
    device_generator,
    fresh_rng_state,
    get_rng_state,
    resolve_device,
    set_rng_state,
    supports_graph_safe_rng,
)
from mf_utils import get_te_version, is_te_min_version

__all__ = [
    "CudaRNGStatesTracker",
    "InferenceRNGStatesTracker",
    "RNGStatesTracker",
    "RNGTracker",
    "get_context_parallel_rng_tracker_name",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_model_and_context_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "te_rng_tracker_class",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_CONTEXT_PARALLEL_RNG_TRACKER_NAME = "context-parallel-rng"
_MODEL_AND_CONTEXT_PARALLEL_RNG_TRACKER_NAME = "model-and-context-parallel-rng"

# Transformer Engine's tracker gained the interface mf relies on in 1.5.
_MIN_TE_VERSION = "1.5.0"


def get_model_parallel_rng_tracker_name() -> str:
    """Return the name of the state that differs across tensor-parallel ranks."""
    return _MODEL_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """Return the name of the state that is equal on all ranks (seeded with the plain seed)."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """Return the name of the state that differs across expert(-tensor)-parallel ranks."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_context_parallel_rng_tracker_name() -> str:
    """Return the name of the state that differs across context-parallel ranks only.

    For dropout on activations split over the sequence by context parallelism
    and replicated over tensor parallelism (the hidden states outside a
    sequence-parallel region). It exists while context parallelism is on; see
    :func:`mf_rng.model_parallel_cuda_manual_seed`.
    """
    return _CONTEXT_PARALLEL_RNG_TRACKER_NAME


def get_model_and_context_parallel_rng_tracker_name() -> str:
    """Return the name of the state that differs across tensor- and context-parallel ranks.

    For dropout on activations split both ways: attention heads under tensor
    parallelism, hidden states under sequence parallelism, with the sequence
    split by context parallelism too. It exists while context parallelism is on.
    """
    return _MODEL_AND_CONTEXT_PARALLEL_RNG_TRACKER_NAME


@runtime_checkable
class RNGTracker(Protocol):
    """What the rest of mf needs from a tracker (mf's own, the inference one or TE's)."""

    @property
    def device(self) -> torch.device:
        """The device whose default generator forks swap."""
        ...

    def is_initialized(self) -> bool:
        """Tell whether a state was added or set since construction or the last reset."""
        ...

    def reset(self) -> None:
        """Forget all named states and seeds."""
        ...

    def get_states(self) -> dict[str, Any]:
        """Return a snapshot of the named states."""
        ...

    def set_states(self, states: Mapping[str, Any]) -> None:
        """Replace the named states with ``states`` (a :meth:`get_states` snapshot)."""
        ...

    def add(self, name: str, seed: int) -> None:
        """Add a state named ``name`` seeded with ``seed``."""
        ...

    def fork(self, name: str = ...) -> contextlib.AbstractContextManager[None]:
        """Draw from the state ``name`` inside the block."""
        ...


class RNGStatesTracker:
    """Named generator states for one device, entered with :meth:`fork`.

    Args:
        use_cudagraphable_rng: keep graph-safe states (``torch.Generator``
            objects) so forks may run inside CUDA graph capture. Only devices
            whose generator supports it (CUDA) accept this.
        is_inference_rng_tracker: recorded for callers that treat inference
            trackers specially (CUDA-graph capture code); it changes nothing
            here, see :class:`InferenceRNGStatesTracker` for the no-op tracker.
        device: the device whose default generator forks swap. ``None``
            follows :func:`mf_utils.default_device` (the current accelerator,
            else the CPU) at each use; an accelerator type without an index
            follows that type's current device.

    Raises:
        ValueError: if ``device`` has no default generator (e.g. ``"meta"``).
        RuntimeError: if ``use_cudagraphable_rng`` is set for a device whose
            generator has no graph-safe states.
    """

    use_cudagraphable_rng: bool
    is_inference_rng_tracker: bool
    states_: dict[str, RNGState]  # name -> state (byte tensor, or generator when graph-safe)
    seeds_: set[int]  # seeds in use, so no two names share a stream

    def __init__(
        self,
        use_cudagraphable_rng: bool = False,
        is_inference_rng_tracker: bool = False,
        *,
        device: torch.device | str | int | None = None,
    ) -> None:
        self.use_cudagraphable_rng = bool(use_cudagraphable_rng)
        self.is_inference_rng_tracker = bool(is_inference_rng_tracker)
        # Validate now, resolve at each use: the current device may change later.
        resolved = resolve_device(device)
        device_generator(resolved)
        self._device = device
        if self.use_cudagraphable_rng and not supports_graph_safe_rng(resolved):
            raise RuntimeError(
                f"use_cudagraphable_rng=True: the {resolved} generator has no graph-safe states "
                f"in torch {torch.__version__} (cuda generators do); pass "
                "use_cudagraphable_rng=False on this device"
            )
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False
        self._forked: set[str] = set()  # names whose fork block is running

    @property
    def device(self) -> torch.device:
        """The device whose default generator :meth:`fork` swaps, resolved now."""
        return resolve_device(self._device)

    def is_initialized(self) -> bool:
        """Tell whether a state was added or set since construction or the last reset."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget all named states and seeds."""
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def get_states(self) -> dict[str, RNGState]:
        """Return the named states in a new dict.

        Plain states are byte tensors that later forks replace rather than
        modify, so the dict is a snapshot. Graph-safe states are the live
        generator objects (as in the reference, so CUDA graphs that registered
        them keep working): forks advance them in place, and a snapshot needs
        ``state.clone_state()``.
        """
        return dict(self.states_)

    def set_states(self, states: Mapping[str, RNGState]) -> None:
        """Replace the named states with ``states``, typically from :meth:`get_states`.

        The dict is copied; the states themselves are used by reference.

        Raises:
            TypeError: if ``states`` is not a mapping of names to states of the
                kind this tracker keeps (byte tensors, or generators when
                graph-safe).
        """
        if not isinstance(states, Mapping):
            raise TypeError(f"set_states: states must be a mapping, got {states!r}")
        kind = torch.Generator if self.use_cudagraphable_rng else torch.Tensor
        for name, state in states.items():
            if not isinstance(name, str) or not isinstance(state, kind):
                raise TypeError(
                    f"set_states: expected str -> {kind.__name__} entries, got "
                    f"{name!r} -> {type(state).__name__}"
                )
        self.states_ = dict(states)
        self._is_initialized = True

    def add(self, name: str, seed: int) -> None:
        """Add a state named ``name`` equal to a fresh generator seeded with ``seed``.

        The device's default generator is not touched.

        Raises:
            TypeError: if ``name`` is not a str or ``seed`` not an int.
            ValueError: if ``name`` or ``seed`` is already in use in this tracker.
        """
        if not isinstance(name, str):
            raise TypeError(f"add: name must be a str, got {name!r}")
        check_seed(seed, "add")
        if seed in self.seeds_:
            raise ValueError(f"add: seed {seed!r} is already in use (name {name!r})")
        if name in self.states_:
            raise ValueError(f"add: an RNG state named {name!r} already exists")
        self.states_[name] = fresh_rng_state(
            seed, self.device, graph_safe=self.use_cudagraphable_rng
        )
        self.seeds_.add(seed)
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from the state ``name`` inside the block, then put the default state back.

        The advanced state is stored under ``name``, so the next fork continues
        the same stream.

        Forks of different names nest. Re-entering a name that is already
        forked is refused: the inner fork would restart from the state stored
        before the outer one began and silently repeat its random numbers.

        Raises:
            ValueError: if no state named ``name`` was added.
            RuntimeError: if ``name`` is already forked (nested fork of one name).
        """
        if name not in self.states_:
            raise ValueError(
                f"fork: no RNG state named {name!r}; added states: {sorted(self.states_)}"
            )
        if name in self._forked:
            raise RuntimeError(
                f"fork: the RNG state {name!r} is already forked by an enclosing block; "
                "draw from it directly instead of forking it again"
            )
        device, graph_safe = self.device, self.use_cudagraphable_rng
        original = get_rng_state(device, graph_safe=graph_safe)
        set_rng_state(self.states_[name], device, graph_safe=graph_safe)
        self._forked.add(name)
        try:
            yield
        finally:
            self._forked.discard(name)
            self.states_[name] = get_rng_state(device, graph_safe=graph_safe)
            set_rng_state(original, device, graph_safe=graph_safe)


CudaRNGStatesTracker = RNGStatesTracker
"""Reference name of :class:`RNGStatesTracker` (it is not CUDA-only)."""


class _InferenceNoOps:
    """Mixin making add, set_states and fork do nothing (inference needs no distinct streams)."""

    def add(self, name: str, seed: int) -> None:
        """Do nothing: an inference tracker keeps no states."""

    def set_states(self, states: Mapping[str, Any]) -> None:
        """Do nothing: an inference tracker keeps no states."""

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on the default generator, unchanged."""
        yield


class InferenceRNGStatesTracker(_InferenceNoOps, RNGStatesTracker):
    """An :class:`RNGStatesTracker` whose add, set_states and fork are no-ops.

    Code written for training (``with tracker.fork(): dropout(...)``) runs
    unchanged at inference, drawing from the default generator.
    """


@functools.cache
def te_rng_tracker_class(inference: bool = False) -> type:
    """Return Transformer Engine's tracker class, adapted to :class:`RNGTracker`.

    TE's tracker is graph-safe and FP8-aware; the adapter adds
    ``is_initialized`` and ``is_inference_rng_tracker``. With ``inference``
    the add/set_states/fork no-ops are mixed in. TE is imported here only, so
    mf_rng never needs it unless asked.

    Raises:
        RuntimeError: if Transformer Engine >= 1.5.0 is not installed.
    """
    if not is_te_min_version(_MIN_TE_VERSION):
        raise RuntimeError(
            f"use_te_rng_tracker=True needs Transformer Engine >= {_MIN_TE_VERSION}, "
            f"installed: {get_te_version()!r}; use the pure-torch tracker "
            "(use_te_rng_tracker=False) instead"
        )
    from transformer_engine.pytorch.distributed import CudaRNGStatesTracker as _TETracker

    class TERNGStatesTracker(_TETracker):
        """TE's tracker plus the ``is_initialized`` bookkeeping mf expects."""

        uses_transformer_engine = True

        def __init__(self, is_inference_rng_tracker: bool = False) -> None:
            self._is_initialized = False
            super().__init__()
            self.is_inference_rng_tracker = is_inference_rng_tracker

        @property
        def device(self) -> torch.device:
            """TE's states belong to the current CUDA device."""
            return resolve_device("cuda")

        def is_initialized(self) -> bool:
            return self._is_initialized

        def reset(self) -> None:
            super().reset()
            self._is_initialized = False

        def set_states(self, states: Mapping[str, Any]) -> None:
            super().set_states(states)
            self._is_initialized = True

        def add(self, name: str, seed: int) -> None:
            super().add(name, seed)
            self._is_initialized = True

    if not inference:
        return TERNGStatesTracker
    return type("InferenceTERNGStatesTracker", (_InferenceNoOps, TERNGStatesTracker), {})
