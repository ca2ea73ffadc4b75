"""The delivery queue (coordinator/adapters/delivery_queue.py) on Azurite: what a run hands over is one base64 JSON
message, as the Functions queue trigger reads it; a queue that is not there is an error that says so; the queue's
run refuses a message that is not a handed-over delivery (the host retries it, then sets it aside)."""

from __future__ import annotations

import base64
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from azure.core.credentials import AzureSasCredential
from pydantic import ValidationError

from coordinator.adapters.delivery_queue import DeliveryQueueError, QueuedDelivery, StorageQueueDeliveries
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from emulators.azurite import AzuriteEndpoints
from local.queue_trigger import StorageQueue
from tests.coordinator.helpers import DOC_NOW, MemoryHistory
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingAlerts, RecordingCallback, make_coordinator

DELIVERY = QueuedDelivery(eventId="EV-1", decisionId="d-1", executor="WestNO_0", handedOverAt=DOC_NOW)


def queue_of(azurite: AzuriteEndpoints) -> tuple[StorageQueue, str]:
    sas = azurite.queue_sas(expiry=datetime.now(UTC) + timedelta(hours=1))
    queue = StorageQueue(queue_url=f"{azurite.queue_endpoint}/q{uuid.uuid4().hex[:16]}", sas=sas)
    return queue, sas


def test_a_handed_over_delivery_is_one_base64_json_message(azurite: AzuriteEndpoints):
    queue, sas = queue_of(azurite)
    queue.create()
    StorageQueueDeliveries(queue_url=queue.url, credential=AzureSasCredential(sas)).put(DELIVERY)
    (message,) = queue.get(16, 30)
    assert QueuedDelivery.model_validate_json(base64.b64decode(message["MessageText"])) == DELIVERY
    queue.close()


def test_a_delivery_that_waits_is_invisible_until_its_delay_has_passed(azurite: AzuriteEndpoints):
    """A reroute waits for the unanswered request to lapse (pipeline/act.py reroute_at): the message is not
    visible before then, in whole seconds rounded up."""
    queue, sas = queue_of(azurite)
    queue.create()
    StorageQueueDeliveries(queue_url=queue.url, credential=AzureSasCredential(sas)).put(
        DELIVERY, delay=timedelta(seconds=1.2)
    )
    assert queue.get(16, 30) == []
    time.sleep(1.5)
    assert queue.get(16, 30) == []  # 2 s: rounded up
    time.sleep(0.7)
    (message,) = queue.get(16, 30)
    assert QueuedDelivery.model_validate_json(base64.b64decode(message["MessageText"])) == DELIVERY
    queue.close()


def test_a_queue_that_is_not_there_is_an_error_that_names_it(azurite: AzuriteEndpoints):
    queue, sas = queue_of(azurite)
    deliveries = StorageQueueDeliveries(queue_url=queue.url, credential=AzureSasCredential(sas))
    with pytest.raises(DeliveryQueueError, match=rf"{queue.url} answered HTTP 404 to Put Message"):
        deliveries.put(DELIVERY)
    queue.close()


def test_the_queues_run_refuses_a_message_that_is_no_handed_over_delivery_and_ignores_a_stale_one():
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=MemoryHistory(),
        alerts=RecordingAlerts(),
        callback=(callback := RecordingCallback()),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=lambda: DOC_NOW,
    )
    with pytest.raises(ValidationError):
        coordinator.continue_delivery(b'{"eventId": "EV-1"}')
    # No such event (concluded and purged, say): nothing to continue, nothing sent.
    report = coordinator.continue_delivery(DELIVERY.model_dump_json().encode())
    assert report.as_dict()["approvals_sent"] == 0
    assert callback.sent == []
