"""Service behaviour across batches and ticks: approval delivery retried until it lands, dry-run, the budget rule
with the fleet view, and the worker's own Event Hubs decode path."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest
from azure.functions.eventhub import EventHubTriggerConverter
from azure.functions.meta import Datum

from contracts.envelope import VmIdentity
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.policy import Policy
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy, parse_policy
from coordinator.pipeline import outbox, record
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator, set_graces
from coordinator.state.tables import TableStateStore
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from local.direct_callback import DirectImdsCallback
from tests.coordinator.conftest import App
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator, table_coordinator
from tests.coordinator.test_names import Listeners


class Clock:
    def __init__(self) -> None:
        self.now = DOC_NOW

    def __call__(self) -> Any:
        return self.now


def build(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp: Path, *, policy: Policy | None = None, dry_run: bool = False
) -> tuple[Coordinator, MemoryHistory, Clock]:
    clock = Clock()
    table = "s" + uuid.uuid4().hex[:12]
    coordinator, history = table_coordinator(
        azurite, imds, table, tmp, clock, policy=policy, dry_run=dry_run, approval_backoff=(5.0, 60.0)
    )
    return coordinator, history, clock


def raw(data: dict[str, Any]) -> RawMessage:
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def approvals(imds: ImdsEmulator, event_id: str) -> int:
    return len([a for a in imds.approvals() if a["EventId"] == event_id])


def test_failed_delivery_is_retried_by_the_timer_until_it_lands(azurite, imds, tmp_path):
    coordinator, history, clock = build(azurite, imds, tmp_path)
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900)["EventId"]
    imds.inject_fault(kind="error-burst", vm="WestNO_0", count=1, status=503)
    freeze = scheduled_event(event_id)
    coordinator.process_batch(
        [
            raw(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze])),
            raw(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[freeze])),
        ]
    )
    stored = coordinator.parts.store.get_event(event_id)
    assert stored is not None
    assert stored.record.state == "Scheduled"
    approval = stored.record.approval
    assert approval is not None
    assert (approval.attempts, approval.outcome, approval.delivered) == (1, "failed", False)
    assert "503" in approval.reason
    assert approval.nextAttemptAt is not None
    assert approvals(imds, event_id) == 0

    coordinator.tick()  # too early: the backoff has not passed
    assert approvals(imds, event_id) == 0
    clock.now = DOC_NOW + timedelta(minutes=2)
    coordinator.tick()
    stored = coordinator.parts.store.get_event(event_id)
    assert stored is not None
    assert stored.record.state == "Approved"
    assert stored.record.approval is not None
    assert stored.record.approval.attempts == 2
    assert approvals(imds, event_id) == 1
    outcomes = [r.Outcome for r in history.rows if r.RecordType == "Approval"]
    assert outcomes == ["sending", "failed", "sending", "approved"]  # each intent recorded before its send


def test_dry_run_decides_and_logs_but_sends_nothing(azurite, imds, tmp_path):
    coordinator, history, _ = build(azurite, imds, tmp_path, dry_run=True)
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0"], NoticeSeconds=900)["EventId"]
    coordinator.process_batch(
        [raw(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[scheduled_event(event_id)]))]
    )
    coordinator.tick()
    decisions = [r for r in history.rows if r.RecordType == "Decision"]
    assert [(d.Rule, d.Outcome, d.DryRun) for d in decisions] == [("short-freeze", "approve", True)]
    stored = coordinator.parts.store.get_event(event_id)
    assert stored is not None
    assert stored.record.approval is None
    assert stored.record.state == "Scheduled"
    assert approvals(imds, event_id) == 0


def test_budget_rule_sees_what_other_events_already_impact(azurite, imds, tmp_path):
    policy = parse_policy(
        "rules:\n  - name: one-at-a-time\n    match: {eventType: [Reboot]}\n"
        "    action: approve-within-budget\n    budget: {maxImpacted: 1}\n"
    )
    coordinator, history, _ = build(azurite, imds, tmp_path, policy=policy)
    first = scheduled_event("EV-B1", event_type="Reboot", resources=["web_1"], duration=-1)
    second = scheduled_event("EV-B2", event_type="Reboot", resources=["web_2"], duration=-1)
    web_1, web_2 = (
        vm("web_1", scale_set="web", group="pg-web", index=11),
        vm("web_2", scale_set="web", group="pg-web", index=12),
    )
    coordinator.process_batch([raw(envelope(web_1, sequence=1, incarnation=2, events=[first]))])
    coordinator.process_batch([raw(envelope(web_2, sequence=1, incarnation=2, events=[second]))])
    decisions = {r.EventId: (r.Outcome, r.Reason) for r in history.rows if r.RecordType == "Decision"}
    assert decisions["EV-B1"][0] == "approve"
    assert decisions["EV-B2"][0] == "wait"
    assert "would have 2 impacted instances (limit 1)" in decisions["EV-B2"][1]


def test_events_decoded_by_the_workers_own_converter(app: App):
    """The host hands a cardinality-many batch to the worker as one collection; the worker's converter turns it
    into EventHubEvents. Feed the function what that path produces."""
    bodies = [
        envelope(
            vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[scheduled_event("EV-WORKER", duration=30)]
        ),
        envelope(
            vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[scheduled_event("EV-WORKER", duration=30)]
        ),
    ]
    collection = Datum(type="collection_bytes", value=_Bytes([json.dumps(b).encode() for b in bodies]))
    system = [
        {
            "PartitionKey": b["vm"]["resourceId"].lower(),
            "SequenceNumber": i,
            "Offset": str(i),
            "EnqueuedTimeUtc": "2022-04-11T22:11:58Z",
        }
        for i, b in enumerate(bodies)
    ]
    events = EventHubTriggerConverter.decode(
        collection, trigger_metadata={"SystemPropertiesArray": Datum(type="json", value=json.dumps(system))}
    )
    assert isinstance(events, list)
    assert all(isinstance(e, func.EventHubEvent) for e in events)
    app.module.ingest_envelopes(events)
    stored = app.coordinator.event("EV-WORKER")
    assert stored is not None
    assert sorted(stored.record.vms) == ["WestNO_0", "WestNO_1"]


class _Bytes:
    """The shape of the host's collection_bytes datum value (a list of bytes under ``.bytes``)."""

    def __init__(self, items: list[bytes]) -> None:
        self.bytes = items


