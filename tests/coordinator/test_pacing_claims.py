"""Rate and sequence budgets hold fleet-wide: two coordinator instances (one Azurite table, the IMDS emulator) never
approve more than a rate allows nor start a second zone; the timer approves a held event once a rate's window frees
a slot or a zone's events concluded (and its gap passed); the decision names the budget and until when; a claim is
released on withdrawal, kept by a rate on conclusion, and housekeeping deletes the entity once nothing counts."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from functools import partial

import pytest

from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.ingest import RawMessage
from emulators.imds import ImdsEmulator
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, envelope, scheduled_event, vm
from tests.coordinator.runs import batches_at_once, imds_serving, table_coordinator

POLICY = parse_policy(
    """
version: 1
rules:
  - name: freezes-two-per-10m
    match: {eventType: [Freeze]}
    action: approve-now
    rate: {maxApprovals: 2, periodSeconds: 600}
  - name: reboots-zone-by-zone
    match: {eventType: [Reboot]}
    action: approve-now
    sequence: {per: zone, gapSeconds: 120}
"""
)
RATE_KEY = "rate:freezes-two-per-10m:fleet"
SEQUENCE_KEY = "sequence:reboots-zone-by-zone:zone"
ZONES = {"web_0": "1", "web_1": "1", "web_2": "2", "web_3": "2"}
DURATION = {"Freeze": 5, "Reboot": -1}
VMS = {name: vm(name, scale_set="web", index=i + 1) | {"zone": zone} for i, (name, zone) in enumerate(ZONES.items())}


# Every instance in these tests shares the pacing policy.
coordinator = partial(table_coordinator, policy=POLICY)


def create(imds: ImdsEmulator, event_type: str, name: str) -> str:
    created = imds.create_event(
        EventType=event_type, Resources=[name], NoticeSeconds=900, DurationInSeconds=DURATION[event_type]
    )
    event_id: str = created["EventId"]
    return event_id


def report(name: str, sequence: int, events: dict[str, str]) -> RawMessage:
    """What ``name``'s forwarder sends: ``events`` (EventId -> type) listed as Scheduled."""
    listed = [scheduled_event(e, event_type=t, resources=[name], duration=DURATION[t]) for e, t in events.items()]
    data = envelope(VMS[name], sequence=sequence, incarnation=sequence, events=listed)
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def approved(imds: ImdsEmulator, ids: list[str]) -> list[str]:
    return [a["EventId"] for a in imds.approvals() if a["EventId"] in ids]


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    """Four VMs of scale set web, two in each zone; the emulator's clock stands at the coordinator's."""
    vms = [
        {"name": name, "vmScaleSetName": "web", "placementGroupId": "avset-westno", "zone": zone}
        for name, zone in ZONES.items()
    ]
    with imds_serving("pacing-tests", vms) as emulator:
        yield emulator


@pytest.fixture
def table() -> str:
    return "pacing" + uuid.uuid4().hex[:12]


def test_four_instances_racing_for_a_rate_of_two_approve_two_and_the_timer_the_rest_as_slots_free(
    azurite, imds, table, tmp_path
):
    clock = Clock(DOC_NOW)
    instances = [coordinator(azurite, imds, table, tmp_path / str(i), clock)[0] for i in range(4)]
    ids = {name: create(imds, "Freeze", name) for name in VMS}
    batches_at_once([(c, [report(name, 1, {ids[name]: "Freeze"})]) for c, name in zip(instances, VMS, strict=True)])
    first = approved(imds, list(ids.values()))
    assert len(first) == 2, "a rate of 2 approved more (or fewer) across instances"
    claims = instances[0].parts.store.get_budget(RATE_KEY)
    assert claims is not None
    assert sorted(claims.record.claims) == sorted(first)
    held = [event_id for event_id in ids.values() if event_id not in first]
    for event_id in held:
        stored = instances[0].event(event_id)
        assert stored is not None
        decision = stored.record.decision
        assert decision is not None
        assert (decision.verdict, decision.holdKind, decision.holdName) == ("wait", "budget", RATE_KEY)
        assert decision.heldUntil == DOC_NOW + timedelta(seconds=600)

    # The approved Freezes conclude: a rate still counts them until they age out.
    for name, event_id in ids.items():
        if event_id in first:
            instances[0].process_batch([report(name, 2, {})])
    clock.now += timedelta(seconds=599)
    for name, event_id in ids.items():
        if event_id in held:  # still listed (a VM silent for 300 s is not sent approvals)
            instances[3].process_batch([report(name, 2, {event_id: "Freeze"})])
    instances[1].tick()
    assert approved(imds, list(ids.values())) == first
    clock.now += timedelta(seconds=1)  # the window frees both slots: the timer approves the held ones
    instances[2].tick()
    assert sorted(approved(imds, list(ids.values()))) == sorted(ids.values())


