"""What the AMQP broker keeps on its thread: its peers (a TCP connection and its AMQP connection, the grants its CBS
tokens gave, its publishers and subscriptions), its counters, the AMQP conditions it refuses with, and the store's
hubs and partitions as the links and requests name them."""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from proton import (
    Collector,
    Connection,
    Link,
    Transport,
)

from emulators.eventhubs.addresses import (
    ConsumeSource,
    Position,
    PublishTarget,
)
from emulators.eventhubs.auth import Grant
from emulators.eventhubs.framing import FramePadder
from emulators.eventhubs.partition_log import EventStore, PartitionLog, RejectedTransfer
from emulators.eventhubs.tls_pipe import TlsPipe

_LOG = logging.getLogger("emulators.eventhubs")

CBS_NODE = "$cbs"
MANAGEMENT_NODE = "$management"
MAX_MESSAGE_SIZE = 1024 * 1024  # Event Hubs Standard tier

NOT_FOUND = "amqp:not-found"
UNAUTHORIZED = "amqp:unauthorized-access"
INVALID_FIELD = "amqp:invalid-field"
DECODE_ERROR = "amqp:decode-error"
LINK_STOLEN = "amqp:link:stolen"


@dataclass
class Subscription:
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
class Peer:
    """One accepted TCP connection and its AMQP connection."""

    sock: socket.socket
    transport: Transport
    connection: Connection
    collector: Collector
    padder: FramePadder
    tls: TlsPipe | None = None  # None: plain AMQP
    out: bytearray = field(default_factory=bytearray)
    # Plaintext read that proton has no room for yet (with TLS a record can complete more than its read's bytes).
    inbox: bytearray = field(default_factory=bytearray)
    grants: list[Grant] = field(default_factory=list)
    publishers: dict[Link, PublishTarget] = field(default_factory=dict)
    subscriptions: dict[Link, Subscription] = field(default_factory=dict)
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
    tls_refused: int = 0  # connections whose TLS handshake or record failed (a client that does not trust us)
    receivers_attached: int = 0


class Refusal(Exception):
    """Why a link or request is refused: an AMQP error condition and a description naming the input."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(description)
        self.condition = condition
        self.description = description


class BrokerState:
    """The broker's sockets, peers and store; the links (``links``), the $cbs and $management nodes
    (``control_nodes``) and the loop (``broker``) build on it."""

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
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._tls = tls
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
        self._peers: list[Peer] = []
        self._round_robin: dict[str, int] = {}
        self._selector = selectors.DefaultSelector()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def _hub(self, name: str) -> str:
        hub = self._store.hub_name(name)
        if hub is None:
            raise Refusal(NOT_FOUND, f"no event hub named {name!r} in this namespace")
        return hub

    def _partition(self, hub: str, partition_id: str) -> PartitionLog:
        try:
            return self._store.partition(hub, partition_id)
        except KeyError as error:
            raise Refusal(NOT_FOUND, str(error.args[0])) from None

    @staticmethod
    def _require_grant(peer: Peer, entity: str) -> None:
        if not peer.authorized(entity):
            raise Refusal(UNAUTHORIZED, f"no valid CBS token for {entity!r} on this connection; put one on $cbs")
