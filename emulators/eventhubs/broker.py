"""The AMQP 1.0 side of the emulator: proton's protocol engine driven by a selector loop on one thread.

proton's ``Container`` would own the sockets; driving ``Transport``/``Collector`` directly instead lets the
outgoing bytes pass through :class:`~emulators.eventhubs.framing.FramePadder` (see there why), lets the listener
bind port 0 and report it, and lets ``stop()`` drop every connection at once, as an outage would.

Everything below runs on the broker thread; the only shared state is the :class:`EventStore` (locked).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from azure.eventhub._buffered_producer._partition_resolver import generate_hash_code
from proton import (
    UNDESCRIBED,
    Array,
    Collector,
    Condition,
    Connection,
    Data,
    Delivery,
    Endpoint,
    Event,
    Link,
    Message,
    Terminus,
    Transport,
    symbol,
    timestamp,
)

from emulators.eventhubs import messages
from emulators.eventhubs.addresses import (
    SELECTOR_FILTER,
    AddressError,
    ConsumeSource,
    Position,
    PublishTarget,
    parse_consume_source,
    parse_publish_target,
    parse_selector,
)
from emulators.eventhubs.auth import JWT_TOKEN_TYPE, SAS_TOKEN_TYPE, AuthError, Grant, resource_path, validate_token
from emulators.eventhubs.framing import FramePadder, FramingError
from emulators.eventhubs.partition_log import EventStore, PartitionLog, RejectedTransfer

_LOG = logging.getLogger("emulators.eventhubs")

CBS_NODE = "$cbs"
MANAGEMENT_NODE = "$management"
MAX_MESSAGE_SIZE = 1024 * 1024  # Event Hubs Standard tier
_LINK_CREDIT = 100
_READ_SIZE = 65536
_SEQUENCE_NUMBER = symbol("x-opt-sequence-number")
_OFFSET = symbol("x-opt-offset")
_ENQUEUED_TIME = symbol("x-opt-enqueued-time")
_EPOCH = symbol("com.microsoft:epoch")

NOT_FOUND = "amqp:not-found"
UNAUTHORIZED = "amqp:unauthorized-access"
INVALID_FIELD = "amqp:invalid-field"
DECODE_ERROR = "amqp:decode-error"
LINK_STOLEN = "amqp:link:stolen"


def partition_for_key(partition_key: str, partition_count: int) -> int:
    """Partition key → partition with the Jenkins lookup3 hash the SDK's buffered producer uses to mirror the
    service, so keyed sends land where a buffered producer would put them."""
    hash_code: int = generate_hash_code(partition_key)  # type: ignore[no-untyped-call]  # untyped SDK helper
    return abs(hash_code % partition_count)


@dataclass
class _Subscription:
    link: Link
    source: ConsumeSource
    log: PartitionLog
    position: Position
    next_index: int
    epoch: int | None
    # Until the first event after ``position`` exists (a sequence number or time still in the future), new
    # events are checked against it; from then on every later event qualifies, as the log is ordered.
    reached: bool = False


@dataclass
class _Peer:
    """One accepted TCP connection and its AMQP connection."""

    sock: socket.socket
    transport: Transport
    connection: Connection
    collector: Collector
    padder: FramePadder
    out: bytearray = field(default_factory=bytearray)
    grants: list[Grant] = field(default_factory=list)
    publishers: dict[Link, PublishTarget] = field(default_factory=dict)
    subscriptions: dict[Link, _Subscription] = field(default_factory=dict)
    closed: bool = False

    def authorized(self, entity_path: str) -> bool:
        return any(grant.covers(entity_path) for grant in self.grants)


@dataclass
class BrokerStats:
    """Counters a test or the local runner can read: what was refused, and why, never silently dropped."""

    connections: int = 0
    events_stored: int = 0
    deliveries_rejected: int = 0
    tokens_refused: int = 0
    links_refused: int = 0
    receivers_attached: int = 0


class Broker:
    """Serves the store over AMQP on ``host:port`` until :meth:`request_stop`."""

    def __init__(
        self,
        *,
        store: EventStore,
        consumer_groups: list[str],
        sas_key_name: str,
        sas_key: str,
        host: str,
        port: int,
        stats: BrokerStats,
        rejected: deque[RejectedTransfer],
    ) -> None:
        self._store = store
        self._rejected = rejected
        self._consumer_groups = {name.lower() for name in consumer_groups}
        self._sas_key_name = sas_key_name
        self._sas_key = sas_key
        self._stats = stats
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._stopping = threading.Event()
        self._peers: list[_Peer] = []
        self._round_robin: dict[str, int] = {}
        self._selector = selectors.DefaultSelector()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

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
                        peer: _Peer = key.data
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
            peer = _Peer(sock, transport, connection, collector, FramePadder())
            self._peers.append(peer)
            self._stats.connections += 1
            self._selector.register(sock, selectors.EVENT_READ, peer)
            _LOG.debug("accepted AMQP connection from %s:%d", *address[:2])

    def _read(self, peer: _Peer) -> None:
        capacity = peer.transport.capacity()
        if capacity == 0:  # proton's input buffer is full; it drains in _service_peers right after this
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
        elif data:
            peer.transport.push(data)
        else:
            peer.transport.close_tail()

    def _write(self, peer: _Peer) -> None:
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
                busy |= self._dispatch(peer)
                pending = peer.transport.pending()
                if pending > 0:
                    data = peer.transport.peek(pending) or b""
                    peer.transport.pop(pending)
                    try:
                        peer.out += peer.padder.feed(data)
                    except FramingError:
                        _LOG.exception("unexpected outgoing AMQP framing; dropping the connection")
                        self._drop(peer)
                        continue
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

    def _drop(self, peer: _Peer) -> None:
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

    def _dispatch(self, peer: _Peer) -> bool:
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

    def _on_event(self, peer: _Peer, event: Event) -> None:
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

    # ---------------------------------------------------------------- links

    def _on_link_open(self, peer: _Peer, link: Link) -> None:
        source, target = link.remote_source.address, link.remote_target.address
        if source is not None:
            link.source.address = source
        if target is not None:
            link.target.address = target
        try:
            if link.is_receiver:
                self._on_publisher_link(peer, link, target or "")
            else:
                self._on_consumer_link(peer, link, source or "")
        except _Refusal as refusal:
            # A refusal per AMQP 1.0 §2.6.3: attach with a null terminus on our side, then detach with the error.
            # pyamqp needs that null terminus to notice; with both present it would wait for the link forever.
            self._stats.links_refused += 1
            _LOG.info("refused link %r: %s (%s)", link.name, refusal.description, refusal.condition)
            (link.target if link.is_receiver else link.source).type = Terminus.UNSPECIFIED
            link.condition = Condition(refusal.condition, refusal.description)
            link.open()
            link.close()

    def _hub(self, name: str) -> str:
        hub = self._store.hub_name(name)
        if hub is None:
            raise _Refusal(NOT_FOUND, f"no event hub named {name!r} in this namespace")
        return hub

    def _partition(self, hub: str, partition_id: str) -> PartitionLog:
        try:
            return self._store.partition(hub, partition_id)
        except KeyError as error:
            raise _Refusal(NOT_FOUND, str(error.args[0])) from None

    @staticmethod
    def _require_grant(peer: _Peer, entity: str) -> None:
        if not peer.authorized(entity):
            raise _Refusal(UNAUTHORIZED, f"no valid CBS token for {entity!r} on this connection; put one on $cbs")

    def _on_publisher_link(self, peer: _Peer, link: Link, address: str) -> None:
        if address not in (CBS_NODE, MANAGEMENT_NODE):
            try:
                target = parse_publish_target(address)
            except AddressError as error:
                raise _Refusal(NOT_FOUND, str(error)) from None
            hub = self._hub(target.hub)
            if target.partition is not None:
                self._partition(hub, target.partition)
            self._require_grant(peer, hub if target.partition is None else f"{hub}/Partitions/{target.partition}")
            peer.publishers[link] = PublishTarget(hub=hub, partition=target.partition)
            link.max_message_size = MAX_MESSAGE_SIZE
        link.open()
        link.flow(_LINK_CREDIT)

    def _on_consumer_link(self, peer: _Peer, link: Link, address: str) -> None:
        if address in (CBS_NODE, MANAGEMENT_NODE):
            link.open()
            return
        try:
            source = parse_consume_source(address)
            position = parse_selector(_selector_of(link))
        except AddressError as error:
            raise _Refusal(INVALID_FIELD if "selector" in str(error) else NOT_FOUND, str(error)) from None
        hub = self._hub(source.hub)
        if source.consumer_group.lower() not in self._consumer_groups:
            raise _Refusal(NOT_FOUND, f"event hub {hub!r} has no consumer group {source.consumer_group!r}")
        log = self._partition(hub, source.partition)
        self._require_grant(peer, f"{hub}/ConsumerGroups/{source.consumer_group}/Partitions/{source.partition}")
        epoch = _epoch_of(link)
        if not self._claim_epoch(source, log, epoch):
            raise _Refusal(
                LINK_STOLEN,
                f"a receiver with a higher owner level holds {hub}/{source.consumer_group}/{source.partition}",
            )
        subscription = _Subscription(link, source, log, position, log.start_index(position), epoch)
        peer.subscriptions[link] = subscription
        link.max_message_size = MAX_MESSAGE_SIZE
        link.open()
        self._stats.receivers_attached += 1
        self._pump(subscription)

    def _subscriptions(self) -> Iterator[tuple[_Peer, _Subscription]]:
        for peer in self._peers:
            for subscription in list(peer.subscriptions.values()):
                yield peer, subscription

    def _claim_epoch(self, source: ConsumeSource, log: PartitionLog, epoch: int | None) -> bool:
        """Owner level (epoch), as the service applies it per consumer group and partition: a receiver with an
        owner level disconnects those with a lower one and those without; one with a lower level, or one without
        while an owner holds the partition, is refused."""
        rivals = [
            (peer, sub)
            for peer, sub in self._subscriptions()
            if sub.log is log and sub.source.consumer_group.lower() == source.consumer_group.lower()
        ]
        owners = [sub.epoch for _, sub in rivals if sub.epoch is not None]
        if epoch is None:
            return not owners
        if any(owner > epoch for owner in owners):
            return False
        for peer, sub in rivals:
            peer.subscriptions.pop(sub.link, None)
            sub.link.condition = Condition(LINK_STOLEN, f"a receiver with owner level {epoch} took over")
            sub.link.close()
        return True

    # ---------------------------------------------------------------- transfers

    def _on_transfer(self, peer: _Peer, delivery: Delivery) -> None:
        link = delivery.link
        payload = link.recv(delivery.pending) or b""
        link.advance()
        address = link.remote_target.address
        if address in (CBS_NODE, MANAGEMENT_NODE):
            self._on_request(peer, link, address, payload)
            delivery.update(Delivery.ACCEPTED)
        else:
            target = peer.publishers.get(link)
            outcome = self._on_publish(peer, target, payload) if target else (NOT_FOUND, "link is not attached")
            if outcome is None:
                delivery.update(Delivery.ACCEPTED)
            else:
                self._stats.deliveries_rejected += 1
                delivery.local.condition = Condition(*outcome)
                delivery.update(Delivery.REJECTED)
        delivery.settle()
        if link.credit < _LINK_CREDIT // 2:
            link.flow(_LINK_CREDIT - link.credit)

    def _on_publish(self, peer: _Peer, target: PublishTarget, payload: bytes) -> tuple[str, str] | None:
        """Stores the event(s); returns None, or (condition, description) for a rejection."""
        entity = target.hub if target.partition is None else f"{target.hub}/Partitions/{target.partition}"
        if not peer.authorized(entity):
            return UNAUTHORIZED, f"the CBS token for {entity!r} expired; put a new one on $cbs"
        try:
            events = messages.unpack(payload)
        except messages.MessageError as error:
            _LOG.warning("rejected a %d-byte transfer to %s: %s", len(payload), target.hub, error)
            self._rejected.append(RejectedTransfer(hub=target.hub, reason=str(error), payload=payload))
            return DECODE_ERROR, str(error)
        self.store_events(target.hub, events, partition=target.partition)
        return None

    def store_events(self, hub: str, events: list[tuple[bytes, str | None]], *, partition: str | None = None) -> None:
        """Appends a batch (encoded messages with their partition key) to its partition and feeds the receivers."""
        partitions = self._store.partitions(hub)
        if partition is not None:
            log = partitions[int(partition)]
        elif events[0][1] is not None:
            log = partitions[partition_for_key(events[0][1], len(partitions))]
        else:
            # Without a key the service spreads whole batches over partitions; a batch stays together, in order.
            turn = self._round_robin.get(hub, 0)
            self._round_robin[hub] = turn + 1
            log = partitions[turn % len(partitions)]
        stored = log.append(events, now_ms=int(time.time() * 1000))
        self._stats.events_stored += len(stored)
        for _, subscription in self._subscriptions():
            if subscription.log is log:
                self._pump(subscription)

    def _pump(self, subscription: _Subscription) -> None:
        link, log = subscription.link, subscription.log
        while link.credit > 0 and subscription.next_index < len(log):
            event = log.get(subscription.next_index)
            if not subscription.reached:
                subscription.reached = subscription.position.admits(
                    offset=event.offset, sequence_number=event.sequence_number, enqueued_time_ms=event.enqueued_time_ms
                )
                if not subscription.reached:
                    subscription.next_index += 1
                    continue
            message = event.decoded()
            annotations = dict(message.annotations or {})
            annotations[_SEQUENCE_NUMBER] = event.sequence_number
            annotations[_OFFSET] = str(event.offset)
            annotations[_ENQUEUED_TIME] = timestamp(event.enqueued_time_ms)
            if event.partition_key is not None:
                annotations[messages.PARTITION_KEY] = event.partition_key
            message.annotations = annotations
            message.instructions = _runtime_metrics(log)
            # Pre-settled: Event Hubs receivers are at-most-once on the wire; checkpoints give the guarantees.
            link.send(message).settle()
            subscription.next_index += 1

    # ---------------------------------------------------------------- $cbs and $management

    def _reply(self, link: Link, node: str, request: Message, *, status: int, description: str, body: Any) -> None:
        reply_link = next(
            (
                candidate
                for candidate in _links(link.session.connection)
                if candidate.is_sender
                and candidate.session == link.session
                and candidate.remote_source.address == node
                and candidate.state & Endpoint.LOCAL_ACTIVE
            ),
            None,
        )
        if reply_link is None:
            _LOG.warning("no reply link for a %s request on this session; the client will time out", node)
            return
        reply = Message(
            correlation_id=request.id,
            # $cbs replies are read as status-description, $management ones (by pyamqp) as statusDescription.
            properties={"status-code": status, "status-description": description, "statusDescription": description},
            body=body,
        )
        reply_link.send(reply).settle()

    def _on_request(self, peer: _Peer, link: Link, node: str, payload: bytes) -> None:
        try:
            request = messages.decode(payload)
        except messages.MessageError as error:
            _LOG.warning("undecodable %s request: %s", node, error)
            return
        properties: dict[str, Any] = dict(request.properties or {})
        if node == CBS_NODE:
            status, description = self._put_token(peer, properties, request.body)
            self._reply(link, node, request, status=status, description=description, body=None)
        else:
            status, description, body = self._management(peer, properties)
            self._reply(link, node, request, status=status, description=description, body=body)

    def _put_token(self, peer: _Peer, properties: dict[str, Any], token: Any) -> tuple[int, str]:
        operation = properties.get("operation")
        if operation != "put-token":
            return 400, f"unsupported $cbs operation {operation!r}; only 'put-token'"
        token_type = str(properties.get("type", ""))
        audience = str(properties.get("name", ""))
        try:
            grant = validate_token(str(token), token_type, key_name=self._sas_key_name, key=self._sas_key)
        except AuthError as error:
            self._stats.tokens_refused += 1
            _LOG.info("refused CBS token for %s: %s", audience, error)
            return 401, f"Unauthorized: {error}"
        if grant.path and resource_path(audience) and not grant.covers(resource_path(audience)):
            self._stats.tokens_refused += 1
            return 401, f"Unauthorized: token for {grant.path!r} does not cover {audience!r}"
        # Clients renew tokens on a long-lived connection; forget the expired ones so the list stays short.
        now = time.time()
        peer.grants = [kept for kept in peer.grants if kept.expires_at > now]
        peer.grants.append(grant)
        return 202, "Accepted"

    def _management(self, peer: _Peer, properties: dict[str, Any]) -> tuple[int, str, Any]:
        operation, kind = properties.get("operation"), properties.get("type")
        if operation != "READ":
            return 400, f"unsupported $management operation {operation!r}; only 'READ'", None
        try:
            hub = self._hub(str(properties.get("name", "")))
            self._management_grant(peer, hub, properties.get("security_token"))
            if kind == "com.microsoft:eventhub":
                return 200, "OK", self._hub_properties(hub)
            if kind == "com.microsoft:partition":
                return 200, "OK", _partition_properties(self._partition(hub, str(properties.get("partition", ""))))
        except _Refusal as refusal:
            status = 401 if refusal.condition == UNAUTHORIZED else 404
            return status, refusal.description, None
        return 400, f"unsupported $management type {kind!r}", None

    def _management_grant(self, peer: _Peer, hub: str, token: Any) -> None:
        """A management request carries its own token; a CBS grant on the connection also suffices."""
        if peer.authorized(hub):
            return
        if token is None:
            raise _Refusal(UNAUTHORIZED, "Unauthorized: no security_token and no CBS token on this connection")
        token_type = SAS_TOKEN_TYPE if str(token).startswith("SharedAccessSignature ") else JWT_TOKEN_TYPE
        try:
            grant = validate_token(str(token), token_type, key_name=self._sas_key_name, key=self._sas_key)
        except AuthError as error:
            self._stats.tokens_refused += 1
            raise _Refusal(UNAUTHORIZED, f"Unauthorized: {error}") from None
        if not grant.covers(hub):
            raise _Refusal(UNAUTHORIZED, f"Unauthorized: token does not cover {hub!r}")

    def _hub_properties(self, hub: str) -> dict[str, Any]:
        partitions = self._store.partitions(hub)
        return {
            "name": hub,
            "type": "com.microsoft:eventhub",
            "created_at": timestamp(self._store.created_at_ms),
            "partition_count": len(partitions),
            "partition_ids": Array(
                UNDESCRIBED,  # type: ignore[arg-type]  # proton's annotation omits its own constant
                Data.STRING,
                *[log.partition_id for log in partitions],
            ),
        }


class _Refusal(Exception):
    """Why a link or request is refused: an AMQP error condition and a description naming the input."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(description)
        self.condition = condition
        self.description = description


