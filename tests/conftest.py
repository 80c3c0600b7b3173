"""Shared pytest configuration: keep multi-rank tests on one xdist worker; no example deadlines.

Multi-rank tests (marked ``multiprocess``) spawn gloo ranks; grouping them
on one xdist worker keeps the ranks from oversubscribing the 2 cores, while
single-process tests fill the other worker.

hypothesis fails an example that runs past its 200 ms deadline, which on a
loaded 2-core machine a first example can (a layout case once took 675 ms and
then 0.2 ms). Tests prove results, not speed (benchmarks do that), and each
multi-rank test has a timeout, so examples have no deadline.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

settings.register_profile("mf", deadline=None)
settings.load_profile("mf")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
