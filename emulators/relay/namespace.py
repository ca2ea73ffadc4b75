"""The Relay emulator's namespace (one event loop): its hybrid connections, their listeners, the exchanges in flight
and the limits the service holds them to; what every side of the relay (handshakes, control channel, senders) reads
and writes."""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import parse_qsl

from websockets.asyncio.server import ServerConnection

from emulators.relay.auth import TokenChecker
from emulators.relay.messages import RequestMessage, ResponseMessage

log = logging.getLogger("emulators.relay")

MAX_LISTENERS = 25
CONTROL_CHANNEL_LIMIT = 64 * 1024
HEADER_METADATA_LIMIT = 32 * 1024
BODY_FRAGMENT_BYTES = 16 * 1024
ACCEPT_TIMEOUT = 30.0
SENDER_IDLE_TIMEOUT = 120.0
NO_LISTENER_STATUS = 503


class ListenerFault(Exception):
    """The listener broke the protocol or went away while a request was outstanding; the sender gets 502."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass(eq=False)
class HybridConnection:
    name: str
    declared: bool = False
    requires_client_authorization: bool = True
    user_metadata: str | None = None
    created_at: str = field(default_factory=now_iso)
    updated_at: str = field(default_factory=now_iso)
    listeners: list[Listener] = field(default_factory=list)
    sockets: set[ServerConnection] = field(default_factory=set)


@dataclass(eq=False)
class Listener:
    conn: ServerConnection
    hybrid_connection: HybridConnection
    expires_at: float
    client_id: str | None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    token_renewed: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[str, PendingRequest] = field(default_factory=dict)


@dataclass(eq=False)
class SenderSession:
    """One sender TCP connection. Once a listener opened a rendezvous socket for one of its requests, the later
    requests of this connection to the same hybrid connection travel on that socket; either side closing its end
    closes the other."""

    transport: asyncio.Transport
    rendezvous: ServerConnection | None = None
    rendezvous_hc: HybridConnection | None = None
    busy: bool = False
    doomed: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def attach(self, conn: ServerConnection, hybrid_connection: HybridConnection) -> None:
        self.rendezvous, self.rendezvous_hc = conn, hybrid_connection

    def close(self) -> None:
        self.closed.set()
        self.transport.close()


@dataclass(eq=False)
class PendingRequest:
    id: str
    listener: Listener
    session: SenderSession
    message: RequestMessage
    body: bytes
    rendezvous_first: bool
    result: asyncio.Future[tuple[ResponseMessage, bytes]]
    rendezvous: asyncio.Future[ServerConnection]

    def complete(self, response: ResponseMessage, body: bytes) -> None:
        if not self.result.done():
            self.result.set_result((response, body))

    def fail(self, reason: str) -> None:
        if not self.result.done():
            self.result.set_exception(ListenerFault(reason))


@dataclass(frozen=True)
class Rejected:
    status: int
    description: str


@dataclass(eq=False)
class PendingAccept:
    listener: Listener
    decided: asyncio.Future[ServerConnection | Rejected]
    sender: asyncio.Future[ServerConnection]


def close_reason(text: str) -> str:
    """WebSocket close reasons are limited to 123 bytes."""
    return text.encode()[:123].decode(errors="ignore")


@dataclass(eq=False, repr=False, kw_only=True)
class Namespace:
    """The relay namespace: hybrid connections, their listeners and the exchanges in flight (one event loop)."""

    checker: TokenChecker
    host: str = "127.0.0.1"
    port: int = 0
    # The server's TLS (wss:// and https://, as the service serves them); None: plain ws:// and http://.
    tls: ssl.SSLContext | None = None
    response_timeout: float = 60.0
    accept_timeout: float = ACCEPT_TIMEOUT
    require_known: bool = False
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.time
    hybrid_connections: dict[str, HybridConnection] = field(default_factory=dict, init=False)
    requests: dict[str, PendingRequest] = field(default_factory=dict, init=False)
    accepts: dict[str, PendingAccept] = field(default_factory=dict, init=False)
    counters: Counter[str] = field(default_factory=Counter, init=False)
    tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    sessions: set[SenderSession] = field(default_factory=set, init=False)
    # Injected listener behaviour per hybrid connection (tests, the local runner): (delay before a request is
    # delivered, whether it is never delivered). Not a Relay feature: a slow or dead listener, seen from Relay.
    listener_faults: dict[str, tuple[float, bool]] = field(default_factory=dict, init=False)

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ws_scheme(self) -> str:
        return "wss" if self.tls is not None else "ws"

    @property
    def http_scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    # ---- registry --------------------------------------------------------------------------------------------

    def _route(self, path: str) -> HybridConnection | None:
        """The hybrid connection a sender path addresses: the longest registered prefix (the rest is a suffix)."""
        segments = path.split("/")
        for end in range(len(segments), 0, -1):
            found = self.hybrid_connections.get("/".join(segments[:end]).lower())
            if found is not None:
                return found
        return None

    def declare(
        self, name: str, *, requires_client_authorization: bool = True, user_metadata: str | None = None
    ) -> tuple[HybridConnection, bool]:
        """Creates or updates a hybrid connection; True when it did not exist (as a declared one) before."""
        existing = self.hybrid_connections.get(name.lower())
        created = existing is None or not existing.declared
        hybrid_connection = existing or HybridConnection(name=name)
        hybrid_connection.declared = True
        hybrid_connection.requires_client_authorization = requires_client_authorization
        hybrid_connection.user_metadata = user_metadata
        hybrid_connection.updated_at = now_iso()
        self.hybrid_connections[name.lower()] = hybrid_connection
        return hybrid_connection, created

    async def delete(self, name: str) -> bool:
        hybrid_connection = self.hybrid_connections.pop(name.lower(), None)
        if hybrid_connection is None:
            return False
        await self._close_all(hybrid_connection, 1001, "hybrid connection deleted")
        return True

    async def _close_all(self, hybrid_connection: HybridConnection, code: int, reason: str) -> None:
        conns = [listener.conn for listener in hybrid_connection.listeners] + list(hybrid_connection.sockets)
        await asyncio.gather(*(conn.close(code, reason) for conn in conns), return_exceptions=True)

    def listener_count(self, name: str) -> int:
        hybrid_connection = self.hybrid_connections.get(name.strip("/").lower())
        return 0 if hybrid_connection is None else sum(1 for item in hybrid_connection.listeners if item.ready.is_set())

    def _pick_listener(self, hybrid_connection: HybridConnection) -> Listener | None:
        candidates = [item for item in hybrid_connection.listeners if item.ready.is_set()]
        return self.rng.choice(candidates) if candidates else None

    def refuse(self, what: str, error: str) -> None:
        self.counters[f"refused.{what}"] += 1
        log.warning("relay: refused %s: %s", what, error)

    def _sender_token(self, headers: Iterable[tuple[str, str]], query: str, *, allow_authorization: bool) -> str | None:
        by_name = {name.lower(): value for name, value in headers}
        token = dict(parse_qsl(query, keep_blank_values=True)).get("sb-hc-token") or by_name.get(
            "servicebusauthorization"
        )
        if token is None and allow_authorization:
            token = by_name.get("authorization")
        return token
