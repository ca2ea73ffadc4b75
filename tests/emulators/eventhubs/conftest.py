"""Fixtures: a fresh emulator per test on a free loopback port, and SDK clients with small retries/timeouts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from azure.eventhub import EventHubConsumerClient, EventHubProducerClient

from emulators.eventhubs import EventHubsEmulator, consumer_client, producer_client

HUB = "scheduled-events"
# Small, so that failures surface fast; the SDK's own retry loop is still exercised.
FAST_CLIENT: dict[str, Any] = {"retry_total": 1, "retry_backoff_factor": 0.05, "retry_backoff_max": 0.2}


@pytest.fixture
def emulator() -> Iterator[EventHubsEmulator]:
    with EventHubsEmulator(hubs={HUB: 4, "other": 2}, consumer_groups=["coordinator"]) as running:
        yield running


def producer(connection_string: str, **options: Any) -> EventHubProducerClient:
    return producer_client(connection_string, **{**FAST_CLIENT, **options})


def consumer(connection_string: str, consumer_group: str = "$Default", **options: Any) -> EventHubConsumerClient:
    return consumer_client(connection_string, consumer_group=consumer_group, **{**FAST_CLIENT, **options})
