"""The deadline session's TLS: a CA bundle named by path is loaded once and shared by every connection (it was
loaded again for each, 14-17 ms of CPU), and verification is what it was: the bundle's CAs, the hostname checked."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import certifi
import pytest
import requests

from coordinator.adapters.deadline import session
from emulators.tls import TlsHTTPServer, local_tls


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args: Any) -> None:
        pass


def _serve(host: str) -> Iterator[str]:
    server = TlsHTTPServer((host, 0), _Hello, context=local_tls().server_context())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://{host}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def served() -> Iterator[str]:
    yield from _serve("127.0.0.1")


@pytest.fixture
def unnamed() -> Iterator[str]:
    """A server on a loopback address its certificate does not name (it names 127.0.0.1 and localhost)."""
    yield from _serve("127.0.0.2")


def _pool_kwargs(made: requests.Session, url: str, verify: str) -> dict[str, Any]:
    prepared = requests.Request("GET", url).prepare()
    adapter = made.get_adapter(url)
    _host, pool = adapter.build_connection_pool_key_attributes(prepared, verify)  # type: ignore[attr-defined]
    return dict(pool)


def test_a_bundle_is_one_context_shared_by_every_session_and_connection(served: str) -> None:
    bundle = str(local_tls().bundle)
    first, second = session(), session()
    one, two = _pool_kwargs(first, served, bundle), _pool_kwargs(second, served, bundle)
    assert "ca_certs" not in one
    assert one["ssl_context"] is two["ssl_context"]
    assert one["cert_reqs"] == "CERT_REQUIRED"
    for made in (first, second):
        assert made.get(served, verify=bundle, timeout=5).text == "hello"


def test_a_server_the_bundle_does_not_trust_is_refused(served: str) -> None:
    with pytest.raises(requests.exceptions.SSLError):
        session().get(served, verify=certifi.where(), timeout=5)


def test_a_certificate_for_another_host_is_refused(unnamed: str) -> None:
    with pytest.raises(requests.exceptions.SSLError):
        session().get(unnamed, verify=str(local_tls().bundle), timeout=5)
