"""The production sink: a real `EventHubProducerClient` (azure-eventhub), with Entra ID auth (the VM's managed
identity; see forwarder/credential.py) or a connection string (the local Event Hubs emulator).

Its own module so that the heavy SDK imports are paid only when this sink is configured.
"""

from __future__ import annotations

from collections.abc import Sequence

from azure.core.credentials import TokenCredential
from azure.eventhub import EventData, EventHubProducerClient
from azure.eventhub.exceptions import EventHubError

from forwarder.durable_state import SpooledEnvelope
from forwarder.sinks import SinkError, UndeliverableEnvelope


class EventHubSink:
    """Sends through a real `EventHubProducerClient`, one batch per partition key (the VM's resource id).

    The producer is built with `retry_total=0`: the sender's backoff is the only retry loop, so that a long
    outage is not hidden inside the SDK while the spool grows.
    """

    def __init__(self, *, producer: EventHubProducerClient, send_timeout: float = 10.0) -> None:
        self._producer = producer
        self._send_timeout = send_timeout

    @classmethod
    def with_credential(
        cls,
        *,
        fully_qualified_namespace: str,
        eventhub_name: str,
        credential: TokenCredential,
        use_tls: bool = True,
    ) -> EventHubSink:
        """Production: Entra ID auth; the VM's managed identity needs "Azure Event Hubs Data Sender" on the hub.
        `use_tls=False` only for a local emulator (plain AMQP on loopback)."""
        producer = EventHubProducerClient(
            fully_qualified_namespace=fully_qualified_namespace,
            eventhub_name=eventhub_name,
            credential=credential,
            retry_total=0,
            use_tls=use_tls,
        )
        return cls(producer=producer)

    @classmethod
    def from_connection_string(cls, connection_string: str, *, eventhub_name: str | None = None) -> EventHubSink:
        """For the local Event Hubs emulator (`...;UseDevelopmentEmulator=true`) or a SAS-based setup."""
        producer = EventHubProducerClient.from_connection_string(
            connection_string, eventhub_name=eventhub_name, retry_total=0
        )
        return cls(producer=producer)

    def send(self, items: Sequence[SpooledEnvelope], *, partition_key: str) -> None:
        try:
            batch = self._producer.create_batch(partition_key=partition_key)
            for item in items:
                event = EventData(item.body)
                event.content_type = "application/json"
                if item.traceparent:
                    # W3C trace context as application properties, beside the envelope and not in it: the
                    # envelope is the contract of what happened, the trace says how it travelled.
                    event.properties = {"traceparent": item.traceparent}
                    if item.tracestate:
                        event.properties["tracestate"] = item.tracestate
                try:
                    batch.add(event)
                except ValueError:
                    if len(batch) == 0:
                        raise UndeliverableEnvelope(
                            f"envelope sequence {item.sequence} ({len(item.body)} bytes) exceeds the event hub's "
                            "maximum message size",
                            item=item,
                        ) from None
                    self._producer.send_batch(batch, timeout=self._send_timeout)
                    batch = self._producer.create_batch(partition_key=partition_key)
                    batch.add(event)
            if len(batch):
                self._producer.send_batch(batch, timeout=self._send_timeout)
        except EventHubError as exc:
            raise SinkError(f"Event Hubs send failed: {exc}") from exc

    def close(self) -> None:
        self._producer.close()
