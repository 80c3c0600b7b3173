"""Shared pytest configuration: keep multi-rank tests on one xdist worker.

Multi-rank tests (marked ``multiprocess``) spawn gloo ranks; grouping them
on one xdist worker keeps the ranks from oversubscribing the 2 cores, while
single-process tests fill the other worker.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