def _partition_properties(log: PartitionLog) -> dict[str, Any]:
    props = log.properties()
    return {
        "name": log.hub,
        "type": "com.microsoft:partition",
        "partition": log.partition_id,
        "begin_sequence_number": props.beginning_sequence_number,
        "last_enqueued_sequence_number": props.last_enqueued_sequence_number,
        "last_enqueued_offset": str(props.last_enqueued_offset),
        "last_enqueued_time_utc": timestamp(props.last_enqueued_time_ms),
        "is_partition_empty": props.is_empty,
    }


def _runtime_metrics(log: PartitionLog) -> dict[str | int, Any]:
    """Delivery annotations for ``track_last_enqueued_event_properties``. The service sends them only to receivers
    that desire com.microsoft:enable-receiver-runtime-metric; proton's binding does not expose a link's desired
    capabilities, so every receiver gets them (the SDK reads them only when asked to)."""
    props = log.properties()
    return {
        symbol("last_enqueued_sequence_number"): props.last_enqueued_sequence_number,
        symbol("last_enqueued_offset"): str(props.last_enqueued_offset),
        symbol("last_enqueued_time_utc"): timestamp(props.last_enqueued_time_ms),
        symbol("runtime_info_retrieval_time_utc"): timestamp(int(time.time() * 1000)),
    }


def _links(connection: Connection) -> Iterator[Link]:
    link = connection.link_head(0)
    while link is not None:
        yield link
        link = link.next(0)


def _selector_of(link: Link) -> str | None:
    """The selector filter's expression from the source's filter map, if any."""
    data = link.remote_source.filter
    if data is None:
        return None
    data.rewind()
    if data.next() is None:
        return None
    filters = data.get_object()
    if not isinstance(filters, dict):
        return None
    for key, value in filters.items():
        if str(key) == SELECTOR_FILTER or str(getattr(value, "descriptor", "")) == SELECTOR_FILTER:
            return str(getattr(value, "value", value))
    return None


def _epoch_of(link: Link) -> int | None:
    properties = link.remote_properties or {}
    epoch = properties.get(_EPOCH)
    return None if epoch is None else int(epoch)
