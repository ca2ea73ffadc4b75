"""An HTTP/1.1 client connection for IMDS (and, over TLS, the Event Hubs REST API: forwarder/eventhub.py): one
kept-alive socket, prebuilt requests, the responses parsed by h11 (sans-IO: it reads bytes we hand it, never the
socket, so the socket, its timeouts and the TLS context stay ours).

Why not http.client: the forwarder wakes up once a second for one tiny GET, and at that rate the cost is cold
Python code, not the network. http.client (request building with validation, the email-package header parser)
runs ~530 µs of CPU per cold poll, prebuilt request bytes with h11's parser ~420 µs (the hand-written parser h11
replaced: ~150 µs), and it loads the email package (+0.4 MiB). It never consults proxy settings (IMDS must not be
reached through a proxy).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# h11 0.16: +0.4 MiB RSS (python -c), +0.15-0.3 ms CPU a poll (footprint: 2.1 -> 2.7-3.0 CPU-s/h, 0.22x -> 0.3x).
import h11

if TYPE_CHECKING:
    import ssl

MAX_HEAD = 64 * 1024  # a response head (or a chunk header) larger than this is refused


class HttpProtocolError(OSError):
    """The peer's answer is not HTTP/1.x as expected (treated like a broken connection)."""


class _IdleConnectionClosed(ConnectionError):
    """The server closed a kept-alive connection before answering: retry once on a fresh one."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    retry_after: str | None
    close: bool


_TLS: list[ssl.SSLContext] = []


def tls_context() -> ssl.SSLContext:
    """The process's one TLS client context (system CAs, hostname checks), made at first use: Event Hubs and the
    Relay listener share it, since each context loads the CA store again (about 1.9 MiB) and ssl itself is only
    loaded by a forwarder that speaks TLS (every VM, and locally too). Python's default context: the CAs are the
    system's, or those ``SSL_CERT_FILE`` names (the emulators' local CA, emulators/tls.py); nothing turns it off."""
    if not _TLS:
        import ssl  # noqa: PLC0415

        _TLS.append(ssl.create_default_context())
    return _TLS[0]


def open_socket(host: str, port: int, *, timeout: float, tls: ssl.SSLContext | None) -> socket.socket:
    """A TCP connection whose writes leave at once, over TLS when ``tls`` is given (closed if it cannot be set up).
    Every socket of the forwarder opens here (IMDS, Event Hubs, the relay listener): with Nagle's
    algorithm a second write waited for the peer's delayed ACK of the first (~40 ms on Linux), which cost every
    approval's answer (two WebSocket frames) 45 ms until 55b2a62."""
    raw = socket.create_connection((host, port), timeout=timeout)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return raw if tls is None else tls.wrap_socket(raw, server_hostname=host)
    except BaseException:
        raw.close()
        raise


def build_request(
    method: str,
    host: str,
    path: str,
    *,
    body: bytes = b"",
    content_type: str = "",
    headers: Sequence[tuple[str, str]] = (("Metadata", "true"),),
) -> bytes:
    """The complete request bytes (build once, send many times). ``headers``: IMDS's ``Metadata: true`` unless
    told otherwise."""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}",
        *(f"{k}: {v}" for k, v in headers),
        "Accept-Encoding: identity",
    ]
    if body or method not in ("GET", "HEAD"):
        lines.append(f"Content-Length: {len(body)}")
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


class KeepAliveConnection:
    """Not thread-safe: the caller serialises requests (ImdsClient holds a lock)."""

    def __init__(self, host: str, port: int, *, max_body: int, tls: ssl.SSLContext | None = None) -> None:
        self._address = (host, port)
        self._tls = tls
        self._max_body = max_body
        self._sock: socket.socket | None = None
        self._http: h11.Connection | None = None
        self._timeout: float | None = None
        # What h11 is told was sent, by method: it reads a response only after a request, and the method decides
        # whether one has a body (HEAD); the bytes on the wire are the prebuilt ones.
        self._sent: dict[bytes, h11.Request] = {}

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._http = None

    def exchange(self, request: bytes, *, timeout: float) -> Response:
        """Send one request and read its response. A kept-alive connection that the server closed while idle is
        retried once on a fresh one (safe for IMDS: GETs, and StartRequests, which IMDS accepts again). On any
        error the socket is closed, so the next request starts clean."""
        reused = self._sock is not None
        try:
            return self._exchange(request, timeout)
        except _IdleConnectionClosed:
            self.close()
            if not reused:
                raise
        except OSError:
            self.close()
            raise
        try:
            return self._exchange(request, timeout)
        except OSError:
            self.close()
            raise

    def _exchange(self, request: bytes, timeout: float) -> Response:
        sock, http = self._connection(timeout)
        method = request[: request.find(b" ")]
        if method not in self._sent:
            self._sent[method] = h11.Request(method=method, target="/", headers=[("Host", self._address[0])])
        http.send(self._sent[method])
        http.send(h11.EndOfMessage())
        try:
            sock.sendall(request)
            data = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _IdleConnectionClosed(str(exc)) from exc
        if not data:
            raise _IdleConnectionClosed("the server closed the connection before answering")
        head: h11.Response | None = None
        body = bytearray()
        while True:
            http.receive_data(data)
            while (event := self._next(http, head, closed=not data)) is not h11.NEED_DATA:
                if isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > self._max_body:  # cut: the caller sees max_body + 1 and the socket is dropped
                        return self._done(head, bytes(body[: self._max_body + 1]), close=True)
                elif isinstance(event, h11.EndOfMessage):
                    return self._done(head, bytes(body), close=http.their_state is not h11.DONE)
            data = sock.recv(65536)

    def _connection(self, timeout: float) -> tuple[socket.socket, h11.Connection]:
        if self._sock is None or self._http is None:
            self._sock = open_socket(*self._address, timeout=timeout, tls=self._tls)
            self._http = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
            self._timeout = timeout
        elif timeout != self._timeout:
            self._sock.settimeout(timeout)
            self._timeout = timeout
        return self._sock, self._http

    @staticmethod
    def _next(http: h11.Connection, head: h11.Response | None, *, closed: bool) -> object:
        """h11's next event, its refusals said as HttpProtocolError."""
        try:
            return http.next_event()
        except h11.RemoteProtocolError as exc:
            if closed:
                raise HttpProtocolError("the server closed the connection in the middle of a response") from exc
            if exc.error_status_hint == 431:
                raise HttpProtocolError("response headers are too large") from exc
            if head is None:
                raise HttpProtocolError(f"not an HTTP/1.x status line and headers: {exc}") from exc
            raise HttpProtocolError(f"malformed response body: {exc}") from exc

    def _done(self, head: h11.Response | None, body: bytes, *, close: bool) -> Response:
        assert head is not None  # h11 gives the head before any body
        retry_after = next((v.decode("latin-1") for k, v in head.headers if k == b"retry-after"), None)
        http = self._http
        # Bytes after the response (more than its Content-Length said) leave the stream out of step: not reused.
        if close or http is None or http.our_state is not h11.DONE or http.trailing_data[0]:
            self.close()
            close = True
        else:
            http.start_next_cycle()
        return Response(status=head.status_code, body=body, retry_after=retry_after, close=close)
