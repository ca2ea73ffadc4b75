"""A local Event Hubs namespace speaking AMQP 1.0 to the real ``azure-eventhub`` clients (see
docs/eventhubs-emulator.md)."""

from emulators.eventhubs.clients import client_options, consumer_client, producer_client
from emulators.eventhubs.emulator import EventHubsEmulator
from emulators.eventhubs.partition_log import RejectedTransfer, StoredEvent

__all__ = [
    "EventHubsEmulator",
    "RejectedTransfer",
    "StoredEvent",
    "client_options",
    "consumer_client",
    "producer_client",
]
