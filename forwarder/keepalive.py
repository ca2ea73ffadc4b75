"""A minimal HTTP/1.1 client connection for IMDS (and, over TLS, the Event Hubs REST API: forwarder/eventhub.py):
one kept-alive socket, prebuilt requests, small parser.

Why not http.client: the forwarder wakes up once a second for one tiny GET, and at that rate the cost is cold
Python code, not the network. http.client (request building with validation, the email-package header parser)
runs ~550 µs of CPU per cold poll; this runs ~200 µs, which is what keeps the daemon near 1 CPU-second per hour.
It speaks just what an IMDS answer needs — Content-Length, chunked or read-to-close bodies, Connection: close —
and never consults proxy settings (IMDS must not be reached through a proxy).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl

MAX_HEAD = 64 * 1024
_CRLF = b"\r\n"


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


@dataclass(frozen=True)
class _Head:
    status: int
    length: int | None
    chunked: bool
    close: bool
    retry_after: str | None


def _parse_head(lines: list[bytes]) -> _Head:
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    length: int | None = None
    chunked = False
    close = parts[0] == b"HTTP/1.0"
    retry_after: str | None = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            if not value.strip().isdigit():
                raise HttpProtocolError(f"bad Content-Length {value[:20]!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = value.strip().lower() == b"close"
        elif name == b"retry-after":
            retry_after = value.strip().decode("latin-1")
    return _Head(int(parts[1]), length, chunked, close, retry_after)


_TLS: list[ssl.SSLContext] = []


def tls_context() -> ssl.SSLContext:
    """The process's one TLS client context (system CAs, hostname checks), made at first use: Event Hubs and the
    Relay listener share it, since each context loads the CA store again (about 1.9 MiB) and ssl itself is only
    loaded by a forwarder that speaks TLS (every VM; not the loopback emulators)."""
    if not _TLS:
        import ssl  # noqa: PLC0415

        _TLS.append(ssl.create_default_context())
    return _TLS[0]


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
        self._timeout: float | None = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

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
        lines, rest = self._send(request, timeout)
        head = _parse_head(lines)
        if head.chunked:
            body = self._read_chunked(rest)
        elif head.length is not None:
            body = self._read_exact(rest, min(head.length, self._max_body + 1))
        else:
            body = self._read_to_close(rest)
        close = head.close or (head.length is None and not head.chunked) or len(body) > self._max_body
        if close:
            self.close()
        return Response(status=head.status, body=body, retry_after=head.retry_after, close=close)

    def _send(self, request: bytes, timeout: float) -> tuple[list[bytes], bytes]:
        """Send the request; return the response's head lines and what was read after them."""
        if self._sock is None:
            sock = socket.create_connection(self._address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock if self._tls is None else self._tls.wrap_socket(sock, server_hostname=self._address[0])
            self._timeout = timeout
        elif timeout != self._timeout:
            self._sock.settimeout(timeout)
            self._timeout = timeout
        try:
            self._sock.sendall(request)
            buffer = self._sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _IdleConnectionClosed(str(exc)) from exc
        if not buffer:
            raise _IdleConnectionClosed("the server closed the connection before answering")
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if len(buffer) > MAX_HEAD:
                raise HttpProtocolError("response headers are too large")
            buffer += self._recv()
        return buffer[:end].split(_CRLF), buffer[end + 4 :]

    def _recv(self) -> bytes:
        assert self._sock is not None
        data = self._sock.recv(65536)
        if not data:
            raise HttpProtocolError("the server closed the connection in the middle of a response")
        return data

    def _read_exact(self, rest: bytes, length: int) -> bytes:
        while len(rest) < length:
            rest += self._recv()
        return rest[:length]

    def _read_to_close(self, rest: bytes) -> bytes:
        assert self._sock is not None
        chunks = [rest]
        size = len(rest)
        while size <= self._max_body and (data := self._sock.recv(65536)):
            chunks.append(data)
            size += len(data)
        return b"".join(chunks)

    def _read_chunked(self, rest: bytes) -> bytes:
        body = bytearray()
        while True:
            while (end := rest.find(_CRLF)) < 0:
                rest += self._recv()
            size_field = rest[:end].split(b";", 1)[0].strip()
            try:
                size = int(size_field, 16)
            except ValueError:
                raise HttpProtocolError(f"bad chunk size {size_field[:20]!r}") from None
            rest = rest[end + 2 :]
            if size == 0:
                # Optional trailers, then the empty line that ends the message.
                while (end := rest.find(_CRLF)) != 0:
                    if end < 0:
                        rest += self._recv()
                    else:
                        rest = rest[end + 2 :]
                return bytes(body)
            while len(rest) < size + 2:
                rest += self._recv()
            body += rest[:size]
            if len(body) > self._max_body:
                self.close()
                return bytes(body)
            rest = rest[size + 2 :]