def test_one_zone_at_a_time_across_instances_then_the_next_zone_after_its_gap(azurite, imds, table, tmp_path):
    clock = Clock(DOC_NOW)
    a, history = coordinator(azurite, imds, table, tmp_path / "a", clock)
    b, _ = coordinator(azurite, imds, table, tmp_path / "b", clock)
    zone_1 = create(imds, "Reboot", "web_0")
    a.process_batch([report("web_0", 1, {zone_1: "Reboot"})])
    assert approved(imds, [zone_1]) == [zone_1]

    zone_2 = create(imds, "Reboot", "web_2")
    b.process_batch([report("web_2", 1, {zone_2: "Reboot"})])  # another instance: zone 1 is in progress
    assert approved(imds, [zone_2]) == []
    stored = b.event(zone_2)
    assert stored is not None
    decision = stored.record.decision
    assert decision is not None
    assert (decision.holdKind, decision.holdName, decision.heldUntil) == ("budget", SEQUENCE_KEY, None)
    assert f"zone norwayeast/1 in progress ({zone_1} first, 1 in all)" in decision.reason

    also_zone_1 = create(imds, "Reboot", "web_1")
    b.process_batch([report("web_1", 1, {also_zone_1: "Reboot"})])
    assert approved(imds, [also_zone_1]) == [also_zone_1]  # the zone in progress goes on

    clock.now += timedelta(seconds=30)
    a.process_batch([report("web_0", 2, {})])  # zone_1's reboot is over; also_zone_1's is not
    a.tick()
    assert approved(imds, [zone_2]) == []
    clock.now += timedelta(seconds=30)
    done_at = clock.now
    b.process_batch([report("web_1", 2, {})])  # zone 1 has concluded: its gap runs from now
    clock.now += timedelta(seconds=119)
    a.tick()
    assert approved(imds, [zone_2]) == []
    stored = a.event(zone_2)
    assert stored is not None
    assert stored.record.decision is not None
    assert stored.record.decision.heldUntil == done_at + timedelta(seconds=120)
    clock.now += timedelta(seconds=1)
    a.tick()
    assert approved(imds, [zone_2]) == [zone_2]
    sequence = a.parts.store.get_budget(SEQUENCE_KEY)
    assert sequence is not None
    assert ([c.domains for c in sequence.record.claims.values()], sequence.record.lastDomains) == (
        [["norwayeast/2"]],
        ["norwayeast/1"],
    )
    holds = [r for r in history.rows if r.RecordType == "Decision" and r.EventId == zone_2]
    # Two holds by the same budget, each with its row: zone 1 in progress, then zone 1's gap; then the approval.
    assert [(r.Outcome, r.HoldName) for r in holds] == [
        ("wait", SEQUENCE_KEY),
        ("wait", SEQUENCE_KEY),
        ("approve", ""),
    ]
    assert "in progress" in holds[0].Reason
    assert "the next zone waits 120 s" in holds[1].Reason


def test_housekeeping_keeps_a_rate_while_it_counts_and_deletes_it_after(azurite, imds, table, tmp_path):
    clock = Clock(DOC_NOW)
    a, _ = coordinator(azurite, imds, table, tmp_path / "a", clock)
    freeze = create(imds, "Freeze", "web_0")
    a.process_batch([report("web_0", 1, {freeze: "Freeze"})])
    a.process_batch([report("web_0", 2, {})])  # concluded
    clock.now += timedelta(seconds=10)
    a.tick()  # the first tick's housekeeping: the concluded Freeze's approval still counts in the rate
    assert a.parts.store.get_budget(RATE_KEY) is not None
    clock.now += timedelta(hours=1)
    a.tick()  # the next hour's: nothing counts any more
    assert a.parts.store.get_budget(RATE_KEY) is None
