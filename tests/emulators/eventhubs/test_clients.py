"""``client_options``: what the SDK needs to reach the namespace a connection string names (pure)."""

from __future__ import annotations

import pytest
from azure.eventhub import TransportType

from emulators.eventhubs import client_options
from emulators.tls import local_tls

KEY = "SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=k"


@pytest.mark.parametrize(
    "connection_string",
    [
        f"Endpoint=sb://ns.servicebus.windows.net/;{KEY}",  # the service: 5671, public CAs
        f"Endpoint=sb://ns.servicebus.windows.net:5671/;{KEY}",
        f"Endpoint=sb://127.0.0.1:41234;{KEY};UseDevelopmentEmulator=true",  # plain AMQP on that port
        f"endpoint=sb://127.0.0.1:41234;{KEY};usedevelopmentemulator=TRUE",
    ],
)
def test_nothing_is_added_where_the_sdk_already_reaches_the_namespace(connection_string: str) -> None:
    assert client_options(connection_string) == {}


def test_a_namespace_on_its_own_port_over_tls_is_reached_there_and_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", "/somewhere/bundle.pem")
    options = client_options(f"Endpoint=sb://127.0.0.1:41234;{KEY};EntityPath=scheduled-events")
    assert options == {
        "custom_endpoint_address": "sb://127.0.0.1:41234",
        "transport_type": TransportType.Amqp,
        "connection_verify": "/somewhere/bundle.pem",
    }
    monkeypatch.delenv("SSL_CERT_FILE")
    assert client_options(f"Endpoint=sb://127.0.0.1:41234;{KEY}")["connection_verify"] == str(local_tls().bundle)
