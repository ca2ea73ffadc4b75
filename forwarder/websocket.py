"""A minimal WebSocket client (RFC 6455) for the relay listener: what the Hybrid Connections protocol uses, and no
more: the opening handshake with extra headers, text and binary messages (fragmented ones reassembled), ping, pong
and close, masking, a bound on a message's size, ``recv`` with a timeout, and pings sent while it waits.

Why not the ``websockets`` package (which it used before): loading its synchronous client costs a connected listener
about 4 MiB of the daemon's memory (it imports ssl, its proxy support pulls urllib.request, http.client, the email
parser and importlib.metadata), for a channel that carries a few small JSON frames an hour; the daemon must stay as
small as a bare poller (docs/forwarder.md, *Footprint*). Over ``wss://`` (Azure Relay) it uses the process's one TLS
context (``keepalive.tls_context``).

The names follow ``websockets`` (``connect``, ``ClientConnection``, ``ConnectionClosed``, ``InvalidStatus`` with
``response.status_code``), so the listener (forwarder/relay_listener.py) reads as it did. Tested against the Relay
emulator, whose server side is the ``websockets`` package (tests/relay), and on a scripted socket
(tests/forwarder/test_websocket.py).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

from forwarder.keepalive import tls_context

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_CONTINUATION, _TEXT, _BINARY, _CLOSE, _PING, _PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_HEAD = 64 * 1024


class WebSocketException(Exception):
    """Anything the peer did that is not the WebSocket protocol."""


class InvalidHandshake(WebSocketException):
    """The opening handshake failed (not an upgrade, a wrong accept key)."""


@dataclass(frozen=True)
class Response:
    status_code: int
    body: bytes


class InvalidStatus(InvalidHandshake):
    """The server answered the handshake with another status than 101 (Azure Relay: 401, 403, 404, 410…)."""

    def __init__(self, response: Response) -> None:
        super().__init__(f"server rejected WebSocket connection: HTTP {response.status_code}")
        self.response = response


@dataclass(frozen=True)
class Close:
    code: int
    reason: str


class ConnectionClosed(WebSocketException):
    """The connection is closed; ``rcvd`` is the peer's close frame (None when it just went away)."""

    def __init__(self, rcvd: Close | None) -> None:
        super().__init__(f"connection closed ({rcvd.code} {rcvd.reason})" if rcvd else "connection closed abnormally")
        self.rcvd = rcvd


