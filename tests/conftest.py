"""Session fixtures shared by every test package."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator

import pytest

from emulators.azurite import Azurite, AzuriteEndpoints
from emulators.tls import local_tls
from tests.health_page import HealthPage


@pytest.fixture(scope="session", autouse=True)
def trust_local_ca() -> Iterator[None]:
    """The emulators serve TLS with the local CA (emulators/tls.py); every client here, and every process a test
    starts, verifies it through the usual settings (``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``): certifi's CAs plus
    the local CA. Set before any TLS context is made (the forwarder keeps its first, keepalive.tls_context)."""
    saved = {name: os.environ.get(name) for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")}
    os.environ.update(local_tls().client_env())
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
