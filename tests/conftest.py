"""Session fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from emulators.azurite import Azurite, AzuriteEndpoints


@pytest.fixture(scope="session")
def azurite() -> Iterator[AzuriteEndpoints]:
    """One Azurite (blob, queue and table, in memory) per test session on free loopback ports.

    Tests share it: give every test its own table, queue or container name (e.g. from ``uuid4().hex``).
    """
    with Azurite() as endpoints:
        yield endpoints


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist (scripts/test.sh runs two workers with ``--dist loadgroup``), every whole-stack run (marked
    ``slow``) goes to one worker, one at a time: their latency assertions are made for a machine running one stack at
    once. Every other test is spread over the workers, beside them."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("stacks"))
