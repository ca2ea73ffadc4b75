"""The ``azure-eventhub`` clients of a local namespace, reached as the service is: AMQP over TLS, the server's
certificate verified.

The SDK reaches a namespace on 5671 whatever port its connection string names, unless the string says
``UseDevelopmentEmulator=true`` (then plain AMQP on that port: the local emulator Microsoft ships). A namespace on a
port of its own over TLS (this emulator's) is reached through the SDK's ``custom_endpoint_address`` with
``transport_type=Amqp``, and its certificate verified against ``connection_verify``, the SDK's CA setting (by default
certifi's bundle, which does not hold the local CA). :func:`client_options` gives those from the connection string
alone, so a string handed to another process (the local runner, the IMDS emulator's Event Grid) still reaches it.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from azure.eventhub import EventHubConsumerClient, EventHubProducerClient, TransportType

from emulators.tls import local_tls

__all__ = ["client_options", "consumer_client", "producer_client"]


def _settings(connection_string: str) -> dict[str, str]:
    pairs = (part.split("=", 1) for part in connection_string.split(";") if "=" in part)
    return {key.strip().lower(): value.strip() for key, value in pairs}


def client_options(connection_string: str) -> dict[str, Any]:
    """The SDK's keyword options that reach the namespace ``connection_string`` names: none for a namespace on
    5671 or for the plain development emulator; for a namespace on another port, its address there over AMQP with
    TLS, verified against ``SSL_CERT_FILE`` (the process's CA setting, which the local stack sets) or else the
    local CA's bundle (emulators/tls.py)."""
    settings = _settings(connection_string)
    if settings.get("usedevelopmentemulator", "").lower() == "true":
        return {}
    endpoint = urlparse(settings.get("endpoint", ""))
    if endpoint.hostname is None or endpoint.port in (None, 5671):
        return {}
    return {
        "custom_endpoint_address": f"sb://{endpoint.hostname}:{endpoint.port}",
        "transport_type": TransportType.Amqp,
        "connection_verify": os.environ.get("SSL_CERT_FILE") or str(local_tls().bundle),
    }


def producer_client(connection_string: str, **options: Any) -> EventHubProducerClient:
    """``EventHubProducerClient.from_connection_string`` with :func:`client_options` (``options`` win)."""
    return EventHubProducerClient.from_connection_string(
        connection_string, **{**client_options(connection_string), **options}
    )


def consumer_client(connection_string: str, *, consumer_group: str, **options: Any) -> EventHubConsumerClient:
    """``EventHubConsumerClient.from_connection_string`` with :func:`client_options` (``options`` win)."""
    return EventHubConsumerClient.from_connection_string(
        connection_string, consumer_group=consumer_group, **{**client_options(connection_string), **options}
    )
