"""Outages: the emulator goes away and comes back on the same port; with --data-dir, events survive a new
emulator process on the same directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from azure.eventhub import EventData

from emulators.eventhubs import EventHubsEmulator
from tests.emulators.eventhubs.conftest import HUB, consumer, producer
from tests.emulators.eventhubs.test_consumer import Received

ROOT = Path(__file__).resolve().parents[3]


def test_the_producer_retries_across_a_short_outage() -> None:
    with EventHubsEmulator(hubs={HUB: 2}) as emulator:
        client = producer(emulator.connection_string(HUB), retry_total=6, retry_backoff_factor=0.2)
        with client:
            client.send_batch([EventData("before")], partition_id="0")
            emulator.stop()
            port = emulator.port
            restart = threading.Timer(1.0, emulator.start)
            restart.start()
            started = time.monotonic()
            # The connection is gone and the port refuses for a second: the SDK's own retry must carry the send.
            client.send_batch([EventData("during")], partition_id="0")
            waited = time.monotonic() - started
            restart.join()
        assert emulator.port == port
        assert waited >= 0.5
        assert [event.body for event in emulator.events(HUB, 0)] == [b"before", b"during"]


def test_a_consumer_resumes_after_an_outage() -> None:
    with EventHubsEmulator(hubs={HUB: 1}) as emulator:
        with producer(emulator.connection_string(HUB)) as client:
            client.send_batch([EventData("one")])
        received = Received(consumer(emulator.connection_string(HUB)), partition_id="0", starting_position="-1")
        try:
            assert received.wait_for(1) == ["one"]
            emulator.stop()
            time.sleep(0.3)
            emulator.start()
            with producer(emulator.connection_string(HUB)) as client:
                client.send_batch([EventData("two")])
            # The SDK reconnects from the last event it saw, so nothing is delivered twice.
            assert received.wait_for(2, timeout=20) == ["one", "two"]
        finally:
            received.close()


def test_events_survive_a_new_emulator_on_the_same_data_dir(tmp_path: Path) -> None:
    with EventHubsEmulator(hubs={HUB: 2}, data_dir=tmp_path) as first:
        with producer(first.connection_string(HUB)) as client:
            client.send_batch([EventData(f"a{n}") for n in range(3)], partition_key="vm-1")
        before = first.all_events(HUB)

    with EventHubsEmulator(hubs={HUB: 2}, data_dir=tmp_path) as second:
        assert second.all_events(HUB) == before
        with producer(second.connection_string(HUB)) as client:
            client.send_batch([EventData("a3")], partition_key="vm-1")
            properties = client.get_partition_properties(before[0].partition_id)
        after = second.events(HUB, before[0].partition_id)
    assert [event.body for event in after] == [b"a0", b"a1", b"a2", b"a3"]
    assert [event.sequence_number for event in after] == [0, 1, 2, 3]
    assert after[3].offset > after[2].offset
    assert properties["last_enqueued_sequence_number"] == 3


def test_the_cli_prints_its_connection_string_and_stops_on_sigterm(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "emulators.eventhubs", "--port", "0", "--hub", "fleet:2", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert process.stdout is not None
        line = json.loads(process.stdout.readline())
        assert line["hubs"] == {"fleet": 2}
        connection_string = line["connection_string"] + ";EntityPath=fleet"
        assert f"sb://127.0.0.1:{line['port']};" in connection_string
        with producer(connection_string) as client:
            client.send_batch([EventData("via-cli")], partition_id="1")
            assert client.get_partition_properties("1")["last_enqueued_sequence_number"] == 0
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    assert (tmp_path / "fleet" / "1.log").stat().st_size > 0
