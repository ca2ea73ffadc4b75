"""Hypothesis-generated garbage among good envelopes: every bad message is dead-lettered and counted, every good
one is processed, and nothing carried by a refused message is ever approved."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from coordinator.state.tables import TableStateStore
from local.direct_callback import DirectImdsCallback
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.runs import folder_coordinator, table_coordinator

NAMES = ("WestNO_0", "WestNO_1")

# Ways to spoil an envelope that carries an approve-at-once (User) event; each must be refused.
SPOILERS: dict[str, Any] = {
    "schema-v2": lambda e: {**e, "schema": "scheduled-events.envelope/2"},
    "naive-time": lambda e: {**e, "observedAt": datetime(2022, 4, 11, 22, 0).isoformat()},
    "negative-sequence": lambda e: {**e, "sequence": -1},
    "no-document": lambda e: {k: v for k, v in e.items() if k != "document"},
    "bad-status": lambda e: {
        **e,
        "document": {**e["document"], "Events": [{**e["document"]["Events"][0], "EventStatus": "Approved"}]},
    },
    "empty-event-id": lambda e: {
        **e,
        "document": {**e["document"], "Events": [{**e["document"]["Events"][0], "EventId": ""}]},
    },
    "vm-without-id": lambda e: {**e, "vm": {**e["vm"], "vmId": ""}},
    "incarnation-text": lambda e: {**e, "document": {**e["document"], "DocumentIncarnation": "two"}},
}

garbage = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=12,
    ).map(lambda value: json.dumps(value).encode()),
    st.sampled_from(sorted(SPOILERS)),
)


def test_garbage_among_good_envelopes(azurite, imds, tmp_path):
    table = "hostile" + uuid.uuid4().hex[:10]
    coordinator, history = table_coordinator(
        azurite, imds, table, tmp_path / "cards", lambda: DOC_NOW, policy=load_policy(DEFAULT_POLICY_PATH)
    )
    store = coordinator.parts.store
    approvals_before = len(imds.approvals())
    totals = {"bad": 0, "good": 0}
    sequence = iter(range(1, 1_000_000))

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(bad=st.lists(garbage, min_size=1, max_size=6), good_count=st.integers(min_value=1, max_value=4))
    def run(bad: list[Any], good_count: int) -> None:
        messages: list[RawMessage] = []
        good_ids = []
        for item in bad:
            if isinstance(item, str):
                # A User event would be approved at once if it got through: it must not.
                user = scheduled_event(str(uuid.uuid4()).upper(), source="User", event_type="Reboot")
                spoiled = SPOILERS[item](envelope(vm("WestNO_0", index=1), sequence=1, incarnation=9, events=[user]))
                body = json.dumps(spoiled).encode()
            else:
                body = item
            messages.append(RawMessage(body=body, partition_key=None))
        for _ in range(good_count):
            event_id = "GOOD-" + uuid.uuid4().hex
            good_ids.append(event_id)
            reboot = scheduled_event(event_id, event_type="Reboot", duration=-1)
            data = envelope(vm("WestNO_1", index=2), sequence=next(sequence), incarnation=3, events=[reboot])
            messages.append(RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower()))
        report = coordinator.process_batch(messages)
        assert report.dead_lettered == len(bad)
        assert report.accepted == good_count
        totals["bad"] += len(bad)
        totals["good"] += good_count
        # Nothing lost: the last good document lists its event (earlier good ones are gone for the VM: each
        # document replaces the previous one).
        assert store.get_event(good_ids[-1]) is not None

    run()
    assert len(store.dead_letters()) == totals["bad"]
    assert len([r for r in history.rows if r.RecordType == "DeadLetter"]) == totals["bad"]
    assert len(imds.approvals()) == approvals_before  # nothing approved on the strength of a refused message
    assert all(r.Outcome != "approve" for r in history.rows if r.RecordType == "Decision")


def _good(name: str, index: int, sequence: int, event_id: str) -> RawMessage:
    """A user-initiated Reboot (approved at once by the default policy) from a well-behaved VM, as its IMDS shows it
    (a user's Reboot has no duration: -1)."""
    event = scheduled_event(event_id, source="User", event_type="Reboot", resources=[name], duration=-1)
    data = envelope(vm(name, index=index), sequence=sequence, incarnation=2, events=[event])
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def _bad(name: str, index: int, spoil: Any) -> RawMessage:
    event = scheduled_event("HOSTILE-" + uuid.uuid4().hex, source="User", event_type="Reboot", resources=[name])
    data = spoil(envelope(vm(name, index=index), sequence=1, incarnation=2, events=[event]))
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def _event(data: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**data, "document": {**data["document"], "Events": [{**data["document"]["Events"][0], **fields}]}}


# Each is one VM's message; each must cost nothing to the good VMs of the same batch.
HOSTILE: dict[str, Any] = {
    "sequence-beyond-64-bits": lambda d: {**d, "sequence": 2**70},
    "incarnation-beyond-64-bits": lambda d: {**d, "document": {**d["document"], "DocumentIncarnation": 2**64}},
    "duration-beyond-64-bits": lambda d: _event(d, DurationInSeconds=2**63),
    "observed-year-1": lambda d: {**d, "observedAt": "0001-01-01T00:00:00+00:00"},
    "observed-year-9999": lambda d: {**d, "observedAt": "9999-12-31T23:59:59+00:00"},
    "not-before-year-1-east": lambda d: _event(d, NotBefore="Mon, 01 Jan 0001 00:30:00 +0100"),
    "not-before-year-9999-west": lambda d: _event(d, NotBefore="Fri, 31 Dec 9999 23:59:59 -0100"),
    "not-before-without-zone": lambda d: _event(d, NotBefore="Mon, 11 Apr 2022 22:26:58 -0000"),
    "very-long-resource": lambda d: _event(d, Resources=["x" * 100_000]),
    "very-long-placement-group": lambda d: {**d, "vm": {**d["vm"], "placementGroupId": "p" * 50_000}},
    "many-events": lambda d: {
        **d,
        "document": {
            **d["document"],
            "Events": [{**d["document"]["Events"][0], "EventId": f"MANY-{i}"} for i in range(500)],
        },
    },
    "unknown-large-fields": lambda d: {
        **d,
        "extra": "y" * 400_000,
        "vm": {**d["vm"], "blob": "z" * 200_000},
        "document": {**d["document"], "more": list(range(10_000))},
    },
}


def test_one_bad_message_costs_no_other_vm_anything(azurite, imds, tmp_path):
    table = "c" + uuid.uuid4().hex[:12]
    coordinator, history = table_coordinator(
        azurite, imds, table, tmp_path / "cards", lambda: DOC_NOW, policy=load_policy(DEFAULT_POLICY_PATH)
    )
    store = coordinator.parts.store
    good_ids = [imds.create_event(EventType="Reboot", EventSource="User", Resources=[n])["EventId"] for n in NAMES]
    oversized = b"{" + b"\xff" * 300_000  # malformed and far larger than a table property
    messages = [RawMessage(body=oversized, partition_key=None), _good(NAMES[0], 1, 7, good_ids[0])]
    for index, spoil in enumerate(HOSTILE.values()):
        messages.append(_bad(f"hostile_{index}", 1000 + index, spoil))
    messages.append(_good(NAMES[1], 2, 7, good_ids[1]))

    report = coordinator.process_batch(messages)

    for event_id, name in zip(good_ids, NAMES, strict=True):
        stored = coordinator.event(event_id)
        assert stored is not None
        assert stored.record.state == "Approved"
        assert [a["vm"] for a in imds.approvals() if a["EventId"] == event_id] == [name]
        rows = {r.RecordType for r in history.rows if r.EventId == event_id}
        assert {"Observation", "Decision", "Approval", "Transition"} <= rows
    # Refused at the door, each with a reason, none approved; the zone-less and unrepresentable NotBefores are
    # accepted (the event is kept, without a NotBefore it could not hold).
    accepted = {
        "not-before-year-1-east",
        "not-before-year-9999-west",
        "not-before-without-zone",
        "unknown-large-fields",
    }
    assert report.dead_lettered == 1 + len(HOSTILE) - len(accepted)
    letters = store.dead_letters()
    assert len(letters) == report.dead_lettered
    for letter in letters:
        assert len(letter["BodyBase64"]) <= 32 * 1024  # one property: 64 KiB of UTF-16
        assert sum(len(str(v)) for v in letter.values()) < 1024 * 1024
        assert len(letter["BodySha256"]) == 64
    big = next(letter for letter in letters if letter["BodyBytes"] == len(oversized))
    assert big["BodySha256"] == hashlib.sha256(oversized).hexdigest()
    reasons = " | ".join(str(letter["Reason"]) for letter in letters)
    for needle in ("sequence", "DocumentIncarnation", "DurationInSeconds", "observedAt", "resource name", "events"):
        assert needle in reasons
    # The hostile VM with odd NotBefores: no exception, no approval outside what its rule says.
    coordinator.tick()


class _SlowFor:
    """Delivers through the IMDS emulator, except that one VM's listener never answers in time."""

    def __init__(self, inner: DirectImdsCallback, slow_vm: str) -> None:
        self.inner = inner
        self.slow_vm = slow_vm
        self.release = threading.Event()

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        if vm.name == self.slow_vm:
            self.release.wait(10)
            raise ApprovalDeliveryError("listener gone")
        return self.inner.send(request, vm=vm)


def test_a_slow_listener_holds_up_nothing_else(azurite, imds, tmp_path):
    callback = _SlowFor(DirectImdsCallback(base_url=imds.url), NAMES[0])
    coordinator = folder_coordinator(
        tmp_path / "cards",
        store=TableStateStore.from_connection_string(azurite.connection_string, table_name="l" + uuid.uuid4().hex[:12]),
        history=MemoryHistory(),
        callback=callback,
        clock=lambda: DOC_NOW,
        approval_deadline=timedelta(seconds=0.5),
    )
    ids = [imds.create_event(EventType="Reboot", EventSource="User", Resources=[n])["EventId"] for n in NAMES]
    started = time.monotonic()
    try:
        coordinator.process_batch([_good(NAMES[0], 1, 1, ids[0]), _good(NAMES[1], 2, 1, ids[1])])
        elapsed = time.monotonic() - started
    finally:
        callback.release.set()
    assert elapsed < 3
    fast = coordinator.event(ids[1])
    slow = coordinator.event(ids[0])
    assert fast is not None
    assert fast.record.state == "Approved"
    assert slow is not None
    assert slow.record.state == "Scheduled"
    assert slow.record.approval is not None
    assert "WestNO_0's listener did not answer within 0.5 s" in slow.record.approval.reason


class _DiesAfterSending:
    """Sends, then the process dies before the outcome is recorded."""

    def __init__(self, inner: DirectImdsCallback) -> None:
        self.inner = inner

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.inner.send(request, vm=vm)
        raise KeyboardInterrupt  # stands for the process being killed


def test_a_coordinator_that_dies_after_sending_is_reconciled_by_the_timer_with_its_history(azurite, imds, tmp_path):
    table = "k" + uuid.uuid4().hex[:12]
    history = MemoryHistory()

    def build(callback: Any, now: datetime) -> Coordinator:
        return folder_coordinator(
            tmp_path / "cards",
            store=TableStateStore.from_connection_string(azurite.connection_string, table_name=table),
            history=history,
            callback=callback,
            clock=lambda: now,
        )

    event_id = imds.create_event(EventType="Reboot", EventSource="User", Resources=[NAMES[1]])["EventId"]
    dying = build(_DiesAfterSending(DirectImdsCallback(base_url=imds.url)), DOC_NOW)
    with pytest.raises(KeyboardInterrupt):
        dying.process_batch([_good(NAMES[1], 2, 1, event_id)])
    # The approval left right after the deciding write, which stored its Decision and intent rows in the outbox; the
    # history is written last, so none was written.
    assert [r for r in history.rows if r.EventId == event_id] == []
    kept = [
        (r.RecordType, r.Outcome) for entry in dying.parts.store.outbox() for r in entry.rows if r.EventId == event_id
    ]
    assert kept == [("Decision", "approve"), ("Approval", "sending")]
    assert len([a for a in imds.approvals() if a["EventId"] == event_id]) == 1
    # Event Hubs delivers the batch again (no checkpoint was written): the VM positions, which follow the send, are
    # written with the sighting's Observation row; the approval already decided is not decided or sent again.
    later = build(DirectImdsCallback(base_url=imds.url), DOC_NOW + timedelta(minutes=2))
    later.process_batch([_good(NAMES[1], 2, 1, event_id)])
    assert [r.RecordType for r in history.rows if r.EventId == event_id] == ["Observation"]
    assert len([a for a in imds.approvals() if a["EventId"] == event_id]) == 1
    # The timer writes the rows the dying batch kept, at the time they were made; the approval record is durable and
    # has no outcome, so it is unknown, sent again with the same decisionId and the outcome written.
    later.tick()
    rows = [r for r in history.rows if r.EventId == event_id]
    assert len({r.RecordId for r in rows}) == len(rows)  # none twice
    assert [(r.RecordType, r.Outcome, r.TimeGenerated) for r in rows if r.TimeGenerated == DOC_NOW] == [
        ("Decision", "approve", DOC_NOW),
        ("Approval", "sending", DOC_NOW),
    ]
    outcomes = [r.Outcome for r in rows if r.RecordType == "Approval" and r.TimeGenerated > DOC_NOW]
    assert outcomes[0] == "unknown"
    assert outcomes[-1] in ("approved", "not-scheduled")
    assert later.parts.store.outbox() == []
    stored = later.event(event_id)
    assert stored is not None
    assert stored.record.approval is not None
    assert stored.record.approval.attempts == 1
