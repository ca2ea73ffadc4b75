"""HTTP senders: each sender connection's requests in turn, relayed to a listener on its control channel or over a
rendezvous socket the listener opens (large requests and responses, and the connection's later requests), with the
service's own refusals, deadlines and the injected listener faults."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from urllib.parse import quote, unquote

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from emulators.relay.auth import AuthError, Right
from emulators.relay.connection import RelayConnection
from emulators.relay.httpwire import HttpAnswer, HttpError, HttpRequest, read_request, render_response, service_error
from emulators.relay.management import handle_management
from emulators.relay.messages import (
    AUTH_HEADERS,
    HOP_BY_HOP_HEADERS,
    ControlMessageError,
    RequestMessage,
    ResponseMessage,
    merge_headers,
    parse_listener_message,
    strip_sb_query,
)
from emulators.relay.namespace import (
    BODY_FRAGMENT_BYTES,
    CONTROL_CHANNEL_LIMIT,
    HEADER_METADATA_LIMIT,
    NO_LISTENER_STATUS,
    SENDER_IDLE_TIMEOUT,
    HybridConnection,
    ListenerFault,
    Namespace,
    PendingRequest,
    SenderSession,
    log,
)
from emulators.status_error import StatusError

# Handled by the gateway itself (it already answered 100 Continue), so not forwarded.
_GATEWAY_HEADERS = frozenset({"expect"})


class _Refusal(StatusError):
    """The service refuses a sender's request itself (no listener involved); answered with ``status``."""

    def __init__(self, status: int, reason: str, *, log_line: str | None = None) -> None:
        super().__init__(status, reason)
        self.log_line = log_line or reason


def _fragments(body: bytes) -> bytes | list[bytes]:
    """A body as one frame, or as continuation fragments (as the service sends large bodies) when it is large."""
    if len(body) <= BODY_FRAGMENT_BYTES:
        return body
    return [body[offset : offset + BODY_FRAGMENT_BYTES] for offset in range(0, len(body), BODY_FRAGMENT_BYTES)]


class HttpSenders(Namespace):
    """The namespace's HTTP senders and the rendezvous sockets their requests travel on."""

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
                or header in AUTH_HEADERS
                or header in _GATEWAY_HEADERS
                or header == relay_auth_header
            )

        query = strip_sb_query(request.query)
        request_id = str(uuid.uuid4())
        message = RequestMessage(
            address=(
                f"{self.ws_scheme}://{self.authority}/$hc/{quote(hybrid_connection.name)}?sb-hc-action=request&sb-hc-id={request_id}"
            ),
            id=request_id,
            request_target=request.path + (f"?{query}" if query else ""),
            method=request.method,
            request_headers=merge_headers(request.headers, dropped),
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
        except ListenerFault as fault:
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
        except ListenerFault as fault:
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
            raise ListenerFault("the first frame of a response on the rendezvous socket must be text")
        try:
            message = parse_listener_message(frame)
        except ControlMessageError as error:
            raise ListenerFault(f"invalid response from the listener: {error}") from None
        if not isinstance(message, ResponseMessage) or message.request_id != request_id:
            raise ListenerFault("the rendezvous socket carried something other than this request's response")
        if not message.body:
            return message, b""
        body = await conn.recv()
        if not isinstance(body, bytes):
            raise ListenerFault("the response announced a body but the next frame was text")
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

    async def _serve_rendezvous(self, conn: RelayConnection, pending: PendingRequest) -> None:
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
