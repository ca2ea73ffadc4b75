"""Event Hubs' REST front door: ``POST /{hub}/messages``, as the on-VM forwarder sends (forwarder/eventhub.py).

The service takes one event (the request body; ``BrokerProperties`` header) or a batch
(``Content-Type: application/vnd.microsoft.servicebus.json``: ``[{"Body", "BrokerProperties": {"PartitionKey"},
"UserProperties"}]``) and answers 201 (learn: rest/api/eventhub/send-event, send-batch-events). Each event is stored
as the AMQP message a consumer receives: its body a data section, ``UserProperties`` its application properties,
the partition key its ``x-opt-partition-key`` annotation; so the coordinator reads it as any other.

Authorization as the service checks it: ``Bearer`` an Entra token for https://eventhubs.azure.net (the IMDS
emulator's managed-identity endpoint mints them), whose identity (``xms_mirid``) must hold "Azure Event Hubs Data
Sender" (``data_senders``; None: every identity does), or a ``SharedAccessSignature`` of the namespace key. 401 for
a token that is missing, expired, badly signed or for another audience; 403 for an identity without the role.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
from collections.abc import Container
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from proton import Message, symbol

from emulators.eventhubs.auth import AuthError, validate_jwt, validate_sas_token
from emulators.eventhubs.broker import Broker
from emulators.eventhubs.broker_state import MAX_MESSAGE_SIZE, BrokerStats
from emulators.eventhubs.partition_log import EventStore
from emulators.status_error import StatusError
from emulators.tls import TlsHTTPServer

_LOG = logging.getLogger("emulators.eventhubs.rest")
BATCH_CONTENT_TYPE = "application/vnd.microsoft.servicebus.json"
_PARTITION_KEY = symbol("x-opt-partition-key")
DATA_SENDER_ROLE = "Azure Event Hubs Data Sender"


class _Refused(StatusError):
    """A REST send refused: ``status`` and ``reason`` are the answer."""


def encode_event(body: bytes, *, partition_key: str | None, properties: dict[str, Any] | None) -> bytes:
    """The AMQP message a REST event becomes (what an AMQP producer would have sent)."""
    message = Message(body=body, inferred=True)  # inferred: bytes go as a data section, as the SDKs send them
    if properties:
        message.properties = dict(properties)  # type: ignore[assignment] # proton's stub says None only
    if partition_key is not None:
        message.annotations = {_PARTITION_KEY: partition_key}
    encoded: bytes = message.encode()
    return encoded


class RestFrontDoor:
    """Serves ``POST /{hub}/messages`` on ``host:port`` (its own port, as the service's 443 beside AMQP's 5671) and
    stores through the broker, on its thread; over TLS with ``tls`` (emulators/tls.py), as the service."""

    def __init__(
        self,
        *,
        broker: Broker,
        store: EventStore,
        stats: BrokerStats,
        sas_key_name: str,
        sas_key: str,
        data_senders: Container[str] | None,
        host: str,
        port: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._broker = broker
        self._store = store
        self._stats = stats
        self._sas = (sas_key_name, sas_key)
        self._senders = data_senders
        # Open client connections: an outage (stop) drops them, as the service's would, kept-alive or not.
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with front._lock:
                    front._connections.add(self.connection)

            def finish(self) -> None:
                with front._lock:
                    front._connections.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:
                status, reason = front.handle(self)
                payload = b"" if status == 201 else json.dumps({"error": {"code": status, "message": reason}}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                if payload:
                    self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                _LOG.debug(format, *args)

        self._server = (
            ThreadingHTTPServer((host, port), Handler)
            if tls is None
            else TlsHTTPServer((host, port), Handler, context=tls)
        )
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"eventhubs-rest:{self.port}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)

    def handle(self, request: BaseHTTPRequestHandler) -> tuple[int, str]:
        try:
            length = int(request.headers.get("Content-Length") or 0)
            body = request.rfile.read(length) if length else b""
            hub = self._hub(request.path)
            self._authorize(request.headers.get("Authorization") or "", hub)
            if length > MAX_MESSAGE_SIZE:
                raise _Refused(413, f"the request of {length} bytes exceeds the maximum message size")
            events = self._events(request, body)
        except _Refused as refused:
            _LOG.info("REST send refused: %s %s", refused.status, refused.reason)
            return refused.status, refused.reason
        done = threading.Event()

        def store() -> None:
            try:
                # Consecutive events of one key stay one batch (in order, in one partition).
                start = 0
                for index in range(1, len(events) + 1):
                    if index == len(events) or events[index][1] != events[start][1]:
                        self._broker.store_events(hub, events[start:index])
                        start = index
            finally:
                done.set()

        self._broker.call_soon(store)
        if not done.wait(10):
            return 503, "the namespace did not store the events in time"
        return 201, ""

    def _hub(self, target: str) -> str:
        parts = urlsplit(target).path.strip("/").split("/")
        if len(parts) != 2 or parts[1].lower() != "messages":
            raise _Refused(404, f"no such resource {target!r}; events go to POST /{{hub}}/messages")
        hub = self._store.hub_name(parts[0])
        if hub is None:
            raise _Refused(404, f"no event hub named {parts[0]!r}")
        return hub

    def _authorize(self, header: str, hub: str) -> None:
        try:
            if header.startswith("Bearer "):
                grant = validate_jwt(header.removeprefix("Bearer "))
                if self._senders is not None and grant.identity not in self._senders:
                    self._stats.tokens_refused += 1
                    raise _Refused(403, f"identity {grant.identity!r} has no {DATA_SENDER_ROLE!r} role on {hub!r}")
            elif header.startswith("SharedAccessSignature "):
                grant = validate_sas_token(header, key_name=self._sas[0], key=self._sas[1])
            else:
                raise AuthError("no Authorization: send 'Bearer <Entra token>' or 'SharedAccessSignature …'")
        except AuthError as error:
            self._stats.tokens_refused += 1
            raise _Refused(401, str(error)) from None
        if not grant.covers(hub):
            self._stats.tokens_refused += 1
            raise _Refused(401, f"the token does not cover the event hub {hub!r}")

    @staticmethod
    def _events(request: BaseHTTPRequestHandler, body: bytes) -> list[tuple[bytes, str | None]]:
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type != BATCH_CONTENT_TYPE:
            key = _partition_key(request.headers.get("BrokerProperties") or "{}")
            return [(encode_event(body, partition_key=key, properties=None), key)]
        try:
            items = json.loads(body)
        except ValueError as error:
            raise _Refused(400, f"the batch is not JSON: {error}") from None
        if not isinstance(items, list) or not items:
            raise _Refused(400, "a batch is a non-empty JSON array of {Body, BrokerProperties, UserProperties}")
        events = []
        for index, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("Body"), str):
                raise _Refused(400, f"batch item {index} has no string Body")
            properties = item.get("UserProperties") or {}
            broker = item.get("BrokerProperties") or {}
            if not isinstance(properties, dict) or not isinstance(broker, dict):
                raise _Refused(400, f"batch item {index}: UserProperties and BrokerProperties are objects")
            key = broker.get("PartitionKey")
            key = None if key is None else str(key)
            events.append((encode_event(item["Body"].encode("utf-8"), partition_key=key, properties=properties), key))
        return events


def _partition_key(header: str) -> str | None:
    try:
        properties = json.loads(header)
    except ValueError:
        raise _Refused(400, "the BrokerProperties header is not JSON") from None
    key = properties.get("PartitionKey") if isinstance(properties, dict) else None
    return None if key is None else str(key)
