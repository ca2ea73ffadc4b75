"""Ingest (coordinator/pipeline/ingest.py): a batch's messages read into each VM's envelopes in arrival order; every
message that fails is set aside as a dead letter with its reason, alone; Event Grid events read beside them."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

import pytest

from coordinator.pipeline import ingest
from coordinator.pipeline.ingest import RawMessage
from tests.coordinator.helpers import DOC_NOW, envelope, grid_event, scheduled_event
from tests.coordinator.runs import Bench, identity, message

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def report(name: str, number: int, /, **fields: Any) -> dict[str, Any]:
    """``name``'s envelope number ``number`` (its sequence and incarnation), with ``fields`` put over it."""
    return {**envelope(identity(name).model_dump(), sequence=number, incarnation=number), **fields}


def read(bench: Bench, *messages: RawMessage, channel: ingest.Channel = "vms") -> tuple[ingest.Arrivals, list[str]]:
    """What ingest made of the messages from the hub of ``channel``, and the reasons of the dead letters it wrote
    history rows for."""
    run = bench.run()
    arrivals = ingest.read_batch(run, messages, channel)
    assert run.stages == ["ingest"]
    return arrivals, [row.Reason for row in run.work.rows if row.RecordType == "DeadLetter"]


def test_envelopes_are_grouped_per_vm_in_arrival_order_with_their_messages_and_traces(bench: Bench):
    traced = RawMessage(
        body=json.dumps(report("WestNO_0", 2)).encode(),
        partition_key=identity("WestNO_0").resourceId.lower(),
        traceparent=TRACEPARENT,
    )
    untraced = message(report("WestNO_0", 3))
    garbled = RawMessage(body=untraced.body, partition_key=untraced.partition_key, traceparent="00-not-a-trace")
    messages = [message(report("WestNO_0", 1)), message(report("WestNO_1", 1)), traced, garbled]
    arrivals, dead = read(bench, *messages)
    west0, west1 = identity("WestNO_0").vmId.lower(), identity("WestNO_1").vmId.lower()
    assert dead == []
    assert {vm: [e.sequence for e in envelopes] for vm, envelopes in arrivals.by_vm.items()} == {
        west0: [1, 2, 3],
        west1: [1],
    }
    assert arrivals.raw_of[west0] == [messages[0], traced, garbled]
    # Only a valid W3C trace context is kept (the forwarder's word, never trusted to be well-formed).
    assert arrivals.traces == {(west0, 2): TRACEPARENT}


def test_unknown_identity_fields_are_not_kept(bench: Bench):
    data = report("WestNO_0", 1)
    data["vm"] = {**data["vm"], "hostname": "web-prod-17"}
    arrivals, _ = read(bench, message(data))
    [[kept]] = arrivals.by_vm.values()
    assert "hostname" not in kept.vm.model_dump()


@pytest.mark.parametrize(
    ("partition_key", "reason"),
    [
        (None, "refused: no partition key: a forwarder sends with partition key = its vm.resourceId"),
        ("/subscriptions/x/other-vm", "refused: partition key '/subscriptions/x/other-vm' is not the envelope's"),
    ],
)
def test_an_envelope_is_accepted_only_on_its_own_vms_partition_key(bench: Bench, partition_key, reason):
    body = json.dumps(report("WestNO_0", 1)).encode()
    arrivals, dead = read(bench, RawMessage(body=body, partition_key=partition_key))
    assert arrivals.by_vm == {}
    [why] = dead
    assert why.startswith(reason)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"sequence": 2**63}, "refused: sequence 9223372036854775808… does not fit in 64 bits"),
        ({"observedAt": (DOC_NOW + timedelta(days=2)).isoformat()}, "refused: observedAt 2022-04-13T22:11:58+00:00"),
        ({"schema": "scheduled-events.envelope/9"}, "invalid envelope: schema: Value error, envelope schema"),
        (
            {"document": {"DocumentIncarnation": 1, "Events": [scheduled_event(f"E{n}") for n in range(101)]}},
            "refused: document lists 101 events (limit 100)",
        ),
    ],
)
def test_what_storage_cannot_hold_or_the_contract_refuses_is_set_aside_with_its_reason(bench: Bench, fields, reason):
    arrivals, dead = read(bench, message(report("WestNO_0", 1, **fields)), message(report("WestNO_1", 1)))
    [why] = dead
    assert why.startswith(reason), why
    # The rest of the batch goes on.
    assert list(arrivals.by_vm) == [identity("WestNO_1").vmId.lower()]