def test_event_reported_from_several_groups_concludes_when_gone_from_all(azurite, imds, tmp_path):
    """VMs outside any placement group keep their sightings in separate entities: the record is assembled from
    all of them, so 'gone from every VM' still holds across groups."""
    coordinator, history, _clock = build(azurite, imds, tmp_path)
    a, b = vm("solo-a", group="", index=21), vm("solo-b", group="", index=22)
    reboot = scheduled_event("EV-SOLO", event_type="Reboot", resources=["solo-a", "solo-b"], duration=-1)
    coordinator.process_batch([raw(envelope(a, sequence=1, incarnation=2, events=[reboot]))])
    coordinator.process_batch([raw(envelope(b, sequence=1, incarnation=2, events=[reboot]))])
    stored = coordinator.event("EV-SOLO")
    assert stored is not None
    assert len(stored.record.groups) == 2
    assert sorted(stored.record.vms) == ["solo-a", "solo-b"]
    coordinator.process_batch([raw(envelope(a, sequence=2, incarnation=3, events=[]))])
    stored = coordinator.event("EV-SOLO")
    assert stored is not None
    assert stored.record.state == "Scheduled"  # solo-b still lists it
    coordinator.process_batch([raw(envelope(b, sequence=2, incarnation=3, events=[]))])
    stored = coordinator.event("EV-SOLO")
    assert stored is not None
    assert stored.record.state == "Canceled"
    assert [r.State for r in history.rows if r.RecordType == "Transition"] == ["Canceled"]


def test_timer_concludes_an_event_whose_other_vm_fell_silent(azurite, imds, tmp_path):
    coordinator, _history, clock = build(azurite, imds, tmp_path)
    hw = scheduled_event("EV-HW", event_type="Reboot", status="Started", duration=-1)
    a, b = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    coordinator.process_batch([raw(envelope(x, sequence=1, incarnation=2, events=[hw])) for x in (a, b)])
    clock.now = DOC_NOW + timedelta(minutes=1)
    later = DOC_NOW + timedelta(minutes=1)
    coordinator.process_batch([raw(envelope(a, sequence=2, incarnation=3, events=[], observed_at=later))])
    stored = coordinator.event("EV-HW")
    assert stored is not None
    assert stored.record.state == "Started"  # WestNO_1 has not said anything yet
    clock.now = DOC_NOW + timedelta(minutes=7)  # WestNO_1 silent beyond the 5-minute heartbeat timeout
    coordinator.tick()
    stored = coordinator.event("EV-HW")
    assert stored is not None
    assert stored.record.state == "Completed"


def scale_out_while_arm_hangs(tmp_path: Path, vms: int) -> tuple[Coordinator, threading.Event, list[str], list[str]]:
    """A coordinator with its tails after the batch (as deployed) whose new VMs' setup hangs (ARM) until the event
    returned is set; one batch of ``vms`` new VMs of scale set web. Gives the coordinator, that event, the VMs set up
    so far and the VMs' names."""
    hung, seen = threading.Event(), []

    def set_up(identity: VmIdentity) -> None:
        hung.wait(10)
        seen.append(identity.name)

    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=MemoryHistory(),
        alerts=FolderCardSink(tmp_path),
        callback=Listeners(),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=lambda: DOC_NOW,
        after_batch=concurrent.futures.ThreadPoolExecutor(2),
        on_new_vm=set_up,
    )
    fleet = [vm(f"web_{n}", index=n + 1, group="pg-web", scale_set="web") for n in range(vms)]
    coordinator.process_batch([raw(envelope(web, sequence=1, incarnation=1, events=[])) for web in fleet])
    return coordinator, hung, seen, [web["name"] for web in fleet]


