"""The asyncio core of the Relay emulator: one port for listeners, WebSocket senders and HTTP senders.

WebSocket upgrades are handled by the ``websockets`` server; a plain HTTP request on the same port is recognised
from its head before websockets sees it (websockets refuses request bodies) and is handled by :mod:`httpwire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from emulators.relay.auth import AuthError, Right, TokenChecker
from emulators.relay.httpwire import (
    MAX_HEAD_BYTES,
    HttpAnswer,
    HttpError,
    HttpRequest,
    is_websocket_upgrade,
    read_request,
    render_response,
    service_error,
    tracked,
)
from emulators.relay.management import handle_management
from emulators.relay.messages import (
    HOP_BY_HOP_HEADERS,
    AcceptMessage,
    ControlMessageError,
    RenewTokenMessage,
    RequestMessage,
    ResponseMessage,
    parse_listener_message,
    request_id_of,
)

log = logging.getLogger("emulators.relay")

MAX_LISTENERS = 25
CONTROL_CHANNEL_LIMIT = 64 * 1024
HEADER_METADATA_LIMIT = 32 * 1024
BODY_FRAGMENT_BYTES = 16 * 1024
ACCEPT_TIMEOUT = 30.0
SENDER_IDLE_TIMEOUT = 120.0
NO_LISTENER_STATUS = 503
_AUTH_HEADERS = frozenset({"servicebusauthorization"})
# Handled by the gateway itself (it already answered 100 Continue), so not forwarded.
_GATEWAY_HEADERS = frozenset({"expect"})


class _Refusal(Exception):
    """The service refuses a sender's request itself (no listener involved); answered with ``status``."""

    def __init__(self, status: int, reason: str, *, log_line: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.log_line = log_line or reason


class _ListenerFault(Exception):
    """The listener broke the protocol or went away while a request was outstanding; the sender gets 502."""


def _now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass(eq=False)
class HybridConnection:
    name: str
    declared: bool = False
    requires_client_authorization: bool = True
    user_metadata: str | None = None
    created_at: str = field(default_factory=_now_iso)
    updated_at: str = field(default_factory=_now_iso)
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
            self.result.set_exception(_ListenerFault(reason))


@dataclass(frozen=True)
class _Rejected:
    status: int
    description: str


@dataclass(eq=False)
class PendingAccept:
    listener: Listener
    decided: asyncio.Future[ServerConnection | _Rejected]
    sender: asyncio.Future[ServerConnection]


@dataclass(frozen=True)
class _ListenRole:
    name: str
    expires_at: float
    client_id: str | None


@dataclass(frozen=True)
class _SenderRole:
    accept: PendingAccept


@dataclass(frozen=True)
class _AcceptRole:
    accept: PendingAccept


@dataclass(frozen=True)
class _RendezvousRole:
    pending: PendingRequest


_Role = _ListenRole | _SenderRole | _AcceptRole | _RendezvousRole


class _RelayConnection(ServerConnection):
    """A websockets connection that first looks at the request head and hands plain HTTP to the relay."""

    relay: RelayService
    role: _Role | None = None
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


def _ws_error(status: int, description: str) -> Response:
    text = tracked(description)
    reason = text.encode("ascii", "replace").decode()[:400]
    headers = Headers([("Content-Type", "text/plain; charset=utf-8")])
    return Response(status, reason, headers, (text + "\n").encode())


def _close_reason(text: str) -> str:
    """WebSocket close reasons are limited to 123 bytes."""
    return text.encode()[:123].decode(errors="ignore")


def _strip_sb_query(query: str) -> str:
    """The query string without any ``sb-hc-`` parameter, otherwise byte-for-byte as the sender wrote it."""
    kept = [part for part in query.split("&") if part and not unquote(part).lower().startswith("sb-hc-")]
    return "&".join(kept)


def _merge_headers(headers: Iterable[tuple[str, str]], drop: Callable[[str], bool]) -> dict[str, str]:
    merged: dict[str, str] = {}
    names: dict[str, str] = {}
    for name, value in headers:
        if drop(name.lower()):
            continue
        first = names.setdefault(name.lower(), name)
        merged[first] = f"{merged[first]}, {value}" if first in merged else value
    return merged


def _fragments(body: bytes) -> bytes | list[bytes]:
    """A body as one frame, or as continuation fragments (as the service sends large bodies) when it is large."""
    if len(body) <= BODY_FRAGMENT_BYTES:
        return body
    return [body[offset : offset + BODY_FRAGMENT_BYTES] for offset in range(0, len(body), BODY_FRAGMENT_BYTES)]


class RelayService:
    """The relay namespace: hybrid connections, their listeners and the exchanges in flight (one event loop)."""

    def __init__(
        self,
        *,
        checker: TokenChecker,
        host: str = "127.0.0.1",
        port: int = 0,
        response_timeout: float = 60.0,
        accept_timeout: float = ACCEPT_TIMEOUT,
        require_known: bool = False,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.checker = checker
        self.host = host
        self.port = port
        self.response_timeout = response_timeout
        self.accept_timeout = accept_timeout
        self.require_known = require_known
        self.rng = rng or random.Random()
        self.clock = clock
        self.hybrid_connections: dict[str, HybridConnection] = {}
        self.requests: dict[str, PendingRequest] = {}
        self.accepts: dict[str, PendingAccept] = {}
        self.counters: Counter[str] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()
        self.sessions: set[SenderSession] = set()
        # Injected listener behaviour per hybrid connection (tests, the local runner): (delay before a request is
        # delivered, whether it is never delivered). Not a Relay feature: a slow or dead listener, seen from Relay.
        self.listener_faults: dict[str, tuple[float, bool]] = {}
        self._server: Server | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> int:
        connection_class = type("RelayConnection", (_RelayConnection,), {"relay": self})
        self._server = await serve(
            self._handle_websocket,
            self.host,
            self.port,
            create_connection=connection_class,
            process_request=self._process_request,
            process_response=self._process_response,
            # Plain HTTP exchanges live inside the "handshake" until the response is written; the relay's own
            # deadlines bound them, so websockets' handshake timeout must not.
            open_timeout=None,
            max_size=64 * 1024 * 1024,
            # The service does not negotiate permessage-deflate; a listener must not depend on it.
            compression=None,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        for hybrid_connection in list(self.hybrid_connections.values()):
            await self._close_all(hybrid_connection, 1001, "relay emulator shutting down")
        # Kept-alive sender connections look like unfinished handshakes to websockets; close them first so that
        # the server's wait_closed() does not wait for the senders to hang up.
        for accept in list(self.accepts.values()):
            if not accept.decided.done():
                accept.decided.set_result(_Rejected(503, "the relay is shutting down"))
        for session in list(self.sessions):
            session.close()
        for task in list(self.tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

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
        hybrid_connection.updated_at = _now_iso()
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

    # ---- WebSocket handshakes --------------------------------------------------------------------------------

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        assert isinstance(connection, _RelayConnection)
        url = urlsplit(request.path)
        if not url.path.startswith("/$hc/"):
            self.refuse("websocket_handshake", f"{url.path!r} is not under /$hc/")
            return _ws_error(404, f"WebSocket path {url.path!r} is not a hybrid connection address (/$hc/...)")
        path = unquote(url.path.removeprefix("/$hc/")).strip("/")
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        action = query.get("sb-hc-action", "")
        if not path:
            return _ws_error(404, "the address names no hybrid connection")
        if action == "listen":
            return self._admit_listener(connection, request, path, query)
        if action == "connect":
            return await self._admit_sender(connection, request, path, url.query)
        if action in ("accept", "request"):
            return self._admit_rendezvous(connection, action, path, query)
        self.refuse("websocket_handshake", f"sb-hc-action={action!r}")
        return _ws_error(400, f"unrecognized sb-hc-action {action!r} (listen, connect, accept or request)")

    def _authorize(self, token: str | None, name: str, right: Right, what: str) -> Response | float:
        try:
            return self.checker.authorize(token, hybrid_connection=name, right=right).expires_at
        except AuthError as error:
            self.refuse(what, f"{name}: {error.reason}")
            return _ws_error(error.status, error.reason)

    def _admit_listener(
        self, connection: _RelayConnection, request: Request, path: str, query: dict[str, str]
    ) -> Response | None:
        known = self.hybrid_connections.get(path.lower())
        if self.require_known and (known is None or not known.declared):
            self.refuse("listener", f"unknown hybrid connection {path!r}")
            return _ws_error(404, f"hybrid connection {path!r} does not exist in this namespace")
        token = query.get("sb-hc-token") or request.headers.get("ServiceBusAuthorization")
        verdict = self._authorize(token, path, Right.LISTEN, "listener")
        if isinstance(verdict, Response):
            return verdict
        connection.role = _ListenRole(name=path, expires_at=verdict, client_id=query.get("sb-hc-id"))
        return None

    def _process_response(self, connection: ServerConnection, request: Request, response: Response) -> Response | None:
        # The listener cap is checked and the slot taken with no await in between, so concurrent handshakes
        # cannot both take the 25th slot.
        assert isinstance(connection, _RelayConnection)
        role = connection.role
        if response.status_code != 101 or not isinstance(role, _ListenRole):
            return None
        hybrid_connection = self.hybrid_connections.get(role.name.lower())
        if self.require_known and (hybrid_connection is None or not hybrid_connection.declared):
            # Deleted while this handshake was being checked.
            connection.role = None
            return _ws_error(404, f"hybrid connection {role.name!r} does not exist in this namespace")
        if hybrid_connection is None:
            hybrid_connection = HybridConnection(name=role.name)
            self.hybrid_connections[role.name.lower()] = hybrid_connection
        if len(hybrid_connection.listeners) >= MAX_LISTENERS:
            connection.role = None
            self.refuse("listener", f"{role.name}: already {MAX_LISTENERS} listeners")
            return _ws_error(403, f"QuotaExceeded: hybrid connection {role.name!r} has {MAX_LISTENERS} listeners")
        connection.listener = Listener(
            conn=connection, hybrid_connection=hybrid_connection, expires_at=role.expires_at, client_id=role.client_id
        )
        hybrid_connection.listeners.append(connection.listener)
        self.counters[f"listener.{hybrid_connection.name.lower()}"] += 1
        return None

    def _sender_token(self, headers: Iterable[tuple[str, str]], query: str, *, allow_authorization: bool) -> str | None:
        by_name = {name.lower(): value for name, value in headers}
        token = dict(parse_qsl(query, keep_blank_values=True)).get("sb-hc-token") or by_name.get(
            "servicebusauthorization"
        )
        if token is None and allow_authorization:
            token = by_name.get("authorization")
        return token

    async def _admit_sender(  # noqa: PLR0911 - one return per documented handshake outcome
        self, connection: _RelayConnection, request: Request, path: str, raw_query: str
    ) -> Response | None:
        hybrid_connection = self._route(path)
        if hybrid_connection is None and self.require_known:
            self.refuse("sender", f"unknown hybrid connection {path!r}")
            return _ws_error(404, f"no hybrid connection at {path!r}")
        name = hybrid_connection.name if hybrid_connection else path
        if hybrid_connection is None or hybrid_connection.requires_client_authorization:
            token = self._sender_token(request.headers.raw_items(), raw_query, allow_authorization=False)
            verdict = self._authorize(token, name, Right.SEND, "sender")
            if isinstance(verdict, Response):
                return verdict
        listener = self._pick_listener(hybrid_connection) if hybrid_connection else None
        if listener is None or hybrid_connection is None:
            self.refuse("sender", f"no listener on {name!r}")
            return _ws_error(NO_LISTENER_STATUS, f"no listener is connected to hybrid connection {name!r}")
        query = dict(parse_qsl(raw_query, keep_blank_values=True))
        # The id the listener sees is the sender's sb-hc-id when given; the address carries a fresh key so that
        # two senders choosing the same id cannot take each other's rendezvous.
        rendezvous_key = str(uuid.uuid4())
        accept_id = query.get("sb-hc-id") or rendezvous_key
        loop = asyncio.get_running_loop()
        accept = PendingAccept(listener, decided=loop.create_future(), sender=loop.create_future())
        self.accepts[rendezvous_key] = accept
        passthrough = _strip_sb_query(raw_query)
        address = (
            f"ws://{self.authority}/$hc/{quote(path)}?{passthrough + '&' if passthrough else ''}"
            f"sb-hc-action=accept&sb-hc-id={rendezvous_key}"
        )
        headers = _merge_headers(request.headers.raw_items(), lambda name: name in _AUTH_HEADERS)
        remote = connection.remote_address
        message = AcceptMessage(
            address=address,
            id=accept_id,
            connect_headers=headers,
            remote_endpoint={"address": remote[0], "port": remote[1]} if remote else None,
        )
        try:
            async with asyncio.timeout(self.accept_timeout):
                async with listener.send_lock:
                    await listener.conn.send(message.to_json("accept"))
                decision = await accept.decided
        except TimeoutError:
            self.refuse("sender", f"listener did not accept {accept_id} within {self.accept_timeout} s")
            return _ws_error(504, f"the listener did not accept the connection within {self.accept_timeout} s")
        except ConnectionClosed:
            return _ws_error(502, "the listener went away before accepting the connection")
        finally:
            self.accepts.pop(rendezvous_key, None)
        if isinstance(decision, _Rejected):
            return _ws_error(decision.status, decision.description)
        connection.role = _SenderRole(accept)
        return None

    def _admit_rendezvous(
        self, connection: _RelayConnection, action: str, path: str, query: dict[str, str]
    ) -> Response | None:
        rendezvous_id = query.get("sb-hc-id", "")
        if action == "accept":
            accept = self.accepts.get(rendezvous_id)
            if accept is None or accept.decided.done():
                self.refuse("rendezvous", f"accept address {rendezvous_id!r} unknown, used or expired")
                return _ws_error(403, "the accept address is not valid (unknown, already used or expired)")
            status = query.get("sb-hc-statusCode")
            if status is not None:
                description = query.get("sb-hc-statusDescription", "")
                code = int(status) if status.isdigit() and 400 <= int(status) <= 599 else 400
                accept.decided.set_result(_Rejected(code, description or HTTPStatus(code).phrase))
                self.counters["rejected"] += 1
                # The reject handshake ends in 410 by design: no WebSocket is established.
                return _ws_error(410, "the sender's connection was rejected as requested")
            connection.role = _AcceptRole(accept)
            self.counters["accepted"] += 1
            return None
        pending = self.requests.get(rendezvous_id)
        if pending is None or pending.rendezvous.done():
            self.refuse("rendezvous", f"request address {rendezvous_id!r} unknown, used or expired")
            return _ws_error(403, "the rendezvous address has expired or was already used")
        if pending.listener.hybrid_connection.name.lower() != path.lower():
            return _ws_error(400, "the rendezvous address does not match the hybrid connection")
        self.counters["rendezvous.request" if pending.rendezvous_first else "rendezvous.response"] += 1
        connection.role = _RendezvousRole(pending)
        return None

    async def _handle_websocket(self, connection: ServerConnection) -> None:
        assert isinstance(connection, _RelayConnection)
        role = connection.role
        if isinstance(role, _ListenRole):
            await self._serve_listener(connection)
        elif isinstance(role, _RendezvousRole):
            await self._serve_rendezvous(connection, role.pending)
        elif isinstance(role, _AcceptRole):
            await self._serve_accepted(connection, role.accept)
        elif isinstance(role, _SenderRole):
            await self._serve_sender(connection, role.accept)

    # ---- listener control channel ----------------------------------------------------------------------------

    async def _serve_listener(self, conn: _RelayConnection) -> None:
        listener = conn.listener
        assert listener is not None
        hybrid_connection = listener.hybrid_connection
        listener.ready.set()
        log.info(
            "relay: listener %s on %s connected (%d now)",
            listener.client_id or "-",
            hybrid_connection.name,
            len(hybrid_connection.listeners),
        )
        expiry = asyncio.create_task(self._expire(listener))
        awaiting: tuple[PendingRequest | None, ResponseMessage] | None = None
        try:
            async for frame in conn:
                if isinstance(frame, bytes):
                    if awaiting is None:
                        self.refuse("listener_frame", f"{hybrid_connection.name}: binary frame without a response")
                        continue
                    target, response = awaiting
                    awaiting = None
                    if target is not None and len(frame) > CONTROL_CHANNEL_LIMIT:
                        self.refuse("listener_frame", f"{hybrid_connection.name}: {len(frame)}-byte body on control")
                        target.fail(
                            f"the listener sent a {len(frame)}-byte response body on the control channel; "
                            f"above {CONTROL_CHANNEL_LIMIT} bytes it must respond over the rendezvous address"
                        )
                    elif target is not None:
                        target.complete(response, frame)
                    continue
                if awaiting is not None:
                    target, _ = awaiting
                    awaiting = None
                    if target is not None:
                        target.fail("the response announced a body but the next frame was text")
                awaiting = await self._on_control_text(listener, frame)
                if conn.close_code is not None:
                    break
        except ConnectionClosed:
            pass
        finally:
            expiry.cancel()
            self._drop_listener(listener)

    async def _on_control_text(
        self, listener: Listener, frame: str
    ) -> tuple[PendingRequest | None, ResponseMessage] | None:
        name = listener.hybrid_connection.name
        try:
            message = parse_listener_message(frame)
        except ControlMessageError as error:
            self.refuse("listener_frame", f"{name}: {error}")
            request_id = request_id_of(frame)
            if request_id is not None and request_id in listener.pending:
                listener.pending[request_id].fail(f"invalid response from the listener: {error}")
            return None
        if isinstance(message, RenewTokenMessage):
            try:
                grant = self.checker.authorize(message.token, hybrid_connection=name, right=Right.LISTEN)
            except AuthError as error:
                self.refuse("renew_token", f"{name}: {error.reason}")
                await listener.conn.close(1008, _close_reason(f"renewToken refused: {error.reason}"))
                return None
            listener.expires_at = grant.expires_at
            listener.token_renewed.set()
            return None
        pending = listener.pending.get(message.request_id)
        if pending is None:
            self.refuse("listener_frame", f"{name}: response for unknown request {message.request_id!r}")
        elif not message.body:
            pending.complete(message, b"")
            return None
        return (pending, message) if message.body else None

    async def _expire(self, listener: Listener) -> None:
        while True:
            remaining = listener.expires_at - self.clock()
            if remaining <= 0:
                self.refuse("listener", f"{listener.hybrid_connection.name}: token expired on the control channel")
                await listener.conn.close(1008, "the security token has expired; send renewToken before expiry")
                return
            listener.token_renewed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await listener.token_renewed.wait()

    def _drop_listener(self, listener: Listener) -> None:
        hybrid_connection = listener.hybrid_connection
        with contextlib.suppress(ValueError):
            hybrid_connection.listeners.remove(listener)
        for pending in list(listener.pending.values()):
            if not pending.rendezvous.done():
                pending.fail("the listener disconnected before responding")
        for accept in list(self.accepts.values()):
            if accept.listener is listener and not accept.decided.done():
                accept.decided.set_result(_Rejected(502, "the listener disconnected before accepting"))
        if not hybrid_connection.declared and not hybrid_connection.listeners and not hybrid_connection.sockets:
            current = self.hybrid_connections.get(hybrid_connection.name.lower())
            if current is hybrid_connection:
                del self.hybrid_connections[hybrid_connection.name.lower()]
        log.info(
            "relay: listener %s on %s left (%d remain)",
            listener.client_id or "-",
            hybrid_connection.name,
            len(hybrid_connection.listeners),
        )

    # ---- HTTP senders ----------------------------------------------------------------------------------------

    async def serve_http(self, reader: asyncio.StreamReader, transport: asyncio.Transport) -> None:
        """Serves one sender connection: requests in turn until it closes, asks to close, or an answer ends it."""
        session = SenderSession(transport)
        self.sessions.add(session)
        try:
            while not session.closed.is_set():
                try:
                    async with asyncio.timeout(SENDER_IDLE_TIMEOUT):
                        request = await read_request(
                            reader, send_continue=lambda: transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                        )
                except HttpError as error:
                    self.refuse("http_request", error.reason)
                    answer = service_error(error.status, error.reason)
                    transport.write(render_response(answer.status, answer.reason, answer.headers, answer.body))
                    return
                if request is None:
                    return
                session.busy = True
                try:
                    answered = await self._dispatch_http(request, session)
                except Exception:
                    log.exception("relay: internal error while relaying an HTTP request")
                    answered = service_error(500, "internal error in the relay emulator")
                session.busy = False
                if answered is None:
                    # The listener dropped the rendezvous socket mid-request: the sender's connection goes too.
                    return
                keep_alive = request.keep_alive and not session.doomed
                transport.write(
                    render_response(
                        answered.status,
                        answered.reason,
                        answered.headers,
                        answered.body,
                        head_only=request.method == "HEAD",
                        keep_alive=keep_alive,
                    )
                )
                if not keep_alive:
                    return
        except TimeoutError:
            return
        finally:
            session.close()
            self.sessions.discard(session)

    async def _dispatch_http(self, request: HttpRequest, session: SenderSession) -> HttpAnswer | None:
        management = await handle_management(self, request)
        if management is not None:
            return management
        try:
            hybrid_connection, relay_auth_header = self._admit_http_sender(request)
        except _Refusal as refusal:
            self.refuse("http_request", refusal.log_line)
            return service_error(refusal.status, refusal.reason)

        def dropped(header: str) -> bool:
            return (
                header in HOP_BY_HOP_HEADERS
                or header in _AUTH_HEADERS
                or header in _GATEWAY_HEADERS
                or header == relay_auth_header
            )

        query = _strip_sb_query(request.query)
        request_id = str(uuid.uuid4())
        message = RequestMessage(
            address=(
                f"ws://{self.authority}/$hc/{quote(hybrid_connection.name)}?sb-hc-action=request&sb-hc-id={request_id}"
            ),
            id=request_id,
            request_target=request.path + (f"?{query}" if query else ""),
            method=request.method,
            request_headers=_merge_headers(request.headers, dropped),
            body=bool(request.body),
        )
        if session.rendezvous is not None and session.rendezvous_hc is hybrid_connection:
            message.address = None
            return await self._exchange_on_rendezvous(session, session.rendezvous, message, request.body)
        listener = self._pick_listener(hybrid_connection)
        if listener is None:
            self.refuse("http_request", f"no listener on {hybrid_connection.name!r}")
            return service_error(
                NO_LISTENER_STATUS, f"no listener is connected to hybrid connection {hybrid_connection.name!r}"
            )
        metadata = len(message.to_json("request"))
        loop = asyncio.get_running_loop()
        pending = PendingRequest(
            id=request_id,
            listener=listener,
            session=session,
            message=message,
            body=request.body,
            rendezvous_first=(
                request.chunked
                or metadata > HEADER_METADATA_LIMIT
                or metadata + len(request.body) > CONTROL_CHANNEL_LIMIT
            ),
            result=loop.create_future(),
            rendezvous=loop.create_future(),
        )
        return await self._exchange(pending)

    def _admit_http_sender(self, request: HttpRequest) -> tuple[HybridConnection, str | None]:
        """The addressed hybrid connection and the header that carried the relay token (to strip), or _Refusal."""
        path = unquote(request.path).strip("/")
        if request.method == "CONNECT":
            raise _Refusal(405, "the CONNECT method cannot be relayed")
        if path.startswith("$hc/") or not path:
            raise _Refusal(
                400 if path.startswith("$hc/") else 404,
                "HTTP senders address https://{namespace}/{path}; $hc/ is for WebSockets",
                log_line=f"{request.method} {request.path!r}",
            )
        hybrid_connection = self._route(path)
        if hybrid_connection is None and self.require_known:
            raise _Refusal(404, f"no hybrid connection at {path!r}")
        name = hybrid_connection.name if hybrid_connection else path.split("/")[0]
        relay_auth_header: str | None = None
        if hybrid_connection is None or hybrid_connection.requires_client_authorization:
            token = self._sender_token(request.headers, request.query, allow_authorization=True)
            query_token = request.query_value("sb-hc-token")
            if query_token is None and request.header("ServiceBusAuthorization") is None and token is not None:
                relay_auth_header = "authorization"
            try:
                self.checker.authorize(token, hybrid_connection=name, right=Right.SEND)
            except AuthError as error:
                raise _Refusal(error.status, error.reason, log_line=f"{name}: {error.reason}") from None
        if hybrid_connection is None:
            raise _Refusal(NO_LISTENER_STATUS, f"no listener is connected to hybrid connection {name!r}")
        return hybrid_connection, relay_auth_header

    async def _exchange(self, pending: PendingRequest) -> HttpAnswer | None:
        """Delivers a request on the listener's control channel (or announces it for rendezvous) and awaits the
        response wherever the listener sends it: on the control channel or on a rendezvous socket it opens."""
        listener = pending.listener
        self.requests[pending.id] = pending
        listener.pending[pending.id] = pending
        try:
            async with asyncio.timeout(self.response_timeout):
                await self._injected_fault(pending)
                async with listener.send_lock:
                    if pending.rendezvous_first:
                        announcement = RequestMessage(address=pending.message.address, id=pending.id)
                        await listener.conn.send(announcement.to_json("request"))
                    else:
                        await listener.conn.send(pending.message.to_json("request"))
                        if pending.body:
                            await listener.conn.send(_fragments(pending.body))
                either: set[asyncio.Future[Any]] = {pending.result, pending.rendezvous}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if pending.result.done():
                    response, body = pending.result.result()
                else:
                    conn = pending.rendezvous.result()
                    pending.session.attach(conn, listener.hybrid_connection)
                    if pending.rendezvous_first:
                        await self._send_request(conn, pending.message, pending.body)
                    response, body = await self._read_response(conn, pending.id)
        except TimeoutError:
            self.refuse("http_request", f"listener did not respond to {pending.id} within {self.response_timeout} s")
            return service_error(504, f"the listener did not respond within {self.response_timeout} s")
        except ConnectionClosed:
            if pending.rendezvous.done():
                return None
            return service_error(502, "the listener disconnected before the request was delivered")
        except _ListenerFault as fault:
            self.refuse("http_request", f"{pending.id}: {fault}")
            return service_error(502, str(fault))
        finally:
            self.requests.pop(pending.id, None)
            listener.pending.pop(pending.id, None)
        return self._relayed(response, body)

    async def _injected_fault(self, pending: PendingRequest) -> None:
        """A slow listener's delay, or a dead one's silence: the caller's timeout ends it, or the listener leaving
        (its failure is raised here, as for a request it had taken)."""
        delay, dead = self.listener_faults.get(pending.listener.hybrid_connection.name, (0.0, False))
        if dead:
            await asyncio.wait({pending.result})
            pending.result.result()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _exchange_on_rendezvous(
        self, session: SenderSession, conn: ServerConnection, message: RequestMessage, body: bytes
    ) -> HttpAnswer | None:
        try:
            async with asyncio.timeout(self.response_timeout):
                await self._send_request(conn, message, body)
                response, response_body = await self._read_response(conn, message.id)
        except TimeoutError:
            self.refuse("http_request", f"listener did not respond to {message.id} within {self.response_timeout} s")
            return service_error(504, f"the listener did not respond within {self.response_timeout} s")
        except ConnectionClosed:
            return None
        except _ListenerFault as fault:
            self.refuse("http_request", f"{message.id}: {fault}")
            return service_error(502, str(fault))
        return self._relayed(response, response_body)

    @staticmethod
    async def _send_request(conn: ServerConnection, message: RequestMessage, body: bytes) -> None:
        await conn.send(message.to_json("request"))
        if body:
            await conn.send(_fragments(body))

    async def _read_response(self, conn: ServerConnection, request_id: str) -> tuple[ResponseMessage, bytes]:
        """The response to ``request_id`` from a rendezvous socket (no size limit there)."""
        frame = await conn.recv()
        if not isinstance(frame, str):
            raise _ListenerFault("the first frame of a response on the rendezvous socket must be text")
        try:
            message = parse_listener_message(frame)
        except ControlMessageError as error:
            raise _ListenerFault(f"invalid response from the listener: {error}") from None
        if not isinstance(message, ResponseMessage) or message.request_id != request_id:
            raise _ListenerFault("the rendezvous socket carried something other than this request's response")
        if not message.body:
            return message, b""
        body = await conn.recv()
        if not isinstance(body, bytes):
            raise _ListenerFault("the response announced a body but the next frame was text")
        return message, body

    def _relayed(self, response: ResponseMessage, body: bytes) -> HttpAnswer:
        headers = [
            (name, value)
            for name, value in response.response_headers.items()
            if name.lower() not in HOP_BY_HOP_HEADERS and name.lower() != "via"
        ]
        via = next((value for name, value in response.response_headers.items() if name.lower() == "via"), None)
        headers.append(("Via", f"{via + ', ' if via else ''}1.1 {self.authority}"))
        return HttpAnswer(response.status_code, response.status_description, headers, body)

    async def _serve_rendezvous(self, conn: _RelayConnection, pending: PendingRequest) -> None:
        """Hands the socket to the waiting exchange; keeps it as long as the sender's connection lasts."""
        hybrid_connection = pending.listener.hybrid_connection
        session = pending.session
        hybrid_connection.sockets.add(conn)
        if not pending.rendezvous.done():
            pending.rendezvous.set_result(conn)
        sender_gone: asyncio.Task[Any] = asyncio.create_task(session.closed.wait())
        listener_gone: asyncio.Task[Any] = asyncio.create_task(conn.wait_closed())
        try:
            await asyncio.wait({sender_gone, listener_gone}, return_when=asyncio.FIRST_COMPLETED)
            if session.closed.is_set():
                await conn.close(1001, "the sender closed its connection")
            elif session.rendezvous is conn:
                # The listener dropped it: the sender's connection goes too (after an answer in progress).
                session.rendezvous = session.rendezvous_hc = None
                session.doomed = True
                if not session.busy:
                    session.close()
        finally:
            sender_gone.cancel()
            listener_gone.cancel()
            hybrid_connection.sockets.discard(conn)

    # ---- WebSocket senders (accept + bridge) -----------------------------------------------------------------

    async def _serve_accepted(self, conn: _RelayConnection, accept: PendingAccept) -> None:
        hybrid_connection = accept.listener.hybrid_connection
        hybrid_connection.sockets.add(conn)
        try:
            if not accept.decided.done():
                accept.decided.set_result(conn)
            try:
                async with asyncio.timeout(self.accept_timeout):
                    sender = await accept.sender
            except TimeoutError:
                await conn.close(1001, "the sender went away before the connection was established")
                return
            await self._pump(conn, sender)
        finally:
            hybrid_connection.sockets.discard(conn)

    async def _serve_sender(self, conn: _RelayConnection, accept: PendingAccept) -> None:
        decided = accept.decided.result()
        assert isinstance(decided, ServerConnection)
        hybrid_connection = accept.listener.hybrid_connection
        hybrid_connection.sockets.add(conn)
        try:
            accept.sender.set_result(conn)
            await self._pump(conn, decided)
        finally:
            hybrid_connection.sockets.discard(conn)

    @staticmethod
    async def _pump(source: ServerConnection, target: ServerConnection) -> None:
        """Relays messages one way until the source closes, then closes the target with the same code."""
        try:
            async for message in source:
                await target.send(message)
        except ConnectionClosed:
            pass
        code = source.close_code if source.close_code not in (None, 1005, 1006, 1015) else 1000
        await target.close(code or 1000, _close_reason(source.close_reason or ""))
