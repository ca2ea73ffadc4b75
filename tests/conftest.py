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
