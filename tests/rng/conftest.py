"""Isolation for mf-rng tests: each test gets no process-wide tracker, no
registered groups, and leaves the CPU generator as it found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mf_rng import register_model_parallel_group, use_rng_tracker


@pytest.fixture(autouse=True)
def isolated_rng() -> Iterator[None]:
    cpu_state = torch.get_rng_state()
    try:
        with use_rng_tracker():
            yield
    finally:
        for axis in ("tp", "ep", "etp"):
            register_model_parallel_group(axis, None)
        torch.set_rng_state(cpu_state)
