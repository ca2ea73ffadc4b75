"""A total deadline for an outbound HTTP call, however the other side answers.

requests, urllib3 and azure-core bound each socket operation (connect, each read), not the call: a server that
sends a byte every few seconds holds a call for as long as it likes (a health gate that trickled held a batch for
over two minutes). Here every call goes through a session whose connections know the deadline of the block they
are used in: ``with deadline(seconds, what):`` arms a timer, and when it fires every socket the block is using is
shut down, which ends at once any read or write it is blocked in. What the interrupted call raised becomes
``DeadlineExceeded``, naming the call and its deadline, and so does a block that ends without an error after its
deadline passed (a call cut inside the headers may look complete). A request the block makes after the deadline
fails before it is sent (shutting its connection could not stop it: it is not connected yet), so a library's own
retries end too.

``session()`` is a ``requests.Session`` with such connections; an azure-core client takes it as its transport
(``RequestsTransport(session=session())``), and ``RetryPolicy`` from here as its retries: azure-core's, except that
a wait between two attempts (a backoff, a Retry-After) that would outlast the block's deadline fails the call at once
with the deadline's error, instead of being slept whole (azure-core sleeps a Retry-After of 30 s whatever its
``timeout``) only for the next attempt to be refused. Each adapter states its deadline where it makes the call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import requests
from azure.core.pipeline import PipelineResponse
from azure.core.pipeline.policies import RetryPolicy as _CoreRetryPolicy
from azure.core.pipeline.transport import HttpTransport
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.poolmanager import PoolManager
from urllib3.util.ssl_ import create_urllib3_context

if TYPE_CHECKING:
    from requests.adapters import _HostParams, _PoolKwargs
    from requests.sessions import _Settings

__all__ = ["Deadline", "DeadlineExceeded", "RetryPolicy", "deadline", "session"]


class DeadlineExceeded(TimeoutError):
    """The call had no complete answer within its total deadline."""


class Deadline:
    """One block's deadline: the connections used in it, and whether it has passed."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self._ends = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._connections: list[HTTPConnection] = []
        self._expired = False
        self._closed = False

    @property
    def expired(self) -> bool:
        return self._expired

    def remaining(self) -> float:
        return max(0.0, self._ends - time.monotonic())

    def watch(self, connection: HTTPConnection) -> None:
        """Registers a connection about to send a request; past the deadline, refuses the request."""
        with self._lock:
            if not self._expired:
                self._connections.append(connection)
                return
        _shut(connection)
        # Called before http.client connects: a connection not yet open has no socket to shut, and the request
        # would run its whole course (a trickling answer held a call made 0.2 s late for 55 s).
        raise self.error()

    def expire(self) -> None:
        with self._lock:
            if self._closed:
                return  # the block ended first: its connections may already serve another call
            self._expired = True
            connections = list(self._connections)
        for connection in connections:
            _shut(connection)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._connections.clear()

    def error(self) -> DeadlineExceeded:
        # To the hundredth of a second: an attempt given what is left of its send's deadline gets 0.9996 s of a 1 s
        # send, and the message names the send's deadline, not the microseconds spent before the attempt.
        shown = f"{round(self.seconds, 2):g}"
        return DeadlineExceeded(f"{self.what}: no complete answer within its total deadline of {shown} s")


def _shut(connection: HTTPConnection) -> None:
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            # socket.socket's own shutdown, also for a TLS socket: its reads fail at once, and the TLS object is
            # left to the thread that is reading.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


_active = threading.local()


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[Deadline]:
    """Every HTTP call made in this block through a ``session()`` ends within ``seconds`` in all; one cut short
    raises ``DeadlineExceeded`` (from what it raised). Blocks nest: the inner one's connections obey both."""
    limit = Deadline(seconds, what)
    outer: list[Deadline] = getattr(_active, "deadlines", [])
    _active.deadlines = [*outer, limit]
    timer = threading.Timer(max(0.0, seconds), limit.expire)
    timer.daemon = True
    timer.start()
    try:
        yield limit
        if limit.expired:
            # The block ended without an error, but its sockets were shut midway: what it read may be a part taken
            # for the whole (http.client reads a stream that ends inside the headers as their end, and a status
            # 200 then stands on nothing). An expired deadline is an unreadable answer, whatever was received.
            raise limit.error()
    except Exception as error:
        if limit.expired and not isinstance(error, DeadlineExceeded):
            raise limit.error() from error
        raise
    finally:
        timer.cancel()
        limit.close()
        _active.deadlines = outer


def _nearest() -> Deadline | None:
    """The deadline of this thread's blocks that ends first; None outside any."""
    return min(getattr(_active, "deadlines", ()), key=lambda limit: limit.remaining(), default=None)


