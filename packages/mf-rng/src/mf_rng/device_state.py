"""Read, write and seed the default random generator of a device.

This module is the one place in mf_rng that knows how devices differ: the CPU
has a single default generator, accelerators (CUDA, XPU, ...) have one per
device index. Everything above it (tracker, seeding, checkpointing) passes a
``torch.device`` and never branches on the device type itself.

Two kinds of state exist:

* plain states: a CPU ``ByteTensor`` snapshot (``Generator.get_state``); a
  later ``set_state`` copies it back. Cheap, but not allowed while a CUDA
  graph is being captured.
* graph-safe states: a ``torch.Generator`` object that *is* the state
  (``Generator.graphsafe_get_state``); installing it with
  ``graphsafe_set_state`` makes the device generator draw from (and advance)
  that object, which is what CUDA graph capture needs. Only generators that
  implement it (CUDA today) accept ``graph_safe=True``; the others raise.

Nothing here keeps state between calls beyond a cache of each device's
default generator object and whether it offers graph-safe states (both fixed
for the life of the process).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TypeAlias

import torch

from mf_utils import default_device

__all__ = [
    "RNGState",
    "check_seed",
    "device_generator",
    "fresh_rng_state",
    "get_rng_state",
    "resolve_device",
    "seed_device",
    "set_rng_state",
    "supports_graph_safe_rng",
]

RNGState: TypeAlias = torch.Tensor | torch.Generator
"""A plain state (a CPU ``ByteTensor``) or a graph-safe state (a ``torch.Generator``)."""

# torch.Generator.manual_seed accepts any value representable as int64 or uint64.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


def _device_module(device: torch.device) -> ModuleType:
    try:
        return torch.get_device_module(device.type)
    except RuntimeError as error:
        raise ValueError(
            f"device={device!r}: torch has no device module for {device.type!r}, so there is "
            "no default generator to track"
        ) from error


def resolve_device(device: torch.device | str | int | None = None) -> torch.device:
    """Return the concrete device whose generator ``device`` means.

    Args:
        device: ``None`` for :func:`mf_utils.default_device` (the current
            accelerator, else the CPU); a device or its name; an accelerator
            type without an index (``"cuda"``) means the current device of that
            type; a bare int is an index of the current accelerator type.

    Raises:
        TypeError: if ``device`` is not a device, a str, an int or None.
        ValueError: if ``device`` is an int but no accelerator is present, or
            its type has no torch device module.
    """
    if device is None:
        return default_device()
    if isinstance(device, bool) or not isinstance(device, torch.device | str | int):
        raise TypeError(f"device must be a torch.device, str, int or None, got {device!r}")
    if isinstance(device, int):
        if not torch.accelerator.is_available():
            raise ValueError(f"device={device!r} is an accelerator index, but none is available")
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None  # is_available() said there is one
        return torch.device(accelerator.type, device)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        return torch.device(device.type, _device_module(device).current_device())
    return device


def device_generator(device: torch.device | str | int | None = None) -> torch.Generator:
    """Return the default generator that random ops on ``device`` draw from.

    Raises:
        ValueError: if ``device``'s type has no per-device default generators
            (for example ``"meta"``), or the index is out of range.
    """
    return _generator_at(resolve_device(device))


@functools.cache
def _generator_at(device: torch.device) -> torch.Generator:
    # Cached: forks look the generator up on every entry and exit, and a
    # device's default generator object never changes within a process.
    if device.type == "cpu":
        return torch.default_generator
    module = _device_module(device)
    init = getattr(module, "init", None)
    if getattr(module, "default_generators", None) is None or init is None:
        raise ValueError(
            f"device={device!r}: torch.{device.type} exposes no per-device default generators; "
            "mf_rng tracks cpu and accelerators such as cuda or xpu"
        )
    # default_generators stays empty until the device runtime is lazily initialised.
    init()
    generators = module.default_generators
    if not 0 <= device.index < len(generators):
        raise ValueError(
            f"device={device!r}: index out of range, {len(generators)} {device.type} devices exist"
        )
    return generators[device.index]


def supports_graph_safe_rng(device: torch.device | str | int | None = None) -> bool:
    """Tell whether ``device``'s generator offers graph-safe state get/set."""
    return _graph_safe_at(resolve_device(device))


@functools.cache
def _graph_safe_at(device: torch.device) -> bool:
    generator = _generator_at(device)
    if not hasattr(generator, "graphsafe_get_state"):
        return False
    try:
        generator.graphsafe_get_state()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _require_graph_safe(generator: torch.Generator) -> None:
    if not supports_graph_safe_rng(generator.device):
        raise RuntimeError(
            f"graph_safe=True: the {generator.device} generator does not support graph-safe "
            f"states in torch {torch.__version__} (they exist for cuda generators only); "
            "use plain states (use_cudagraphable_rng=False) on this device"
        )


def get_rng_state(
    device: torch.device | str | int | None = None, *, graph_safe: bool = False, clone: bool = False
) -> RNGState:
    """Return the current state of ``device``'s default generator.

    Args:
        device: see :func:`resolve_device`.
        graph_safe: return the graph-safe state object instead of a byte tensor.
        clone: with ``graph_safe``, return an independent copy of the state
            object rather than the live one the generator keeps advancing.
            Plain states are always fresh tensors, so it changes nothing there.

    Raises:
        RuntimeError: if ``graph_safe`` is asked for on a generator without it.
    """
    generator = device_generator(device)
    if not graph_safe:
        return generator.get_state()
    _require_graph_safe(generator)
    return generator.clone_state() if clone else generator.graphsafe_get_state()


def set_rng_state(
    state: RNGState, device: torch.device | str | int | None = None, *, graph_safe: bool = False
) -> None:
    """Install ``state`` into ``device``'s default generator.

    Plain states are copied into the generator without an intermediate clone;
    a graph-safe state object is installed by reference, so later draws on the
    device advance ``state`` itself.

    Raises:
        TypeError: if ``state`` is not the kind ``graph_safe`` asks for.
        RuntimeError: if ``graph_safe`` is asked for on a generator without it.
    """
    generator = device_generator(device)
    if graph_safe:
        if not isinstance(state, torch.Generator):
            raise TypeError(
                f"graph_safe=True needs a torch.Generator state, got {type(state).__name__}"
            )
        _require_graph_safe(generator)
        generator.graphsafe_set_state(state)
        return
    if not isinstance(state, torch.Tensor):
        raise TypeError(
            f"graph_safe=False needs a ByteTensor state, got {type(state).__name__}; "
            "was this state taken with graph_safe=True?"
        )
    generator.set_state(state)


def check_seed(seed: int, where: str) -> None:
    """Raise unless ``seed`` is an int that ``torch.Generator.manual_seed`` accepts."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{where}: seed must be an int, got {seed!r}")
    if not _SEED_MIN <= seed <= _SEED_MAX:
        raise ValueError(f"{where}: seed must lie in [-2**63, 2**64 - 1], got {seed!r}")


def seed_device(seed: int, device: torch.device | str | int | None = None) -> None:
    """Seed ``device``'s default generator with ``seed`` (and no other generator)."""
    check_seed(seed, "seed_device")
    device_generator(device).manual_seed(seed)


def fresh_rng_state(
    seed: int, device: torch.device | str | int | None = None, *, graph_safe: bool = False
) -> RNGState:
    """Return the state ``device``'s generator would have right after ``manual_seed(seed)``.

    A private generator is seeded, so the device's default generator is not touched.
    """
    device = resolve_device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    if not graph_safe:
        return generator.get_state()
    _require_graph_safe(device_generator(device))
    return generator.clone_state()
