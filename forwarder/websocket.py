"""The relay listener's WebSocket client: RFC 6455 framing and the opening handshake from ``wsproto`` (sans-IO: it
turns events into bytes and bytes into events, never touching the socket), driven here over the forwarder's own
socket and TLS context (``keepalive.tls_context``), with what the Hybrid Connections protocol needs: extra headers
on the handshake, a bound on a message's size, ``recv`` with a timeout, pings sent while it waits, and ``send``
from any thread.

Why not the ``websockets`` package (which it used before): loading its synchronous client costs a connected listener
about 4 MiB of the daemon's memory (its proxy support pulls urllib.request, http.client, the email parser and
importlib.metadata), for a channel that carries a few small JSON frames an hour; the daemon must stay as small as a
bare poller (docs/forwarder.md, *Footprint*).

The names follow ``websockets`` (``connect``, ``ClientConnection``, ``ConnectionClosed``, ``InvalidStatus`` with
``response.status_code``), so the listener (forwarder/relay_listener.py) reads as it did. Tested against the Relay
emulator, whose server side is the ``websockets`` package (tests/relay), and on scripted sockets
(tests/forwarder/test_websocket.py).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

# wsproto 1.3.2: +0.5 MiB RSS over h11 (python -c; connected footprint 26.3 -> 26.7 MiB); CPU: not measurable.
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import ProtocolError

from forwarder.keepalive import open_socket, tls_context

MAX_HEAD = 64 * 1024  # the most read of a handshake answer (its head, or a refusal's body)
# The longest a write may block (a peer that stopped reading): the channel is then over (ConnectionClosed).
IO_TIMEOUT = 10.0
# The longest a read holds the socket once select said it was readable: a TLS record not yet whole is left to
# OpenSSL's buffer and waited for outside the lock, so a sender waits at most this long for a reader.
READ_SLICE = 0.2


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
    TimeoutError (``open_timeout`` bounds the TCP connect, TLS and each read of the handshake)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise InvalidHandshake(f"{uri!r} is not a ws:// or wss:// URI")
    secure = parts.scheme == "wss"
    # Each frame leaves at once (TCP_NODELAY, ``open_socket``): an answer is two frames, the response and its body.
    port = parts.port or (443 if secure else 80)
    sock = open_socket(parts.hostname, port, timeout=open_timeout, tls=tls_context() if secure else None)
    try:
        ws = WSConnection(ConnectionType.CLIENT)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (additional_headers or {}).items()]
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sock.sendall(ws.send(Request(host=host, target=target, extra_headers=headers)))
        early = _handshake(sock, ws)
        sock.settimeout(IO_TIMEOUT)
        return ClientConnection(sock, ws, early, ping_interval=ping_interval, max_size=max_size)
    except BaseException:
        sock.close()
        raise


def _handshake(sock: socket.socket, ws: WSConnection) -> list[Event]:
    """Reads the answer to the upgrade until wsproto accepts it, and gives what the server sent right after it (the
    first frames, as events); a refusal is InvalidStatus with (the start of) its body, anything else
    InvalidHandshake."""
    refused: RejectConnection | None = None
    body = b""
    received = 0
    while True:
        data = sock.recv(65536)
        received += len(data)
        try:
            ws.receive_data(data or None)
            events = list(ws.events())
        except ProtocolError as error:
            if refused is not None:  # a refusal's body cut short: what came is enough to say why
                raise InvalidStatus(Response(refused.status_code, body[:MAX_HEAD])) from error
            detail = f"{error}: {error.__context__}" if error.__context__ else str(error)
            checked = "status 101, Connection, Upgrade and Sec-WebSocket-Accept checked"
            raise InvalidHandshake(f"the server's answer is not a WebSocket upgrade ({checked}): {detail}") from error
        for i, event in enumerate(events):
            if isinstance(event, AcceptConnection):
                return events[i + 1 :]
            if isinstance(event, RejectConnection):
                refused = event
                if not event.has_body:
                    raise InvalidStatus(Response(event.status_code, b""))
            elif isinstance(event, RejectData):
                body += event.data
        if refused is not None and (ws.state is ConnectionState.CLOSED or len(body) >= MAX_HEAD or not data):
            raise InvalidStatus(Response(refused.status_code, body[:MAX_HEAD]))
        if not data:
            raise InvalidHandshake("the server closed the connection during the handshake")
        if refused is None and received > MAX_HEAD:
            raise InvalidHandshake("the handshake answer's headers are too large")


class ClientConnection:
    """One open WebSocket. ``send`` is thread-safe; one thread receives; ``close`` from any thread ends a ``recv``
    in progress with ConnectionClosed."""

    def __init__(
        self,
        sock: socket.socket,
        ws: WSConnection,
        early: list[Event],
        *,
        ping_interval: float | None,
        max_size: int | None,
    ) -> None:
        self._sock = sock
        self._ws = ws
        self._ping_interval = ping_interval
        self._next_ping = time.monotonic() + ping_interval if ping_interval else None
        self._max_size = max_size
        self._send_lock = threading.Lock()  # one frame on the wire at a time, in the order wsproto made them
        self._ws_lock = threading.Lock()  # wsproto's state, shared by the sending and the receiving thread
        # The socket's reads and writes, one at a time: a TLS socket's SSL object must not be used by two threads at
        # once (CPython 3.11 does not serialize SSL_read and SSL_write); a listener reading while its pool threads
        # answered read "Invalid opcode 0x7" on a channel that never sent one. Waiting (select) is outside it.
        self._io_lock = threading.Lock()
        self._events: deque[Event] = deque(early)
        self._parts: list[bytes | bytearray] = []  # the message so far (a text one as UTF-8)
        self._size = 0
        self._closed: Close | None = None
        self._gone = False

    # --- sending ---
    def send(self, message: str | bytes) -> None:
        self._send(TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=bytes(message)))

    def _send(self, event: Event) -> None:
        with self._send_lock:
            if self._gone or (self._closed is not None and not isinstance(event, CloseConnection)):
                raise ConnectionClosed(self._closed)
            try:
                with self._ws_lock:
                    data = self._ws.send(event)
                with self._io_lock:
                    self._sock.settimeout(IO_TIMEOUT)
                    self._sock.sendall(data)
            except (OSError, ProtocolError) as error:  # the socket, or a state that sends nothing more
                self._gone = True
                raise ConnectionClosed(self._closed) from error

    # --- receiving ---
    def recv(self, timeout: float | None = None) -> str | bytes:
        """The next message; TimeoutError after ``timeout`` seconds without one (the connection stays usable)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while self._events:
                event = self._events.popleft()
                if isinstance(event, TextMessage | BytesMessage):
                    data = event.data.encode("utf-8") if isinstance(event.data, str) else event.data
                    self._parts.append(data)
                    self._size += len(data)
                    if self._max_size is not None and self._size > self._max_size:
                        self._fail(1009, f"message larger than {self._max_size} bytes")
                    if event.message_finished:
                        message, self._parts, self._size = b"".join(self._parts), [], 0
                        return message.decode("utf-8") if isinstance(event, TextMessage) else message
                elif isinstance(event, Ping):
                    self._send(event.response())
                elif isinstance(event, CloseConnection):
                    self._closing(event)
            self._fill(deadline)

    def _closing(self, event: CloseConnection) -> None:
        """The peer's close (answered, then the socket dropped), or what wsproto found wrong in its frames (failed
        with that code: wsproto says it as a close event without a change of state)."""
        if self._ws.state not in (ConnectionState.REMOTE_CLOSING, ConnectionState.CLOSED):
            self._fail(event.code, event.reason or "protocol error")
        self._closed = Close(event.code, event.reason or "")
        with contextlib.suppress(ConnectionClosed):
            self._send(event.response())
        self._shutdown()
        raise ConnectionClosed(self._closed)

    def _read(self) -> bytes | None:
        """What the socket has (b"": closed), or None while a TLS record is not whole yet."""
        with self._io_lock:
            self._sock.settimeout(READ_SLICE)
            try:
                return self._sock.recv(65536)
            except TimeoutError:
                return None

    def _fill(self, deadline: float | None) -> None:
        """Reads once from the socket into wsproto (sending a ping when one is due); TimeoutError at the deadline."""
        while True:
            if self._gone:
                raise ConnectionClosed(self._closed)
            now = time.monotonic()
            if self._next_ping is not None and now >= self._next_ping:
                self._send(Ping())
                self._next_ping = now + (self._ping_interval or 0)
            waits = [t - now for t in (deadline, self._next_ping) if t is not None]
            wait = max(0.0, min(waits)) if waits else None
            try:
                with self._io_lock:
                    pending = getattr(self._sock, "pending", lambda: 0)()  # TLS: bytes already decrypted
                ready = pending or select.select([self._sock], [], [], wait)[0]
                data = self._read() if ready else None
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
            with self._ws_lock:
                self._ws.receive_data(data)
                self._events.extend(self._ws.events())
            return

    def _fail(self, code: int, reason: str) -> None:
        self._closed = Close(code, reason)
        with contextlib.suppress(ConnectionClosed):
            self._send(CloseConnection(code=code, reason=reason))
        self._shutdown()
        raise WebSocketException(reason)

    # --- closing ---
    def close(self) -> None:
        """Send a normal close (1000) and drop the socket; idempotent."""
        if self._closed is None and not self._gone:
            self._closed = Close(1000, "")
            with contextlib.suppress(ConnectionClosed):
                self._send(CloseConnection(code=1000))
        self._shutdown()

    def _shutdown(self) -> None:
        self._gone = True
        # Shut first, outside the I/O lock: it wakes a reader or a writer blocked on the socket. Closed under it: a
        # descriptor closed while the reader was in its SSL_read could be reused by another connection at once.
        # The descriptor is shut beneath TLS (socket.socket.shutdown): SSLSocket.shutdown drops its SSL object, and a
        # reader past its check then read the peer's next TLS record as plain bytes (0x17: "Invalid opcode 0x7").
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
        with self._io_lock:
            self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
