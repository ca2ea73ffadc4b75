"""A listener's control channel: its responses (small bodies inline), its token renewals, its token's expiry, and
what its leaving fails (the requests and accepts it had not answered)."""

from __future__ import annotations

import asyncio
import contextlib

from websockets.exceptions import ConnectionClosed

from emulators.relay.auth import AuthError, Right
from emulators.relay.connection import RelayConnection
from emulators.relay.messages import (
    ControlMessageError,
    RenewTokenMessage,
    ResponseMessage,
    parse_listener_message,
    request_id_of,
)
from emulators.relay.namespace import (
    CONTROL_CHANNEL_LIMIT,
    Listener,
    Namespace,
    PendingRequest,
    Rejected,
    close_reason,
    log,
)


class ListenerChannel(Namespace):
    """The namespace's side of each listener's control channel."""

    async def _serve_listener(self, conn: RelayConnection) -> None:
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
                await listener.conn.close(1008, close_reason(f"renewToken refused: {error.reason}"))
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
                accept.decided.set_result(Rejected(502, "the listener disconnected before accepting"))
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
