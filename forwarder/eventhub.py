"""The production sink: Event Hubs' REST API (``POST https://{namespace}/{hub}/messages``, a batch per request) over
the forwarder's own kept-alive HTTPS connection (forwarder/keepalive.py), with an Entra ID token of the VM's managed
identity (forwarder/credential.py) or, where a test is about SAS, a connection string's SAS key.

Why not the AMQP SDK (azure-eventhub + azure-core, which it used before): their imports cost about 4.8 MiB of the
daemon's memory for what is a few envelopes an hour; an HTTPS POST carries the same batch, the same partition key
(``BrokerProperties.PartitionKey``) and the same application properties (``UserProperties``: the W3C trace context),
and the consumer reads the events as any others (learn: rest/api/eventhub/send-batch-events).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

from contracts.sas import sas_token
from forwarder.credential import EVENTHUBS_SCOPE, TokenCredential
from forwarder.durable_state import SpooledEnvelope
from forwarder.imds import ImdsError
from forwarder.keepalive import KeepAliveConnection, build_request, tls_context
from forwarder.sinks import SinkError, UndeliverableEnvelope

API_VERSION = "2014-01"
BATCH_CONTENT_TYPE = "application/vnd.microsoft.servicebus.json"
# The service's limit on one request (a batch, as one message of the Standard tier: 1 MB); an envelope alone above
# it is set aside, a batch above it is split.
MAX_BATCH_BYTES = 1_000_000
SAS_LIFETIME_SECONDS = 3600


class EventHubSink:
    """Sends each batch of one VM's envelopes (one partition key) in one POST, in order; 201 is delivered.

    No retries here: the sender's backoff is the only retry loop, so an outage shows in the spool."""

    def __init__(
        self,
        *,
        endpoint: str,
        eventhub_name: str,
        authorization: Callable[[], str],
        send_timeout: float = 10.0,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(
                f"event hubs endpoint {endpoint!r} must be https://NAMESPACE (http:// only for an emulator)"
            )
        tls = tls_context() if parts.scheme == "https" else None
        port = parts.port or (443 if tls else 80)
        self._conn = KeepAliveConnection(parts.hostname, port, max_body=64 * 1024, tls=tls)
        self._authority = parts.netloc
        self._path = f"/{quote(eventhub_name)}/messages?timeout=60&api-version={API_VERSION}"
        self._authorization = authorization
        self._timeout = send_timeout

    @classmethod
    def with_credential(
        cls, *, fully_qualified_namespace: str, eventhub_name: str, credential: TokenCredential, use_tls: bool = True
    ) -> EventHubSink:
        """Production: the VM's managed identity, which needs "Azure Event Hubs Data Sender" on the hub.
        ``use_tls=False`` only for the local emulator (plain HTTP on loopback)."""
        scheme = "https" if use_tls else "http"

        def bearer() -> str:
            return "Bearer " + credential.get_token(EVENTHUBS_SCOPE).token

        return cls(
            endpoint=f"{scheme}://{fully_qualified_namespace}", eventhub_name=eventhub_name, authorization=bearer
        )

    @classmethod
    def from_connection_string(cls, connection_string: str, *, eventhub_name: str | None = None) -> EventHubSink:
        """A SAS key (``Endpoint=sb://NS/;SharedAccessKeyName=…;SharedAccessKey=…[;EntityPath=hub]``); the local
        emulator's (``UseDevelopmentEmulator=true``) is reached over plain HTTP."""
        parts = dict(p.split("=", 1) for p in connection_string.strip(";").split(";") if "=" in p)
        hub = eventhub_name or parts.get("EntityPath")
        if not hub or not all(k in parts for k in ("Endpoint", "SharedAccessKeyName", "SharedAccessKey")):
            raise ValueError("the connection string needs Endpoint, SharedAccessKeyName, SharedAccessKey and a hub")
        host = urlsplit(parts["Endpoint"]).netloc
        emulator = parts.get("UseDevelopmentEmulator", "").lower() == "true"
        resource = f"{'http' if emulator else 'https'}://{host}/{hub}"

        def sas() -> str:
            expires = int(time.time()) + SAS_LIFETIME_SECONDS
            return sas_token(
                resource_uri=resource,
                key_name=parts["SharedAccessKeyName"],
                key=parts["SharedAccessKey"],
                expires_on=expires,
            )

        return cls(endpoint=f"{'http' if emulator else 'https'}://{host}", eventhub_name=hub, authorization=sas)

    def send(self, items: Sequence[SpooledEnvelope], *, partition_key: str) -> None:
        batch: list[bytes] = []
        size = 2
        for item in items:
            message = self._message(item, partition_key)
            if len(message) + 2 > MAX_BATCH_BYTES:
                if batch:
                    self._post(batch)  # the ones before it first, in order
                raise UndeliverableEnvelope(
                    f"envelope sequence {item.sequence} ({len(item.body)} bytes) exceeds the event hub's maximum "
                    "message size",
                    item=item,
                )
            if batch and size + len(message) + 1 > MAX_BATCH_BYTES:
                self._post(batch)
                batch, size = [], 2
            batch.append(message)
            size += len(message) + 1
        if batch:
            self._post(batch)

    @staticmethod
    def _message(item: SpooledEnvelope, partition_key: str) -> bytes:
        message: dict[str, Any] = {
            "Body": item.body.decode("utf-8"),
            "BrokerProperties": {"PartitionKey": partition_key},
        }
        if item.traceparent:
            # W3C trace context as application properties, beside the envelope and not in it: the envelope is the
            # contract of what happened, the trace says how it travelled.
            properties = {"traceparent": item.traceparent}
            if item.tracestate:
                properties["tracestate"] = item.tracestate
            message["UserProperties"] = properties
        return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def _post(self, batch: list[bytes]) -> None:
        body = b"[" + b",".join(batch) + b"]"
        try:
            authorization = self._authorization()
            request = build_request(
                "POST",
                self._authority,
                self._path,
                body=body,
                content_type=BATCH_CONTENT_TYPE,
                headers=(("Authorization", authorization),),
            )
            response = self._conn.exchange(request, timeout=self._timeout)
        except (OSError, ValueError, ImdsError) as exc:  # the network, TLS, or the token (IMDS): all "not now"
            self._conn.close()
            raise SinkError(f"Event Hubs send failed: {type(exc).__name__}: {exc}") from exc
        if response.status != 201:
            self._conn.close()
            detail = response.body[:300].decode("utf-8", errors="replace")
            raise SinkError(f"Event Hubs send failed: {response.status}: {detail}")

    def close(self) -> None:
        self._conn.close()
