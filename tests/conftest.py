"""Session fixtures shared by every test package."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from emulators.azurite import Azurite, AzuriteEndpoints
from tests.health_page import HealthPage


@pytest.fixture(scope="session")
def azurite() -> Iterator[AzuriteEndpoints]:
    """One Azurite (blob, queue and table, in memory) per test session on free loopback ports.

    Tests share it: give every test its own table, queue or container name (e.g. from ``uuid4().hex``).
    """
    with Azurite() as endpoints:
        yield endpoints


@pytest.fixture
def health() -> Iterator[tuple[str, type[HealthPage]]]:
    """A local health page for a policy's HTTP gate: its URL and its handler class (``page.status = 503`` fails it)."""
    page = type("Page", (HealthPage,), {"status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health", page
    server.shutdown()
    server.server_close()
