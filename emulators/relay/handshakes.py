"""The relay's WebSocket handshakes: each upgrade on ``/$hc/`` admitted as a listener (token, the listener cap), a
sender (token, a listener's accept), or a rendezvous socket a listener opens (accept or request), or refused."""

from __future__ import annotations

import asyncio
import uuid
from http import HTTPStatus
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from emulators.relay.auth import AuthError, Right
from emulators.relay.connection import AcceptRole, ListenRole, RelayConnection, RendezvousRole, SenderRole
from emulators.relay.httpwire import tracked
from emulators.relay.messages import AUTH_HEADERS, AcceptMessage, merge_headers, strip_sb_query
from emulators.relay.namespace import (
    MAX_LISTENERS,
    NO_LISTENER_STATUS,
    HybridConnection,
    Listener,
    Namespace,
    PendingAccept,
    Rejected,
)


def _ws_error(status: int, description: str) -> Response:
    text = tracked(description)
    reason = text.encode("ascii", "replace").decode()[:400]
    headers = Headers([("Content-Type", "text/plain; charset=utf-8")])
    return Response(status, reason, headers, (text + "\n").encode())


class Handshakes(Namespace):
    """The namespace's WebSocket handshakes (websockets' ``process_request`` and ``process_response``)."""

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        assert isinstance(connection, RelayConnection)
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
        self, connection: RelayConnection, request: Request, path: str, query: dict[str, str]
    ) -> Response | None:
        known = self.hybrid_connections.get(path.lower())
        if self.require_known and (known is None or not known.declared):
            self.refuse("listener", f"unknown hybrid connection {path!r}")
            return _ws_error(404, f"hybrid connection {path!r} does not exist in this namespace")
        token = query.get("sb-hc-token") or request.headers.get("ServiceBusAuthorization")
        verdict = self._authorize(token, path, Right.LISTEN, "listener")
        if isinstance(verdict, Response):
            return verdict
        connection.role = ListenRole(name=path, expires_at=verdict, client_id=query.get("sb-hc-id"))
        return None

    def _process_response(self, connection: ServerConnection, request: Request, response: Response) -> Response | None:
        # The listener cap is checked and the slot taken with no await in between, so concurrent handshakes
        # cannot both take the 25th slot.
        assert isinstance(connection, RelayConnection)
        role = connection.role
        if response.status_code != 101 or not isinstance(role, ListenRole):
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

    async def _admit_sender(  # noqa: PLR0911 - one return per documented handshake outcome
        self, connection: RelayConnection, request: Request, path: str, raw_query: str
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
        passthrough = strip_sb_query(raw_query)
        address = (
            f"{self.ws_scheme}://{self.authority}/$hc/{quote(path)}?{passthrough + '&' if passthrough else ''}"
            f"sb-hc-action=accept&sb-hc-id={rendezvous_key}"
        )
        headers = merge_headers(request.headers.raw_items(), lambda name: name in AUTH_HEADERS)
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
        if isinstance(decision, Rejected):
            return _ws_error(decision.status, decision.description)
        connection.role = SenderRole(accept)
        return None

    def _admit_rendezvous(
        self, connection: RelayConnection, action: str, path: str, query: dict[str, str]
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
                accept.decided.set_result(Rejected(code, description or HTTPStatus(code).phrase))
                self.counters["rejected"] += 1
                # The reject handshake ends in 410 by design: no WebSocket is established.
                return _ws_error(410, "the sender's connection was rejected as requested")
            connection.role = AcceptRole(accept)
            self.counters["accepted"] += 1
            return None
        pending = self.requests.get(rendezvous_id)
        if pending is None or pending.rendezvous.done():
            self.refuse("rendezvous", f"request address {rendezvous_id!r} unknown, used or expired")
            return _ws_error(403, "the rendezvous address has expired or was already used")
        if pending.listener.hybrid_connection.name.lower() != path.lower():
            return _ws_error(400, "the rendezvous address does not match the hybrid connection")
        self.counters["rendezvous.request" if pending.rendezvous_first else "rendezvous.response"] += 1
        connection.role = RendezvousRole(pending)
        return None
