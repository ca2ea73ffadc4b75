"""The local function host: real azure-eventhub consumer against the Event Hubs emulator, checkpoints in Azurite,
batches in the Functions host's shape, retries and failure counting."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import azure.functions as func
import pytest
from azure.eventhub import EventData
from azure.storage.blob import ContainerClient

from emulators.azurite import AzuriteEndpoints
from emulators.eventhubs import EventHubsEmulator, producer_client
from local import runner
from local.runner import AZURITE_BLOB_API_VERSION, FunctionHost, wait_until
from tests.loopback import SocketServer

HUB = "scheduled-events"


@pytest.fixture
def eventhubs() -> Iterator[EventHubsEmulator]:
    with EventHubsEmulator(hubs={HUB: 2}) as emulator:
        yield emulator


def host_of(
    azurite: AzuriteEndpoints,
    eventhubs: EventHubsEmulator,
    ingest: Callable[[list[func.EventHubEvent]], None],
    **options: Any,
) -> FunctionHost:
    """A host of ``ingest`` on the emulator's hub, its checkpoints in a container of its own."""
    return FunctionHost(
        eventhub_connection_string=eventhubs.connection_string(),
        eventhub_name=HUB,
        storage_connection_string=azurite.connection_string,
        ingest=ingest,
        **({"checkpoint_container": f"checkpoints-{uuid.uuid4().hex[:8]}"} | options),
    )


def send(eventhubs: EventHubsEmulator, bodies: list[bytes]) -> None:
    """``bodies`` in one batch, under one VM's partition key."""
    with producer_client(eventhubs.connection_string(HUB)) as producer:
        batch = producer.create_batch(partition_key="/subscriptions/s/vm-a")
        for body in bodies:
            batch.add(EventData(body))
        producer.send_batch(batch)


def test_batches_reach_the_function_in_the_hosts_shape_and_are_checkpointed(
    azurite: AzuriteEndpoints, eventhubs: EventHubsEmulator
) -> None:
    received: list[func.EventHubEvent] = []
    lock = threading.Lock()

    def ingest(events: list[func.EventHubEvent]) -> None:
        with lock:
            received.extend(events)

    container = f"checkpoints-{uuid.uuid4().hex[:8]}"
    host = host_of(azurite, eventhubs, ingest, checkpoint_container=container, max_batch_size=10)
    host.start()
    try:
        send(eventhubs, [f'{{"n": {index}}}'.encode() for index in range(25)])
        assert wait_until(lambda: len(received) >= 25, timeout=20)
    finally:
        host.stop()
    bodies = [event.get_body() for event in received]
    assert bodies == [f'{{"n": {index}}}'.encode() for index in range(25)]
    assert {event.partition_key for event in received} == {"/subscriptions/s/vm-a"}
    assert [event.sequence_number for event in received] == list(range(25))
    assert all(event.enqueued_time is not None and isinstance(event.offset, str) for event in received)
    assert host.stats.batches >= 3  # at most 10 per invocation
    assert host.stats.events == 25
    blobs = ContainerClient.from_connection_string(
        azurite.connection_string, container, api_version=AZURITE_BLOB_API_VERSION
    )
    names = [blob.name for blob in blobs.list_blobs()]
    assert any("/checkpoint/" in name for name in names), names


def test_a_failing_batch_is_retried_then_counted_as_failed(
    azurite: AzuriteEndpoints, eventhubs: EventHubsEmulator
) -> None:
    attempts: list[int] = []

    def flaky(events: list[func.EventHubEvent]) -> None:
        attempts.append(len(events))
        if len(attempts) < 3:
            raise RuntimeError("state store unavailable")

    def broken(events: list[func.EventHubEvent]) -> None:
        raise RuntimeError("always")

    event = func.EventHubEvent(body=b"{}")
    common = {
        "eventhub_connection_string": eventhubs.connection_string(),
        "eventhub_name": HUB,
        "storage_connection_string": azurite.connection_string,
        "checkpoint_container": f"retry-{uuid.uuid4().hex[:8]}",
        "max_attempts": 3,
        "retry_initial": 0.01,
        "retry_maximum": 0.02,
    }
    host = FunctionHost(ingest=flaky, **common)  # type: ignore[arg-type]
    assert host.deliver([event]) is True
    assert attempts == [1, 1, 1]
    assert (host.stats.retries, host.stats.failed_batches, host.stats.batches) == (2, 0, 1)
    failing = FunctionHost(ingest=broken, **common)  # type: ignore[arg-type]
    assert failing.deliver([event]) is False
    assert (failing.stats.retries, failing.stats.failed_batches) == (3, 1)
    assert "state store unavailable" in host.stats.errors[0]


