"""The real azure-eventhub producer against the emulator over AMQP on loopback."""

from __future__ import annotations

import pytest
from azure.eventhub import EventData
from azure.eventhub.exceptions import AuthenticationError, EventHubError

from emulators.eventhubs import EventHubsEmulator
from emulators.eventhubs.links import partition_for_key
from tests.emulators.eventhubs.conftest import HUB, producer


def _where(emulator: EventHubsEmulator, hub: str = HUB) -> dict[str, list[bytes]]:
    return {
        str(partition): [event.body for event in emulator.events(hub, partition)]
        for partition in range(emulator.hubs[hub])
        if emulator.events(hub, partition)
    }


def test_batches_with_a_partition_key_land_in_order_on_the_keys_partition(emulator: EventHubsEmulator) -> None:
    key = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/3"
    with producer(emulator.connection_string(HUB)) as client:
        for start in (0, 3):
            batch = client.create_batch(partition_key=key)
            for number in range(start, start + 3):
                event = EventData(f'{{"n": {number}}}')
                event.properties = {"kind": "incarnation", "n": number}
                batch.add(event)
            client.send_batch(batch)
        client.send_batch([EventData("list-1"), EventData("list-2")], partition_key=key)

    expected_partition = partition_for_key(key, 4)
    stored = emulator.events(HUB, expected_partition)
    assert [event.body for event in stored] == [f'{{"n": {n}}}'.encode() for n in range(6)] + [b"list-1", b"list-2"]
    assert [event.sequence_number for event in stored] == list(range(8))
    assert all(event.partition_key == key for event in stored)
    assert [event.properties for event in stored[:6]] == [{"kind": "incarnation", "n": n} for n in range(6)]
    offsets = [event.offset for event in stored]
    assert offsets == sorted(set(offsets))
    assert sum(len(emulator.events(HUB, p)) for p in range(4)) == 8


def test_a_batch_without_a_key_stays_together_and_in_order(emulator: EventHubsEmulator) -> None:
    with producer(emulator.connection_string(HUB)) as client:
        client.send_batch([EventData(f"a{n}") for n in range(5)])
        client.send_batch([EventData(f"b{n}") for n in range(5)])

    placed = _where(emulator)
    batches = sorted(placed.values())
    assert batches == [[f"a{n}".encode() for n in range(5)], [f"b{n}".encode() for n in range(5)]] or batches == [
        [f"a{n}".encode() for n in range(5)] + [f"b{n}".encode() for n in range(5)]
    ]


def test_send_event_and_partition_targeted_sends(emulator: EventHubsEmulator) -> None:
    with producer(emulator.connection_string(HUB)) as client:
        client.send_event(EventData("to-partition-2"), partition_id="2")
        client.send_batch([EventData("also-2")], partition_id="2")
        client.send_event(EventData("keyed"), partition_key="vm-a")

    assert [event.body for event in emulator.events(HUB, 2)][:2] == [b"to-partition-2", b"also-2"]
    keyed = emulator.events(HUB, partition_for_key("vm-a", 4))
    assert keyed[-1].body == b"keyed"
    assert keyed[-1].partition_key == "vm-a"


def test_hub_and_partition_properties(emulator: EventHubsEmulator) -> None:
    with producer(emulator.connection_string(HUB)) as client:
        empty = client.get_partition_properties("1")
        client.send_batch([EventData("x"), EventData("y")], partition_id="1")
        hub = client.get_eventhub_properties()
        filled = client.get_partition_properties("1")

    assert hub["eventhub_name"] == HUB
    assert hub["partition_ids"] == ["0", "1", "2", "3"]
    assert empty["is_empty"] is True
    assert empty["last_enqueued_sequence_number"] == -1
    stored = emulator.events(HUB, 1)
    assert filled["is_empty"] is False
    assert filled["beginning_sequence_number"] == 0
    assert filled["last_enqueued_sequence_number"] == 1
    assert filled["last_enqueued_offset"] == str(stored[-1].offset)
    assert filled["last_enqueued_time_utc"] == stored[-1].enqueued_time


def test_a_wrong_sas_key_is_refused_and_nothing_is_stored(emulator: EventHubsEmulator) -> None:
    wrong = emulator.connection_string(HUB).replace(emulator.sas_key, "not-the-key")
    with producer(wrong) as client, pytest.raises(AuthenticationError, match="signature does not match"):
        client.send_batch([EventData("must not land")])

    assert sum(len(emulator.events(HUB, p)) for p in range(4)) == 0
    assert emulator.stats.tokens_refused >= 1


def test_a_wrong_key_name_is_refused(emulator: EventHubsEmulator) -> None:
    wrong = emulator.connection_string(HUB).replace(emulator.sas_key_name, "SomeOtherPolicy")
    with producer(wrong) as client, pytest.raises(AuthenticationError, match="SomeOtherPolicy"):
        client.get_eventhub_properties()


def test_an_unknown_hub_is_not_found(emulator: EventHubsEmulator) -> None:
    missing = emulator.connection_string() + ";EntityPath=no-such-hub"
    with producer(missing) as client, pytest.raises(EventHubError, match="no-such-hub"):
        client.send_batch([EventData("x")])
    assert emulator.stats.events_stored == 0


def test_keyed_sends_land_where_the_sdks_buffered_producer_puts_them(emulator: EventHubsEmulator) -> None:
    keys = [f"/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm{n}" for n in range(6)]
    with producer(emulator.connection_string(HUB)) as client:
        for key in keys:
            client.send_event(EventData(f"direct:{key}"), partition_key=key)
    # The buffered producer resolves the partition itself and sends to /Partitions/<n>.
    buffered = producer(
        emulator.connection_string(HUB),
        buffered_mode=True,
        on_success=lambda events, partition: None,
        on_error=lambda events, partition, error: None,
        max_wait_time=0.1,
    )
    with buffered:
        for key in keys:
            buffered.send_event(EventData(f"buffered:{key}"), partition_key=key)
        buffered.flush()
    for partition in range(4):
        bodies = [event.body.decode() for event in emulator.events(HUB, partition)]
        direct = {body.split(":", 1)[1] for body in bodies if body.startswith("direct:")}
        via_buffer = {body.split(":", 1)[1] for body in bodies if body.startswith("buffered:")}
        assert direct == via_buffer, partition
    assert len({partition_for_key(key, 4) for key in keys}) > 1  # the keys do spread
