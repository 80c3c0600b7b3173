"""Isolation for mf-rng tests: each test gets its own process-wide tracker
(pinned to the CPU generator, so the CPU tests mean the same on a machine with
a GPU), no registered groups, and leaves the CPU generator as it found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mf_rng import initialize_rng_tracker, register_model_parallel_group, use_rng_tracker


@pytest.fixture(autouse=True)
def isolated_rng() -> Iterator[None]:
    cpu_state = torch.get_rng_state()
    try:
        with use_rng_tracker():
            initialize_rng_tracker(device="cpu")
            yield
    finally:
        for axis in ("tp", "ep", "etp", "cp"):
            register_model_parallel_group(axis, None)
        torch.set_rng_state(cpu_state)
