"""Shared pytest configuration: multi-rank tests in two xdist groups; no example deadlines.

Multi-rank tests (marked ``multiprocess``) spawn gloo ranks. They run one
after another within two groups, each on one xdist worker at a time: the
launcher runs of ``tests/integration`` and ``tests/train`` (``mf-train``, torchrun,
the bench CLI, whole models) and the rest (``run_on_ranks`` bodies). In one group they
were the suite's critical path (13.3 of its 13.8 minutes, the other worker
idle two thirds of the time); in two, at most two tests' ranks share the cores.

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
            launches = item.nodeid.startswith(("tests/integration/", "tests/train/"))
            item.add_marker(pytest.mark.xdist_group("launches" if launches else "multiprocess"))
