"""mf_rng.device_state on the CPU: resolving devices, plain get/set/seed, and
the clear errors for graph-safe states and devices without generators.
The CUDA side is in test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from mf_rng.device_state import (
    check_seed,
    device_generator,
    fresh_rng_state,
    get_rng_state,
    resolve_device,
    seed_device,
    set_rng_state,
    supports_graph_safe_rng,
)

needs_no_accelerator = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="checks the CPU-only default"
)


@needs_no_accelerator
def test_resolve_device_defaults_to_cpu_without_accelerator() -> None:
    assert resolve_device() == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device=0 is an accelerator index, but none"):
        resolve_device(0)


@pytest.mark.parametrize("bad", [1.5, True, ["cpu"]])
def test_resolve_device_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="device must be a torch.device, str, int or None"):
        resolve_device(bad)  # type: ignore[arg-type]


def test_device_generator_is_the_cpu_default_generator() -> None:
    assert device_generator("cpu") is torch.default_generator


def test_device_without_generators_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"device=device\(type='meta'.*no default generator"):
        device_generator(torch.device("meta", 0))


def test_plain_state_round_trip_replays_the_same_numbers() -> None:
    state = get_rng_state("cpu")
    first = torch.randn(16)
    set_rng_state(state, "cpu")
    assert torch.equal(torch.randn(16), first)
    # get_rng_state returns a fresh tensor: drawing does not change a taken state.
    assert not torch.equal(state, get_rng_state("cpu"))


def test_seed_device_matches_manual_seed_and_fresh_state() -> None:
    seed_device(77, "cpu")
    drawn = torch.rand(8)
    assert torch.equal(drawn, torch.rand(8, generator=torch.Generator().manual_seed(77)))
    assert torch.equal(fresh_rng_state(77, "cpu"), torch.Generator().manual_seed(77).get_state())


def test_fresh_rng_state_leaves_the_default_generator_alone() -> None:
    before = get_rng_state("cpu")
    fresh_rng_state(5, "cpu")
    assert torch.equal(get_rng_state("cpu"), before)


@pytest.mark.parametrize(
    ("seed", "error", "match"),
    [
        (1.0, TypeError, r"seed must be an int, got 1\.0"),
        (True, TypeError, r"seed must be an int, got True"),
        (
            2**64,
            ValueError,
            r"seed must lie in \[-2\*\*63, 2\*\*64 - 1\], got 18446744073709551616",
        ),
        (-(2**63) - 1, ValueError, r"seed must lie in"),
    ],
)
def test_check_seed_rejects(seed: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_seed(seed, "here")  # type: ignore[arg-type]
    check_seed(2**64 - 1, "here")
    check_seed(-(2**63), "here")


def test_graph_safe_states_on_cpu_are_a_clear_error() -> None:
    assert supports_graph_safe_rng("cpu") is False
    with pytest.raises(RuntimeError, match=r"graph_safe=True: the cpu generator does not support"):
        get_rng_state("cpu", graph_safe=True)
    with pytest.raises(RuntimeError, match=r"graph_safe=True: the cpu generator does not support"):
        set_rng_state(torch.Generator(), "cpu", graph_safe=True)
    with pytest.raises(RuntimeError, match=r"the cpu generator does not support"):
        fresh_rng_state(1, "cpu", graph_safe=True)


def test_state_kind_mismatch_is_a_clear_error() -> None:
    with pytest.raises(
        TypeError, match=r"graph_safe=False needs a ByteTensor state, got Generator"
    ):
        set_rng_state(torch.Generator(), "cpu")
    with pytest.raises(
        TypeError, match=r"graph_safe=True needs a torch.Generator state, got Tensor"
    ):
        set_rng_state(get_rng_state("cpu"), "cpu", graph_safe=True)
