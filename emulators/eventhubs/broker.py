"""The AMQP 1.0 side of the emulator: proton's protocol engine driven by a selector loop on one thread.

proton's ``Container`` would own the sockets; driving ``Transport``/``Collector`` directly instead lets the
outgoing bytes pass through :class:`~emulators.eventhubs.framing.FramePadder` (see there why), lets the listener
bind port 0 and report it, and lets ``stop()`` drop every connection at once, as an outage would.

Here the loop and each AMQP event to its handler; the links and transfers are in ``links``, the $cbs and
$management nodes in ``control_nodes``. Everything runs on the broker thread; the only shared state is the
:class:`EventStore` (locked).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import ssl
import time
from collections.abc import Callable

from proton import (
    Collector,
    Condition,
    Connection,
    Event,
    Transport,
)

from emulators.eventhubs.broker_state import Peer
from emulators.eventhubs.framing import FramePadder, FramingError
from emulators.eventhubs.links import Links
from emulators.eventhubs.tls_pipe import TlsPipe

_LOG = logging.getLogger("emulators.eventhubs")

_READ_SIZE = 65536

__all__ = ["Broker"]


class Broker(Links):
    """Serves the store over AMQP on ``host:port`` until :meth:`request_stop`."""

    def call_soon(self, call: Callable[[], None]) -> None:
        """Thread-safe: run ``call`` on the broker thread (the REST front door's publishes, eventhubs/rest.py)."""
        self._calls.put(call)
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"x")

    # ---------------------------------------------------------------- loop

    def request_stop(self) -> None:
        """Thread-safe: the loop drops every connection and the listener, then returns."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"x")

    def serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
        try:
            deadline = 0.0
            while not self._stopping.is_set():
                timeout = None if deadline == 0 else max(0.0, deadline - time.monotonic())
                for key, mask in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_reader:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_reader.recv(64)
                        while not self._calls.empty():
                            self._calls.get_nowait()()
                    else:
                        peer: Peer = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(peer)
                        if mask & selectors.EVENT_WRITE:
                            self._write(peer)
                deadline = self._service_peers()
        finally:
            for peer in list(self._peers):
                self._drop(peer)
            self._selector.close()
            self._listener.close()
            self._wake_reader.close()
            self._wake_writer.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            transport = Transport(Transport.SERVER)
            # The SDK offers SASL ANONYMOUS and then authorizes every link with a CBS token.
            transport.sasl().allowed_mechs("ANONYMOUS")
            connection = Connection()
            collector = Collector()
            connection.collect(collector)
            transport.bind(connection)
            tls = TlsPipe(self._tls) if self._tls is not None else None
            peer = Peer(sock, transport, connection, collector, FramePadder(), tls=tls)
            self._peers.append(peer)
            self._stats.connections += 1
            self._selector.register(sock, selectors.EVENT_READ, peer)
            _LOG.debug("accepted AMQP connection from %s:%d", *address[:2])

    def _read(self, peer: Peer) -> None:
        capacity = peer.transport.capacity()
        if capacity == 0 or peer.inbox:  # proton has no room; it drains in _service_peers right after this
            return
        try:
            data = peer.sock.recv(_READ_SIZE if capacity < 0 else min(capacity, _READ_SIZE))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if capacity < 0:
            # proton has closed its input (after a close or a protocol error): discard the rest until EOF,
            # so a readable socket cannot spin the loop.
            if not data:
                self._drop(peer)
        elif not data:
            peer.transport.close_tail()
        elif peer.tls is None:
            peer.transport.push(data)
        else:
            self._decrypt(peer, peer.tls, data)

    def _decrypt(self, peer: Peer, tls: TlsPipe, data: bytes) -> None:
        try:
            peer.inbox += tls.receive(data)
        except ssl.SSLError as error:
            self._stats.tls_refused += 1
            _LOG.info("TLS with a client failed, dropping its connection: %s", error)
            self._drop(peer)
            return
        peer.out += tls.outgoing()  # the handshake's records
        self._feed(peer)
        if peer.out:
            self._write(peer)

    def _feed(self, peer: Peer) -> bool:
        """Hands proton what it has room for of the plaintext waiting; whether it took any."""
        capacity = peer.transport.capacity()
        if capacity < 0:  # proton's input is closed (after which this never runs again)
            peer.inbox.clear()
            return False
        taken = min(capacity, len(peer.inbox))
        if taken:
            peer.transport.push(bytes(peer.inbox[:taken]))
            del peer.inbox[:taken]
        if not peer.inbox and peer.tls is not None and peer.tls.closed:
            peer.transport.close_tail()  # the client's close_notify, once proton has read all that came before it
        return taken > 0

    def _write(self, peer: Peer) -> None:
        if peer.out:
            try:
                sent = peer.sock.send(peer.out)
            except BlockingIOError:
                sent = 0
            except OSError:
                peer.out.clear()
                peer.transport.close_head()
                peer.transport.close_tail()
                return
            del peer.out[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.out else 0)
        self._selector.modify(peer.sock, events, peer)

    def _service_peers(self) -> float:
        """Runs proton's events and moves output to the sockets until quiet; returns the next timer deadline."""
        deadline = 0.0
        busy = True
        while busy:
            busy = False
            for peer in list(self._peers):
                busy |= self._feed(peer)
                busy |= self._dispatch(peer)
                pending = peer.transport.pending()
                if pending > 0:
                    data = peer.transport.peek(pending) or b""
                    peer.transport.pop(pending)
                    try:
                        padded = peer.padder.feed(data)
                    except FramingError:
                        _LOG.exception("unexpected outgoing AMQP framing; dropping the connection")
                        self._drop(peer)
                        continue
                    if peer.tls is None:
                        peer.out += padded
                    else:
                        peer.tls.send(padded)
                        peer.out += peer.tls.outgoing()
                    busy = True
                if peer.out:
                    self._write(peer)
        for peer in list(self._peers):
            next_tick = peer.transport.tick(time.monotonic())
            if next_tick and (deadline == 0 or next_tick < deadline):
                deadline = next_tick
            if peer.transport.closed or (peer.transport.pending() < 0 and not peer.out):
                self._drop(peer)
        return deadline

    def _drop(self, peer: Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()
        peer.subscriptions.clear()
        peer.publishers.clear()
        self._peers.remove(peer)

    # ---------------------------------------------------------------- AMQP events

    def _dispatch(self, peer: Peer) -> bool:
        handled = False
        while (event := peer.collector.peek()) is not None:
            handled = True
            try:
                self._on_event(peer, event)
            except Exception:
                # One bad frame (or an emulator bug it triggers) must not take every connection down; the
                # connection it came from is closed instead, with the traceback in the log.
                _LOG.exception("error handling %s on a connection; closing it", event.type)
                peer.connection.condition = Condition("amqp:internal-error", "emulator failed to handle a frame")
                peer.connection.close()
            peer.collector.pop()
        return handled

    def _on_event(self, peer: Peer, event: Event) -> None:
        kind, session, link, delivery = event.type, event.session, event.link, event.delivery
        if kind == Event.CONNECTION_REMOTE_OPEN:
            peer.connection.container = "eventhubs-emulator"
            peer.connection.open()
        elif kind == Event.CONNECTION_REMOTE_CLOSE:
            peer.connection.close()
        elif kind == Event.SESSION_REMOTE_OPEN and session is not None:
            session.open()
        elif kind == Event.SESSION_REMOTE_CLOSE and session is not None:
            session.close()
        elif kind == Event.LINK_REMOTE_OPEN and link is not None:
            self._on_link_open(peer, link)
        elif kind in (Event.LINK_REMOTE_CLOSE, Event.LINK_REMOTE_DETACH) and link is not None:
            peer.publishers.pop(link, None)
            peer.subscriptions.pop(link, None)
            link.close()
        elif kind == Event.LINK_FLOW and link is not None:
            subscription = peer.subscriptions.get(link)
            if subscription is not None:
                self._pump(subscription)
        elif kind == Event.DELIVERY and delivery is not None:
            if delivery.link.is_receiver and delivery.readable and not delivery.partial:
                self._on_transfer(peer, delivery)
        elif kind == Event.TRANSPORT_ERROR and peer.transport.condition is not None:
            condition = peer.transport.condition
            # pyamqp sends a detach after its session's end when it closes; that is the client's doing, not ours.
            level = logging.DEBUG if "no such channel" in str(condition.description) else logging.INFO
            _LOG.log(level, "AMQP transport error: %s: %s", condition.name, condition.description)