def test_what_holds_a_partition_up_is_noted_with_its_time(
    azurite: AzuriteEndpoints, eventhubs: EventHubsEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every batch counts as late and every call as slow here, so that one short run shows each kind of note.
    monkeypatch.setattr(runner, "LATE_BATCH_SECONDS", -1.0)
    monkeypatch.setattr(runner, "SLOW_INVOCATION_SECONDS", 0.05)
    received: list[func.EventHubEvent] = []

    def slow(events: list[func.EventHubEvent]) -> None:
        time.sleep(0.3)
        received.extend(events)

    host = host_of(azurite, eventhubs, slow)
    host.start()
    try:
        send(eventhubs, [b"{}"])
        assert wait_until(lambda: bool(received), timeout=20)
    finally:
        host.stop()
    stalls = host.stats.stalls
    assert any(re.fullmatch(r"\S+ partition \d claimed", note) for note in stalls), stalls
    assert any(re.fullmatch(r"\S+ partition \d: 1 events reached the trigger \d+\.\d s late", n) for n in stalls)
    assert any("ingest_envelopes (1 events, attempt 1) still running after 0.05 s, at:" in n for n in stalls)
    assert any(re.fullmatch(r"\S+ partition \d closed: SHUTDOWN", note) for note in stalls), stalls
    assert all(datetime.fromisoformat(note.split(" ", 1)[0]).tzinfo is not None for note in stalls)
    assert host.stats.as_dict()["stalls"] == stalls[-5:]


class _BusyOnce(SocketServer):
    """Azurite's blob endpoint behind a loopback proxy that, once armed, answers its next connection's request with
    503 Server Busy (a storage front end under load) and closes it; every other connection is passed through."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.armed = False
        self.refused = 0
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        if self.armed:
            self.armed = False
            self.refused += 1
            connection.recv(65536)  # the checkpoint's PUT: headers and metadata, no body
            connection.sendall(b"HTTP/1.1 503 Server Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            connection.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=_pump, args=(upstream, connection), daemon=True).start()
        threading.Thread(target=_pump, args=(connection, upstream), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for end in (source, sink):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)


def test_a_checkpoint_write_refused_once_is_retried_within_about_a_second_as_the_host_retries(
    azurite: AzuriteEndpoints,
) -> None:
    # The Python blob client's own first retry waits 15 s (±3) and the partition's next batch waits for it; the
    # Functions host's storage client retries from 0.8 s.
    proxy = _BusyOnce(azurite.blob_port)
    container = f"checkpoints-{uuid.uuid4().hex[:8]}"
    connection = azurite.connection_string.replace(f"127.0.0.1:{azurite.blob_port}/", f"127.0.0.1:{proxy.port}/")
    store = runner._checkpoint_store(connection, container)
    proxy.armed = True
    started = time.monotonic()
    store.update_checkpoint(
        {
            "fully_qualified_namespace": "localhost",
            "eventhub_name": HUB,
            "consumer_group": "$Default",
            "partition_id": "0",
            "offset": "42",
            "sequence_number": 7,
        }
    )
    took = time.monotonic() - started
    checkpoints = store.list_checkpoints("localhost", HUB, "$Default")
    proxy.close()
    assert proxy.refused == 1
    assert [(c["partition_id"], c["sequence_number"]) for c in checkpoints] == [("0", 7)]
    assert took < 5.0, f"the refused checkpoint took {took:.1f} s to be written"
