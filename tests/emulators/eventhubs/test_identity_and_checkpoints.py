"""The paths the forwarder and the coordinator take: a token credential (managed identity) instead of a key, and
a consumer that checkpoints to Blob storage (Azurite) and resumes after a restart."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from azure.core.credentials import AccessToken
from azure.eventhub import EventData, EventHubConsumerClient, EventHubProducerClient
from azure.eventhub.exceptions import AuthenticationError
from azure.eventhub.extensions.checkpointstoreblob import BlobCheckpointStore
from azure.storage.blob import BlobServiceClient

from emulators.azurite import AzuriteEndpoints
from emulators.eventhubs import EventHubsEmulator, client_options, consumer_client
from emulators.tokens import mint_token
from tests.emulators.eventhubs.conftest import FAST_CLIENT, HUB, producer
from tests.emulators.eventhubs.test_consumer import Received

VM = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/0"


class EmulatorIdentity:
    """A TokenCredential as the forwarder's ManagedIdentityCredential would be, minting emulator tokens."""

    def __init__(self, audience: str = "https://eventhubs.azure.net") -> None:
        self.audience = audience
        self.scopes: list[str] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.scopes.extend(scopes)
        token, expires_on = mint_token(audience=self.audience, identity_resource_id=VM)
        return AccessToken(token, expires_on)


def _identity_producer(emulator: EventHubsEmulator, credential: EmulatorIdentity) -> EventHubProducerClient:
    return EventHubProducerClient(
        fully_qualified_namespace=f"127.0.0.1:{emulator.port}",
        eventhub_name=HUB,
        credential=credential,
        **client_options(emulator.connection_string()),
        **FAST_CLIENT,
    )


def test_a_managed_identity_token_is_accepted(emulator: EventHubsEmulator) -> None:
    identity = EmulatorIdentity()
    with _identity_producer(emulator, identity) as client:
        client.send_event(EventData("with-identity"), partition_key=VM)
    assert identity.scopes[0] == "https://eventhubs.azure.net//.default"
    assert [event.body for event in emulator.all_events(HUB)] == [b"with-identity"]


def test_a_token_for_another_audience_is_refused(emulator: EventHubsEmulator) -> None:
    with (
        _identity_producer(emulator, EmulatorIdentity("https://relay.azure.net")) as client,
        pytest.raises(AuthenticationError, match="access token refused"),
    ):
        client.send_event(EventData("nope"))
    assert emulator.all_events(HUB) == []


def test_a_large_event_crosses_several_frames_intact(emulator: EventHubsEmulator) -> None:
    body = bytes(range(256)) * 1200  # 300 KiB, about ten 32 KiB frames
    with producer(emulator.connection_string(HUB)) as client:
        client.send_event(EventData(body), partition_id="0")
    assert emulator.events(HUB, 0)[0].body == body


def test_a_checkpointing_consumer_resumes_where_it_left_off(
    emulator: EventHubsEmulator, azurite: AzuriteEndpoints
) -> None:
    container = f"checkpoints-{uuid.uuid4().hex}"
    BlobServiceClient.from_connection_string(azurite.connection_string).create_container(container)

    def checkpointing_consumer() -> EventHubConsumerClient:
        store = BlobCheckpointStore.from_connection_string(azurite.connection_string, container_name=container)
        return consumer_client(
            emulator.connection_string(HUB), consumer_group="coordinator", checkpoint_store=store, **FAST_CLIENT
        )

    with producer(emulator.connection_string(HUB)) as client:
        client.send_batch([EventData(f"first-{n}") for n in range(3)], partition_id="0")

    first = Received(checkpointing_consumer(), checkpoint=True, partition_id="0", starting_position="-1")
    try:
        assert first.wait_for(3) == ["first-0", "first-1", "first-2"]
    finally:
        first.close()

    with producer(emulator.connection_string(HUB)) as client:
        client.send_batch([EventData("second-0"), EventData("second-1")], partition_id="0")
    second = Received(checkpointing_consumer(), partition_id="0", starting_position="-1")
    try:
        assert second.wait_for(2) == ["second-0", "second-1"]
        time.sleep(0.3)
        assert second.bodies() == ["second-0", "second-1"]
    finally:
        second.close()
