"""One connection on the relay's port: a websockets connection that first looks at the request head and hands plain
HTTP to the relay, and the role its WebSocket handshake gave it (listener, sender, accepted or rendezvous socket)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from websockets.asyncio.server import ServerConnection

from emulators.relay.httpwire import MAX_HEAD_BYTES, is_websocket_upgrade
from emulators.relay.namespace import Listener, PendingAccept, PendingRequest


class _HttpFace(Protocol):
    tasks: set[asyncio.Task[None]]

    async def serve_http(self, reader: asyncio.StreamReader, transport: asyncio.Transport) -> None: ...


@dataclass(frozen=True)
class ListenRole:
    name: str
    expires_at: float
    client_id: str | None


@dataclass(frozen=True)
class SenderRole:
    accept: PendingAccept


@dataclass(frozen=True)
class AcceptRole:
    accept: PendingAccept


@dataclass(frozen=True)
class RendezvousRole:
    pending: PendingRequest


Role = ListenRole | SenderRole | AcceptRole | RendezvousRole


class RelayConnection(ServerConnection):
    """A websockets connection that first looks at the request head and hands plain HTTP to the relay."""

    relay: _HttpFace
    role: Role | None = None
    listener: Listener | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head = bytearray()
        self._mode = "sniff"
        self._http_reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES)

    def data_received(self, data: bytes) -> None:
        if self._mode == "ws":
            super().data_received(data)
            return
        if self._mode == "http":
            self._http_reader.feed_data(data)
            return
        self._head += data
        if b"\r\n\r\n" not in self._head and len(self._head) <= MAX_HEAD_BYTES:
            return
        buffered, self._head = bytes(self._head), bytearray()
        if is_websocket_upgrade(buffered.partition(b"\r\n\r\n")[0]):
            self._mode = "ws"
            super().data_received(buffered)
            return
        self._mode = "http"
        # Lets the reader pause the socket while a large body waits to be consumed.
        self._http_reader.set_transport(self.transport)
        self._http_reader.feed_data(buffered)
        task = self.loop.create_task(self.relay.serve_http(self._http_reader, self.transport))
        self.relay.tasks.add(task)
        task.add_done_callback(self.relay.tasks.discard)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._mode == "ws":
            return super().eof_received()
        # A sender may half-close after its request; keep the transport open to write the answer.
        self._http_reader.feed_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._http_reader.feed_eof()
        super().connection_lost(exc)
