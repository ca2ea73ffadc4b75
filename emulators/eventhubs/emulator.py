"""``EventHubsEmulator``: the Python API tests and the local runner use."""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Container
from pathlib import Path

from emulators.eventhubs.broker import Broker
from emulators.eventhubs.broker_state import BrokerStats
from emulators.eventhubs.partition_log import EventStore, RejectedTransfer, StoredEvent
from emulators.eventhubs.rest import RestFrontDoor
from emulators.served import Served
from emulators.tls import local_tls

DEFAULT_HUBS: dict[str, int] = {"scheduled-events": 4}
DEFAULT_CONSUMER_GROUP = "$Default"
DEFAULT_SAS_KEY_NAME = "RootManageSharedAccessKey"
REJECTED_KEPT = 1000  # set-aside transfers kept for inspection; older ones are only counted in stats


class EventHubsEmulator(Served):
    """An Event Hubs namespace on 127.0.0.1 that the real ``azure-eventhub`` clients talk to over AMQP 1.0.

    ``start()`` runs the broker on a thread and returns the namespace connection string; ``stop()`` drops every
    connection (as an outage would); ``start()`` again serves the same events on the same port. Without
    ``data_dir`` events live in memory for the life of this object; with it they are kept in append-only
    per-partition files and survive a new emulator on the same directory. ``sas_key`` defaults to a random key
    (it appears in the connection string, as the real namespace's key does in the portal).

    AMQP is spoken over TLS with the local CA's certificate (emulators/tls.py), as the service does on 5671: the
    SDK's clients reach it with :func:`~emulators.eventhubs.clients.client_options` (``tls=False``: plain AMQP, the
    connection string saying ``UseDevelopmentEmulator=true``). The REST API (``POST /{hub}/messages``,
    emulators/eventhubs/rest.py) is served on ``rest_port`` beside AMQP; ``rest_namespace`` is what a sender names
    as its namespace, over HTTPS with the same certificate (``tls=False``: plain HTTP). ``data_senders``:
    the Entra identities (``xms_mirid``) holding "Azure Event Hubs Data Sender"; None: every valid token's identity
    does."""

    def __init__(
        self,
        *,
        hubs: dict[str, int] | None = None,
        consumer_groups: list[str] | tuple[str, ...] = (DEFAULT_CONSUMER_GROUP,),
        data_dir: str | Path | None = None,
        sas_key_name: str = DEFAULT_SAS_KEY_NAME,
        sas_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        rest_port: int = 0,
        data_senders: Container[str] | None = None,
        tls: bool = True,
    ) -> None:
        self._hubs = dict(hubs if hubs is not None else DEFAULT_HUBS)
        if not self._hubs:
            raise ValueError("hubs must name at least one event hub, e.g. {'scheduled-events': 4}")
        groups = list(consumer_groups)
        if DEFAULT_CONSUMER_GROUP not in groups:
            groups.insert(0, DEFAULT_CONSUMER_GROUP)  # every hub has $Default, as in the service
        self._consumer_groups = groups
        self._store = EventStore(hubs=self._hubs, data_dir=Path(data_dir) if data_dir is not None else None)
        self.sas_key_name = sas_key_name
        self.sas_key = sas_key if sas_key is not None else secrets.token_urlsafe(32)
        self._host = host
        self._port = port
        self.stats = BrokerStats()
        self._rejected: deque[RejectedTransfer] = deque(maxlen=REJECTED_KEPT)
        self._broker: Broker | None = None
        self._thread: threading.Thread | None = None
        self._rest_port = rest_port
        self._rest: RestFrontDoor | None = None
        self.data_senders = data_senders
        self.tls = tls

    @property
    def port(self) -> int:
        """The bound port (after the first ``start()``; kept for restarts)."""
        return self._port

    @property
    def hubs(self) -> dict[str, int]:
        return dict(self._hubs)

    def start(self) -> str:
        """Starts serving (idempotent); returns the namespace connection string (no EntityPath)."""
        if self._broker is None:
            broker = Broker(
                store=self._store,
                consumer_groups=self._consumer_groups,
                sas_key_name=self.sas_key_name,
                sas_key=self.sas_key,
                host=self._host,
                port=self._port,
                stats=self.stats,
                rejected=self._rejected,
                tls=local_tls().server_context() if self.tls else None,
            )
            self._port = broker.port
            self._thread = threading.Thread(target=broker.serve, name=f"eventhubs-emulator:{broker.port}", daemon=True)
            self._broker = broker
            self._thread.start()
            self._rest = RestFrontDoor(
                broker=broker,
                store=self._store,
                stats=self.stats,
                sas_key_name=self.sas_key_name,
                sas_key=self.sas_key,
                data_senders=self.data_senders,
                host=self._host,
                port=self._rest_port,
                tls=local_tls().server_context() if self.tls else None,
            )
            self._rest_port = self._rest.port
            self._rest.start()
        return self.connection_string()

    @property
    def rest_namespace(self) -> str:
        """``127.0.0.1:PORT``: the REST API's namespace (HTTPS unless ``tls=False``; after the first ``start()``)."""
        if not self._rest_port:
            raise RuntimeError("the emulator has no REST port yet; call start() first")
        return f"{self._host}:{self._rest_port}"

    @property
    def rest_url(self) -> str:
        """The REST API's root, ``https://127.0.0.1:PORT`` (``http://`` with ``tls=False``)."""
        return f"{'https' if self.tls else 'http'}://{self.rest_namespace}"

    def stop(self) -> None:
        """Drops every client connection and stops listening (idempotent). Stored events stay."""
        broker, thread, rest = self._broker, self._thread, self._rest
        self._broker, self._thread, self._rest = None, None, None
        if rest is not None:
            rest.stop()
        if broker is not None:
            broker.request_stop()
        if thread is not None:
            thread.join(timeout=10)

    @property
    def running(self) -> bool:
        return self._broker is not None

    def connection_string(self, hub: str | None = None) -> str:
        """``Endpoint=sb://127.0.0.1:PORT;SharedAccessKeyName=...;SharedAccessKey=...`` (+ ``;EntityPath=hub`` if
        given; ``;UseDevelopmentEmulator=true`` with ``tls=False``). Over TLS the SDK's clients need
        :func:`~emulators.eventhubs.clients.client_options` of it to reach this port."""
        if not self._port:
            raise RuntimeError("the emulator has no port yet; call start() first")
        value = (
            f"Endpoint=sb://{self._host}:{self._port};SharedAccessKeyName={self.sas_key_name};"
            f"SharedAccessKey={self.sas_key}"
        )
        if not self.tls:
            value += ";UseDevelopmentEmulator=true"
        if hub is not None:
            if self._store.hub_name(hub) is None:
                raise KeyError(f"no event hub named {hub!r}; configured: {sorted(self._hubs)}")
            value += f";EntityPath={hub}"
        return value

    def rest_connection_string(self, hub: str | None = None) -> str:
        """The connection string of a REST sender (forwarder/eventhub.py): the same key, the REST API's port (HTTPS
        unless ``tls=False``, which the string then says with ``UseDevelopmentEmulator``)."""
        amqp = self.connection_string(hub)
        return amqp.replace(f"sb://{self._host}:{self._port};", f"sb://{self.rest_namespace};", 1)

    def events(self, hub: str, partition: int | str) -> list[StoredEvent]:
        """What is stored in one partition, in order."""
        return self._store.partition(hub, str(partition)).snapshot()

    def all_events(self, hub: str) -> list[StoredEvent]:
        """Every partition's events of ``hub`` (partition by partition, each in order)."""
        return [event for log in self._store.partitions(hub) for event in log.snapshot()]

    def rejected(self) -> list[RejectedTransfer]:
        """Transfers refused as undecodable, with the reason (the latest 1,000; older ones are only counted)."""
        return list(self._rejected)
