"""The asyncio core of the Relay emulator: one port for listeners, WebSocket senders and HTTP senders.

WebSocket upgrades are handled by the ``websockets`` server (admitted in :mod:`handshakes`); a plain HTTP request on
the same port is recognised from its head before websockets sees it (websockets refuses request bodies) and is
handled by :mod:`http_senders`. Here: the server's lifecycle, each WebSocket served by its role, and the bridge
between a WebSocket sender and the listener that accepted it.
"""

from __future__ import annotations

import asyncio

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from emulators.relay.connection import AcceptRole, ListenRole, RelayConnection, RendezvousRole, SenderRole
from emulators.relay.control_channel import ListenerChannel
from emulators.relay.handshakes import Handshakes
from emulators.relay.http_senders import HttpSenders
from emulators.relay.namespace import PendingAccept, Rejected, close_reason

__all__ = ["RelayService"]


class RelayService(Handshakes, ListenerChannel, HttpSenders):
    """The relay namespace served on one port."""

    _server: Server | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> int:
        connection_class = type("RelayConnection", (RelayConnection,), {"relay": self})
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
            ssl=self.tls,
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
                accept.decided.set_result(Rejected(503, "the relay is shutting down"))
        for session in list(self.sessions):
            session.close()
        for task in list(self.tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle_websocket(self, connection: ServerConnection) -> None:
        assert isinstance(connection, RelayConnection)
        role = connection.role
        if isinstance(role, ListenRole):
            await self._serve_listener(connection)
        elif isinstance(role, RendezvousRole):
            await self._serve_rendezvous(connection, role.pending)
        elif isinstance(role, AcceptRole):
            await self._serve_accepted(connection, role.accept)
        elif isinstance(role, SenderRole):
            await self._serve_sender(connection, role.accept)

    # ---- WebSocket senders (accept + bridge) -----------------------------------------------------------------

    async def _serve_accepted(self, conn: RelayConnection, accept: PendingAccept) -> None:
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

    async def _serve_sender(self, conn: RelayConnection, accept: PendingAccept) -> None:
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
        await target.close(code or 1000, close_reason(source.close_reason or ""))