def connect(
    uri: str,
    *,
    additional_headers: dict[str, str] | None = None,
    open_timeout: float = 10.0,
    ping_interval: float | None = None,
    max_size: int | None = 1 << 20,
) -> ClientConnection:
    """Open a WebSocket to ``ws://`` or ``wss://`` ``uri``; raises InvalidStatus, InvalidHandshake, OSError or
    TimeoutError (``open_timeout`` bounds the TCP connect, TLS and the handshake)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise InvalidHandshake(f"{uri!r} is not a ws:// or wss:// URI")
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    raw = socket.create_connection((parts.hostname, port), timeout=open_timeout)
    sock = raw
    try:
        if secure:
            sock = tls_context().wrap_socket(raw, server_hostname=parts.hostname)
        key = base64.b64encode(os.urandom(16)).decode("ascii")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        lines = [
            f"GET {target} HTTP/1.1",
            f"Host: {host}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{name}: {value}" for name, value in (additional_headers or {}).items()),
        ]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        status, headers, rest = _read_head(sock)
        if status != 101:
            length = min(int(headers.get("content-length", "0") or 0), MAX_HEAD)
            while len(rest) < length and (data := sock.recv(65536)):
                rest += data
            raise InvalidStatus(Response(status, rest[:length]))
        expected = base64.b64encode(hashlib.sha1(key.encode("ascii") + _GUID, usedforsecurity=False).digest())
        if headers.get("upgrade", "").lower() != "websocket" or "upgrade" not in headers.get("connection", "").lower():
            raise InvalidHandshake("the server's answer is not a WebSocket upgrade")
        if headers.get("sec-websocket-accept", "").encode("ascii") != expected:
            raise InvalidHandshake("the server's Sec-WebSocket-Accept does not match the key")
        sock.settimeout(None)
        return ClientConnection(sock, rest, ping_interval=ping_interval, max_size=max_size)
    except BaseException:
        sock.close()
        raise


def _read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buffer = b""
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > MAX_HEAD:
            raise InvalidHandshake("the handshake answer's headers are too large")
        data = sock.recv(65536)
        if not data:
            raise InvalidHandshake("the server closed the connection during the handshake")
        buffer += data
    lines = buffer[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise InvalidHandshake(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers, buffer[end + 4 :]


class ClientConnection:
    """One open WebSocket. ``send`` is thread-safe; one thread receives; ``close`` from any thread ends a ``recv``
    in progress with ConnectionClosed."""

    def __init__(self, sock: socket.socket, buffered: bytes, *, ping_interval: float | None, max_size: int | None):
        self._sock = sock
        self._buffer = bytearray(buffered)
        self._ping_interval = ping_interval
        self._next_ping = time.monotonic() + ping_interval if ping_interval else None
        self._max_size = max_size
        self._send_lock = threading.Lock()
        self._fragments: list[bytes] = []
        self._fragment_opcode = _BINARY
        self._closed: Close | None = None
        self._gone = False

    # --- sending ---
    def send(self, message: str | bytes) -> None:
        if isinstance(message, str):
            self._send_frame(_TEXT, message.encode("utf-8"))
        else:
            self._send_frame(_BINARY, bytes(message))

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        length = len(payload)
        if length < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | length)
        elif length < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length)
        mask = os.urandom(4)
        # A client masks every frame (RFC 6455 5.3): XOR with the key repeated, done as one big integer.
        repeated = (mask * (length // 4 + 1))[:length]
        masked = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(length, "big")
        with self._send_lock:
            if self._gone or (self._closed is not None and opcode != _CLOSE):
                raise ConnectionClosed(self._closed)
            try:
                self._sock.sendall(head + mask + masked)
            except OSError as error:
                self._gone = True
                raise ConnectionClosed(self._closed) from error

    # --- receiving ---
    def recv(self, timeout: float | None = None) -> str | bytes:
        """The next message; TimeoutError after ``timeout`` seconds without one (the connection stays usable)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fin, opcode, payload = self._frame(deadline)
            if opcode == _PING:
                self._send_frame(_PONG, payload)
            elif opcode == _PONG:
                continue
            elif opcode == _CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                self._closed = Close(code, payload[2:].decode("utf-8", errors="replace"))
                with contextlib.suppress(ConnectionClosed):
                    self._send_frame(_CLOSE, payload[:2])
                self._shutdown()
                raise ConnectionClosed(self._closed)
            elif opcode in (_TEXT, _BINARY, _CONTINUATION):
                if opcode != _CONTINUATION:
                    self._fragment_opcode = opcode
                self._fragments.append(payload)
                if self._max_size is not None and sum(map(len, self._fragments)) > self._max_size:
                    self._fragments.clear()
                    self._fail(1009, f"message larger than {self._max_size} bytes")
                if fin:
                    data = b"".join(self._fragments)
                    self._fragments.clear()
                    return data.decode("utf-8") if self._fragment_opcode == _TEXT else data
            else:
                self._fail(1002, f"unknown opcode {opcode:#x}")

    def _frame(self, deadline: float | None) -> tuple[bool, int, bytes]:
        """One whole frame (consumed only once it is all here, so a timeout loses nothing)."""
        self._fill(2, deadline)
        first, second = self._buffer[0], self._buffer[1]
        if second & 0x80:
            self._fail(1002, "a server must not mask its frames")
        length, offset = second & 0x7F, 2
        if length == 126:
            self._fill(4, deadline)
            length, offset = struct.unpack("!H", self._buffer[2:4])[0], 4
        elif length == 127:
            self._fill(10, deadline)
            length, offset = struct.unpack("!Q", self._buffer[2:10])[0], 10
        if self._max_size is not None and length > self._max_size:
            self._fail(1009, f"frame larger than {self._max_size} bytes")
        self._fill(offset + length, deadline)
        payload = bytes(self._buffer[offset : offset + length])
        del self._buffer[: offset + length]
        return bool(first & 0x80), first & 0x0F, payload

    def _fill(self, size: int, deadline: float | None) -> None:
        while len(self._buffer) < size:
            if self._gone:
                raise ConnectionClosed(self._closed)
            now = time.monotonic()
            if self._next_ping is not None and now >= self._next_ping:
                self._send_frame(_PING, b"")
                self._next_ping = now + (self._ping_interval or 0)
            waits = [t - now for t in (deadline, self._next_ping) if t is not None]
            wait = max(0.0, min(waits)) if waits else None
            pending = getattr(self._sock, "pending", lambda: 0)()  # TLS: bytes already decrypted
            try:
                ready = pending or select.select([self._sock], [], [], wait)[0]
                data = self._sock.recv(65536) if ready else None
            except (OSError, ValueError) as error:  # closed under us by close() on another thread
                self._gone = True
                raise ConnectionClosed(self._closed) from error
            if data is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError("no message within the timeout")
                continue
            if not data:
                self._gone = True
                raise ConnectionClosed(self._closed)
            self._buffer += data

    def _fail(self, code: int, reason: str) -> None:
        self._closed = Close(code, reason)
        with contextlib.suppress(ConnectionClosed):
            self._send_frame(_CLOSE, struct.pack("!H", code) + reason.encode("utf-8")[:120])
        self._shutdown()
        raise WebSocketException(reason)

    # --- closing ---
    def close(self) -> None:
        """Send a normal close (1000) and drop the socket; idempotent."""
        if self._closed is None and not self._gone:
            self._closed = Close(1000, "")
            with contextlib.suppress(ConnectionClosed):
                self._send_frame(_CLOSE, struct.pack("!H", 1000))
        self._shutdown()

    def _shutdown(self) -> None:
        self._gone = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
