"""The deadline session reads the environment's proxy settings once per host, not for every call, and still honours
them: a proxy the environment names carries the session's calls, ``NO_PROXY`` still exempts its hosts, and proxies
given to a call are that call's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from coordinator.adapters.deadline import ENVIRONMENT_HOSTS, session


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with 200, keeping its request line (a proxied call sends the absolute URL)."""

    seen: list[str]

    def do_GET(self) -> None:
        self.server.seen.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def _server() -> Iterator[tuple[str, list[str]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.seen  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy() -> Iterator[tuple[str, list[str]]]:
    yield from _server()


@pytest.fixture
def origin() -> Iterator[tuple[str, list[str]]]:
    yield from _server()


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy setting of this machine's environment: each test sets its own."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def test_the_environment_is_read_once_per_host_and_its_proxy_carries_every_call(
    monkeypatch: pytest.MonkeyPatch, proxy: tuple[str, list[str]], environment_lookups: list[str]
) -> None:
    address, seen = proxy
    monkeypatch.setenv("HTTP_PROXY", address)
    made = session()
    environment_lookups.clear()  # what making the session read
    for n in range(5):
        assert made.get(f"http://state.invalid/row/{n}", timeout=5).text == "ok"
    made.get("http://other.invalid/", timeout=5)
    assert seen == [f"http://state.invalid/row/{n}" for n in range(5)] + ["http://other.invalid/"]
    assert [url.split("/")[2] for url in environment_lookups] == ["state.invalid", "other.invalid"]


def test_no_proxy_still_exempts_its_hosts(
    monkeypatch: pytest.MonkeyPatch, proxy: tuple[str, list[str]], origin: tuple[str, list[str]]
) -> None:
    (proxy_address, through_proxy), (origin_address, at_origin) = proxy, origin
    monkeypatch.setenv("HTTP_PROXY", proxy_address)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    made = session()
    for _ in range(2):
        assert made.get(f"{origin_address}/direct", timeout=5).text == "ok"
    assert at_origin == ["/direct", "/direct"]
    assert through_proxy == []


def test_proxies_given_to_a_call_are_that_calls_alone(
    proxy: tuple[str, list[str]], origin: tuple[str, list[str]]
) -> None:
    (proxy_address, through_proxy), (origin_address, at_origin) = proxy, origin
    made = session()
    made.get(f"{origin_address}/first", timeout=5)
    made.get("http://elsewhere.invalid/", proxies={"http": proxy_address}, timeout=5)
    made.get(f"{origin_address}/again", timeout=5)
    assert through_proxy == ["http://elsewhere.invalid/"]
    assert at_origin == ["/first", "/again"]


def test_a_session_not_trusting_the_environment_reads_none_of_it(
    monkeypatch: pytest.MonkeyPatch,
    proxy: tuple[str, list[str]],
    origin: tuple[str, list[str]],
    environment_lookups: list[str],
) -> None:
    (proxy_address, through_proxy), (origin_address, at_origin) = proxy, origin
    monkeypatch.setenv("HTTP_PROXY", proxy_address)
    made = session()
    made.trust_env = False  # what azure-core's use_env_settings=False sets
    environment_lookups.clear()
    made.get(f"{origin_address}/plain", timeout=5)
    assert at_origin == ["/plain"]
    assert through_proxy == []
    assert environment_lookups == []


def test_the_hosts_remembered_are_bounded(environment_lookups: list[str]) -> None:
    made = session()
    environment_lookups.clear()
    for n in range(ENVIRONMENT_HOSTS + 1):
        made.merge_environment_settings(f"http://host-{n}.invalid/", {}, None, None, None)
    made.merge_environment_settings(f"http://host-{ENVIRONMENT_HOSTS}.invalid/", {}, None, None, None)
    # The last host, remembered after the start over, is not read again; the first, forgotten then, is.
    assert len(environment_lookups) == ENVIRONMENT_HOSTS + 1
    made.merge_environment_settings("http://host-0.invalid/", {}, None, None, None)
    assert len(environment_lookups) == ENVIRONMENT_HOSTS + 2