def test_a_new_vms_setup_holds_no_batch_when_tails_run_after_it(tmp_path):
    """With the tails after the batch (as deployed), a scale-out's new VMs are set up on threads of their own (each
    an ARM round trip or two, 20 s a call while ARM hangs): the batch returns while ARM hangs, each VM is set up
    once, and ``drain`` waits for them. Before, the batch called ARM for each new VM before it returned."""
    coordinator, hung, seen, names = scale_out_while_arm_hangs(tmp_path, 6)
    assert seen == [], "the batch returned while every setup was held"
    assert not coordinator.drain(0.1)
    hung.set()
    assert coordinator.drain(10)
    assert sorted(seen) == names
    coordinator.close()


def test_closing_with_setups_queued_cancels_them_and_returns(tmp_path):
    """A host that stops while ARM hangs: the queued setups are cancelled (each VM is set up when it next reports),
    and ``close`` returns."""
    coordinator, hung, _, _ = scale_out_while_arm_hangs(tmp_path, 8)
    closing = threading.Thread(target=coordinator.close, kwargs={"timeout": 0.1})
    closing.start()
    closing.join(5)
    assert not closing.is_alive(), "close waited on the setups' lock"
    hung.set()


def test_new_and_returning_vms_are_set_up_and_housekeeping_runs_hourly(azurite, imds, tmp_path):
    """The hooks wiring.py connects to relay_admin (create the VM's hybrid connection; delete stale ones)."""
    seen: list[str] = []
    cleanups: list[dict[str, Any]] = []
    clock = Clock()
    coordinator = make_coordinator(
        store=TableStateStore.from_connection_string(
            azurite.connection_string, table_name="hk" + uuid.uuid4().hex[:12]
        ),
        history=MemoryHistory(),
        alerts=FolderCardSink(tmp_path),
        callback=DirectImdsCallback(base_url=imds.url),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=clock,
        on_new_vm=lambda identity: seen.append(identity.name),
        housekeeping=lambda last_seen, now: cleanups.append(dict(last_seen)),
    )
    web = vm("WestNO_0", index=1)
    coordinator.process_batch([raw(envelope(web, sequence=1, incarnation=1, events=[]))])
    coordinator.process_batch([raw(envelope(web, sequence=2, kind="heartbeat"))])
    assert seen == ["WestNO_0"]
    clock.now = DOC_NOW + timedelta(minutes=10)
    coordinator.tick()  # heartbeat lost; housekeeping runs (first tick)
    coordinator.tick()  # within the hour: no second run
    assert len(cleanups) == 1
    assert list(cleanups[0]) == [f"vm-{web['vmId']}"]
    later = DOC_NOW + timedelta(minutes=11)
    coordinator.process_batch([raw(envelope(web, sequence=3, kind="heartbeat", observed_at=later))])
    assert seen == ["WestNO_0", "WestNO_0"]  # back from silence: set up again


def test_hourly_housekeeping_deletes_concluded_events_after_the_retention(azurite, imds, tmp_path):
    coordinator, _, clock = build(azurite, imds, tmp_path)
    assert coordinator.options.retention == timedelta(days=30)
    web = vm("WestNO_0", index=1)
    listed = [scheduled_event("EV-DONE", event_type="Reboot", duration=-1)]
    coordinator.process_batch([raw(envelope(web, sequence=1, incarnation=1, events=listed))])
    clock.now = DOC_NOW + timedelta(minutes=1)
    coordinator.process_batch([raw(envelope(web, sequence=2, incarnation=2, events=[], observed_at=clock.now))])
    later = [scheduled_event("EV-OPEN", event_type="Reboot", duration=-1)]
    coordinator.process_batch([raw(envelope(web, sequence=3, incarnation=3, events=later, observed_at=clock.now))])
    done = coordinator.event("EV-DONE")
    assert done is not None
    assert done.record.state == "Canceled"

    clock.now = DOC_NOW + timedelta(days=29)
    assert coordinator.tick().events_purged == 0  # concluded 29 days ago: kept
    assert coordinator.event("EV-DONE") is not None

    clock.now = DOC_NOW + timedelta(days=30, minutes=30)
    assert coordinator.tick().events_purged == 1
    assert coordinator.event("EV-DONE") is None
    still = coordinator.event("EV-OPEN")  # open (Expired by now): never purged
    assert still is not None
    assert still.record.state == "Expired"


def test_set_graces_shortens_what_the_timer_waits_for_and_none_keeps_a_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "OUTBOX_GRACE", record.OUTBOX_GRACE)  # both put back after the test
    monkeypatch.setattr(outbox, "ALERT_GRACE", outbox.ALERT_GRACE)

    def graces() -> tuple[timedelta, timedelta]:
        return record.OUTBOX_GRACE, outbox.ALERT_GRACE

    cards = outbox.ALERT_GRACE
    set_graces(history=timedelta(seconds=6))
    assert graces() == (timedelta(seconds=6), cards)
    set_graces(cards=timedelta(seconds=2))
    assert graces() == (timedelta(seconds=6), timedelta(seconds=2))