class _Bounded:
    """A transport whose ``sleep`` fails at once, with the deadline's error, when it would outlast ``limit``:
    the attempt after it could not be sent. Everything else is the transport's."""

    def __init__(self, transport: HttpTransport[Any, Any], limit: Deadline) -> None:
        self._transport = transport
        self._limit = limit

    def sleep(self, duration: float) -> None:
        if duration >= self._limit.remaining():
            raise self._limit.error()
        self._transport.sleep(duration)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class RetryPolicy(_CoreRetryPolicy[Any, Any]):
    """azure-core's ``RetryPolicy`` (retries 429 and 5xx, honours Retry-After, backs off exponentially) that does
    not wait between attempts past the ``deadline`` block the call runs in (module docstring)."""

    def sleep(
        self,
        settings: dict[str, Any],
        transport: HttpTransport[Any, Any],
        response: PipelineResponse[Any, Any] | None = None,
    ) -> None:
        limit = _nearest()
        bounded: Any = transport if limit is None else _Bounded(transport, limit)
        super().sleep(settings, bounded, response)


def _watch(connection: HTTPConnection) -> None:
    for limit in getattr(_active, "deadlines", ()):
        limit.watch(connection)


class _HTTPConnection(HTTPConnection):
    def request(self, *args: Any, **kwargs: Any) -> None:
        _watch(self)
        super().request(*args, **kwargs)


class _HTTPSConnection(HTTPSConnection):
    def request(self, *args: Any, **kwargs: Any) -> None:
        _watch(self)
        super().request(*args, **kwargs)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


@functools.cache
def _trusting(bundle: str) -> ssl.SSLContext:
    """One client context trusting the CA bundle file ``bundle``, for every connection that names it."""
    context = create_urllib3_context()
    context.load_verify_locations(cafile=bundle)
    return context


class _DeadlineAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def build_connection_pool_key_attributes(
        self, request: requests.PreparedRequest, verify: bool | str, cert: str | tuple[str, str] | None = None
    ) -> tuple[_HostParams, _PoolKwargs]:
        """requests' own, but a CA bundle named by path (``verify``, ``REQUESTS_CA_BUNDLE``) is loaded once per
        process, as requests preloads its default bundle: urllib3 loaded it again for each new connection, 14-17 ms
        of CPU with the GIL held for the local stack's 118 certificates, paid by the first approval of each Relay
        connection (the local pipeline's two slowest events, benchmarks/pipeline_latency.py). Verification is
        unchanged: CERT_REQUIRED, the hostname matched by urllib3."""
        host, pool = super().build_connection_pool_key_attributes(request, verify, cert)
        bundle = pool.get("ca_certs")
        if isinstance(bundle, str) and pool.get("ssl_context") is None and "cert_file" not in pool:
            pool["ssl_context"] = _trusting(bundle)
            del pool["ca_certs"]
        return host, pool

    def proxy_manager_for(self, *args: Any, **kwargs: Any) -> PoolManager:
        manager: PoolManager = super().proxy_manager_for(*args, **kwargs)
        manager.pool_classes_by_scheme = _POOLS
        return manager


# Distinct (scheme, host) a session remembers the environment's settings for; past it, it starts over (a gate may
# probe many hosts; the coordinator's own clients each reach one or two).
ENVIRONMENT_HOSTS = 64


class _Session(requests.Session):
    def __init__(self) -> None:
        super().__init__()
        self._environment: dict[tuple[Any, ...], _Settings] = {}

    def merge_environment_settings(
        self, url: str | bytes | None, proxies: Any, stream: Any, verify: Any, cert: Any
    ) -> _Settings:
        """requests' own, worked out once per scheme, host and arguments for the session's life. With
        ``trust_env`` requests reads the proxies (urllib's ``getproxies`` walks ``os.environ``, twice, and
        ``no_proxy`` is set and restored around its check) and ``REQUESTS_CA_BUNDLE`` again for every call:
        120-160 µs of CPU with the GIL held per request against 15 µs (``timeit``, 38 variables), paid by each
        Table write of a batch and each approval's POST. A process's environment is set before it starts; a session
        made after a change sees it. Proxies passed to the call, or a session not trusting the environment: requests'
        own, each time."""
        if proxies or not self.trust_env or not isinstance(url, str):
            return super().merge_environment_settings(url, proxies, stream, verify, cert)
        parts = urlsplit(url)
        key = (parts.scheme, parts.netloc, stream, verify, cert if not isinstance(cert, list) else tuple(cert))
        known = self._environment
        merged = known.get(key)
        if merged is None:
            if len(known) >= ENVIRONMENT_HOSTS:
                known.clear()
            merged = known[key] = super().merge_environment_settings(url, proxies, stream, verify, cert)
        return {**merged, "proxies": dict(merged["proxies"])}  # the caller's to change


def session() -> requests.Session:
    """A requests session whose calls a ``deadline`` block can cut short, the environment's settings read once per
    host (``_Session``)."""
    made = _Session()
    adapter = _DeadlineAdapter()
    made.mount("http://", adapter)
    made.mount("https://", adapter)
    # The CA bundle the environment names (REQUESTS_CA_BUNDLE), loaded now rather than by a first call.
    bundle = made.merge_environment_settings("https://localhost/", {}, None, None, None).get("verify")
    if isinstance(bundle, str) and os.path.isfile(bundle):
        _trusting(bundle)
    return made