def test_a_dead_letter_keeps_the_message_and_names_it_without_its_body(bench: Bench):
    body = b"\xff\xfe not text"
    run = bench.run()
    arrivals = ingest.read_batch(run, [RawMessage(body=body, partition_key="vm-x", sequence_number=42)])
    [letter] = arrivals.dead
    assert (letter.body, letter.received_at, letter.source["sequenceNumber"]) == (body, DOC_NOW, 42)
    [row] = run.work.rows
    assert row.Details is not None
    assert (row.Details["bodyBytes"], row.Details["bodySha256"]) == (len(body), hashlib.sha256(body).hexdigest())
    assert row.Reason.startswith("invalid envelope: ")


def test_event_grid_events_are_read_from_the_platforms_hub_one_bad_event_setting_its_message_aside(bench: Bench):
    good, again = grid_event("EV-1", grid_id="g-1"), grid_event("EV-1", grid_id="g-1")
    bad = {"id": "g-bad", "eventType": "Something.Else"}
    arrivals, dead = read(
        bench,
        RawMessage(body=json.dumps([good, bad]).encode()),
        RawMessage(body=json.dumps(again).encode()),
        channel="platform",
    )
    assert [event.id for event in arrivals.grid] == ["g-1"]
    # The platform may publish an event twice: counted, not read again.
    assert arrivals.grid_duplicates == 1
    [why] = dead
    assert why.startswith("invalid Event Grid event(s): event 1: eventType: ")
    assert arrivals.by_vm == {}


def test_each_hub_carries_one_kind_an_event_grid_event_on_the_vms_hub_is_a_forgery_set_aside(bench: Bench):
    forged = grid_event("EV-1", grid_id="g-1", resources=[f"ghost_{n}" for n in range(1000)])
    arrivals, dead = read(
        bench,
        RawMessage(body=json.dumps(forged).encode(), partition_key=identity("WestNO_0").resourceId.lower()),
        RawMessage(body=json.dumps([forged]).encode()),
        message(report("WestNO_0", 1)),
    )
    assert arrivals.grid == []
    assert list(arrivals.by_vm) == [identity("WestNO_0").vmId.lower()]
    assert dead == [ingest.GRID_ON_VM_HUB, ingest.GRID_ON_VM_HUB]
    assert "no VM may send to" in ingest.GRID_ON_VM_HUB
    # And an envelope on Event Grid's hub is no envelope of the platform's.
    arrivals, dead = read(bench, message(report("WestNO_0", 2)), channel="platform")
    assert (arrivals.by_vm, arrivals.grid, dead) == ({}, [], [ingest.ENVELOPE_ON_PLATFORM_HUB])


def measured(name: str, number: int, payload: str, **fields: Any) -> dict[str, Any]:
    """``name``'s impact report of a 5 s Freeze, or its prepare hooks' report, with ``fields`` put over it."""
    data = envelope(identity(name).model_dump(), sequence=number, kind=payload)
    at = DOC_NOW.isoformat()
    if payload == "impact":
        base = {"eventType": "Freeze", "measure": "pause", "measuredSeconds": 5.2, "start": at, "end": at}
    else:
        base = {"phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.5, "budgetSeconds": 60}
    data[payload] = {"eventId": "E1", **base, **fields}
    return data


@pytest.mark.parametrize(
    ("payload", "field", "value", "why"),
    [
        ("impact", "measuredSeconds", float("inf"), "Input should be a finite number"),
        ("impact", "measuredSeconds", float("nan"), "Input should be a finite number"),
        ("impact", "measuredSeconds", 1e308, "Input should be less than or equal to 604800"),
        ("impact", "measuredSeconds", 604_800.5, "Input should be less than or equal to 604800"),
        ("impact", "wallGapSeconds", float("-inf"), "Input should be a finite number"),
        ("impact", "monotonicGapSeconds", 1e308, "Input should be less than or equal to 604800"),
        ("impact", "announcedSeconds", 2**62, "Input should be less than or equal to 604800"),
        ("hook", "durationSeconds", float("inf"), "Input should be a finite number"),
        ("hook", "budgetSeconds", 1e308, "Input should be less than or equal to 604800"),
        ("hook", "budgetUsed", float("inf"), "Input should be a finite number"),
    ],
)
def test_seconds_are_finite_and_at_most_a_week_or_the_message_is_set_aside_naming_the_field(
    bench: Bench, payload: str, field: str, value: float, why: str
):
    """``measuredSeconds: Infinity`` was accepted (1e308 too), and its row written as ``Infinity``, which is not
    JSON: a strict Logs Ingestion endpoint refused that row and every row sent with it, at every later write."""
    bad = message(measured("WestNO_0", 1, payload, **{field: value}))  # json.dumps writes Infinity and NaN
    arrivals, dead = read(bench, bad, message(measured("WestNO_1", 1, payload)))
    [reason] = dead
    assert reason.startswith(f"invalid envelope: {payload}.{field}: {why}"), reason
    assert list(arrivals.by_vm) == [identity("WestNO_1").vmId.lower()]
