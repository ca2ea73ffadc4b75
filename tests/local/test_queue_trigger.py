"""The local host's queue trigger (local/queue_trigger.py) on Azurite, as the Functions host runs continue_approval:
each message once when its invocation succeeds; one whose invocation raises again after the visibility timeout, and
in the poison queue after maxDequeueCount; host.json's settings read as the host reads them."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import azure.functions as func

from emulators.azurite import AzuriteEndpoints
from local.queue_trigger import QueueSettings, QueueTrigger, StorageQueue
from local.runner import wait_until

HOST_JSON = Path(__file__).resolve().parents[2] / "host.json"


def test_host_jsons_queue_settings_are_read_as_the_host_reads_them():
    settings = QueueSettings.from_host_json(HOST_JSON)
    assert settings == QueueSettings(
        batch_size=16, max_polling_interval=1.0, visibility_timeout=5.0, max_dequeue_count=5
    )


def test_a_message_is_taken_once_retried_after_a_failure_and_set_aside_after_the_last(azurite: AzuriteEndpoints):
    sas = azurite.queue_sas(expiry=datetime.now(UTC) + timedelta(hours=1))
    url = f"{azurite.queue_endpoint}/q{uuid.uuid4().hex[:16]}"
    queue, poison = StorageQueue(queue_url=url, sas=sas), StorageQueue(queue_url=f"{url}-poison", sas=sas)
    for each in (queue, poison):
        each.create()
    seen: Counter[bytes] = Counter()
    counts: list[int | None] = []
    lock = threading.Lock()

    def function(message: func.QueueMessage) -> None:
        with lock:
            seen[message.get_body()] += 1
            counts.append(message.dequeue_count)
        if message.get_body() == b"bad":
            raise RuntimeError("the invocation failed")

    trigger = QueueTrigger(
        queue=queue,
        poison=poison,
        function=function,
        settings=QueueSettings(batch_size=4, max_polling_interval=0.2, visibility_timeout=0, max_dequeue_count=3),
    )
    queue.put("Z29vZA==")  # base64 "good", as the coordinator writes it
    queue.put("YmFk")  # "bad"
    trigger.start()
    try:
        assert wait_until(lambda: trigger.stats.poisoned == 1, timeout=20)
    finally:
        trigger.stop()
    assert seen == {b"good": 1, b"bad": 3}
    assert sorted(c for c in counts if c is not None) == [1, 1, 2, 3]
    assert (trigger.stats.invocations, trigger.stats.failed) == (4, 3)
    assert [m["MessageText"] for m in poison.get(16, 30)] == ["YmFk"]
    assert queue.get(16, 30) == []
    for each in (queue, poison):
        each.close()
