"""The state machine without I/O: per-VM ordering, merging across VMs, gone/Completed/Canceled, Expired."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from contracts.envelope import Envelope
from coordinator.domain.approvals import choose_executor, start_overdue
from coordinator.domain.deletes import leaving_vms
from coordinator.domain.event_merge import apply_observations
from coordinator.domain.lifecycle import EventChange, advance, clone
from coordinator.domain.model import ApprovalRecord, EventRecord, PlatformHold, VmRecord
from coordinator.domain.observations import VmUpdate, state_tag, vm_observations
from tests.coordinator.helpers import DOC_EVENT_ID, DOC_NOW, documented_example, envelope, scheduled_event, vm


def envelopes(items: list[dict[str, Any]]) -> list[Envelope]:
    return [Envelope.model_validate(e) for e in items]


def observe(previous: VmRecord | None, items: list[Envelope]) -> VmUpdate:
    """A VM's envelopes as a batch reads them, each heard when its VM says it observed it (a clock in sync)."""
    return vm_observations(previous, items, heard_at=[e.observedAt for e in items])


def run(
    items: list[dict[str, Any]],
    now: datetime = DOC_NOW,
    vm_records: dict[str, VmRecord] | None = None,
    record: EventRecord | None = None,
) -> tuple[Any, dict[str, VmRecord]]:
    """Feeds envelopes VM by VM through the pure functions, as the service does per batch."""
    vm_records = dict(vm_records or {})
    by_vm: dict[str, list[Envelope]] = {}
    for e in envelopes(items):
        by_vm.setdefault(e.vm.vmId, []).append(e)
    observations = []
    for vm_id, group in by_vm.items():
        update = observe(vm_records.get(vm_id), group)
        vm_records[vm_id] = update.record
        observations += update.observations
    change = apply_observations(record, [o for o in observations if o.event_id == DOC_EVENT_ID], now)
    return change, vm_records


def test_documented_example_ends_as_one_completed_event():
    change, vms = run(documented_example(), now=DOC_NOW + timedelta(minutes=3))
    assert change is not None
    record = change.record
    assert record.state == "Completed"
    assert sorted(record.vms) == ["WestNO_0", "WestNO_1"]
    assert {s.status for s in record.vms.values()} == {"Gone"}
    transitions = [(r.PreviousState, r.State) for r in change.rows if r.RecordType == "Transition"]
    assert transitions == [("Scheduled", "Started"), ("Started", "Completed")]
    observations = [
        (r.VmName, r.EventStatus, r.DocumentIncarnation) for r in change.rows if r.RecordType == "Observation"
    ]
    assert len(observations) == 6  # two VMs x (Scheduled, Started, Gone)
    assert change.alerts == ["new-event"]
    assert all(v.lastSequence == 13 and v.lastIncarnation == 4 and v.listed == [] for v in vms.values())


def test_duplicates_and_stale_envelopes_change_nothing():
    items = documented_example()
    first, vms = run(items[:2] + items[4:6])  # both VMs: incarnations 1 and 2
    again, _ = run(items[:2] + items[4:6], vm_records=vms, record=first.record)
    assert again is not None
    assert not again.changed
    assert again.rows == []
    # The record itself also ignores an envelope it already holds (a replay after a crash before the VM write).
    replay, _ = run(items[1:2], record=first.record)
    assert not replay.changed
    # Out of order: incarnation 3 (Started) seen before a late incarnation 2 of the same VM.
    started, vms2 = run(items[2:3])
    assert started.record.state == "Started"
    late = observe(vms2[items[2]["vm"]["vmId"]], envelopes(items[1:2]))
    assert late.duplicates == 1
    assert late.observations == []


def test_started_without_notice_and_gone_from_the_vms_that_report_again():
    wnO, wn1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    hw = scheduled_event(event_type="Reboot", status="Started", duration=-1)
    change, vms = run(
        [envelope(wnO, sequence=1, incarnation=7, events=[hw]), envelope(wn1, sequence=1, incarnation=3, events=[hw])]
    )
    assert change.record.state == "Started"
    assert change.alerts == ["started-without-notice"]
    assert "appeared directly as Started" in next(r.Reason for r in change.rows if r.RecordType == "Transition")
    # WestNO_0 comes back with an empty document; WestNO_1 never reports again (its forwarder died).
    gone, _ = run([envelope(wnO, sequence=2, incarnation=8, events=[])], vm_records=vms, record=change.record)
    assert gone.record.state == "Started"
    advance(gone, DOC_NOW, silent_vms=frozenset({"WestNO_1"}))
    assert gone.record.state == "Completed"


def test_canceled_when_gone_without_starting_and_expired_when_not_before_passes():
    items = documented_example()
    scheduled, vms = run(items[:2] + items[4:6])
    assert scheduled.record.state == "Scheduled"
    later = DOC_NOW + timedelta(minutes=16)  # NotBefore 22:26:58 passed, nobody approved
    advance(scheduled, later)
    assert scheduled.record.state == "Expired"
    assert "expired" in scheduled.alerts
    canceled, _ = run([items[3], items[7]], vm_records=vms, record=scheduled.record, now=later)
    assert canceled.record.state == "Canceled"
    assert "canceled" in canceled.alerts


def test_first_seen_started_after_not_before_unapproved_cards_it_as_expired_as_a_tick_would_have():
    """Whether a run sees the event Expired before its Started sighting depends only on the timer's and the VM's
    timing (the failing-hook scenario one run in four): people get the same card either way."""
    items = documented_example()
    scheduled, vms = run(items[:2])
    identity = items[0]["vm"]
    after = DOC_NOW + timedelta(minutes=16)  # NotBefore 22:26:58 passed, nobody approved, no tick in between
    started = envelope(
        identity, sequence=12, incarnation=3, events=[scheduled_event(status="Started")], observed_at=after
    )
    went, _ = run([started], vm_records=vms, record=scheduled.record, now=after)
    assert went.record.state == "Started"
    assert "expired" in went.alerts
    # Seen Started before its NotBefore without an approval from here: approved elsewhere, not expired.
    early, _ = run(items[:3], now=DOC_NOW + timedelta(minutes=1))
    assert early.record.state == "Started"
    assert "expired" not in early.alerts
    # An approval awaiting its answer may be what started it: not expired either.
    pending, vms = run(items[:2])
    pending.record.approval = ApprovalRecord(
        decisionId="d-1", rule="r", actor="rule:r", decidedAt=DOC_NOW, executor="WestNO_0", outcome=""
    )
    went_pending, _ = run([started], vm_records=vms, record=pending.record, now=after)
    assert went_pending.record.state == "Started"
    assert "expired" not in went_pending.alerts


def test_hook_reports_are_recorded_once_per_vm():
    items = documented_example()
    scheduled, vms = run(items[:2])
    identity = items[0]["vm"]
    hook = {"eventId": DOC_EVENT_ID, "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.5, "exitCode": 0}
    hooked, vms = run(
        [envelope(identity, sequence=20, kind="hook", hook=hook)], vm_records=vms, record=scheduled.record
    )
    assert hooked.record.vms["WestNO_0"].hooks == {"prepare": "succeeded"}
    assert [r.RecordType for r in hooked.rows] == ["Hook"]
    replay = apply_observations(hooked.record, [], DOC_NOW)
    assert replay is not None
    assert not replay.changed


def test_impact_reports_keep_each_vms_longest_through_later_sightings_and_card_the_completion():
    items = documented_example()
    scheduled, vms = run(items[:2])
    identity = items[0]["vm"]

    def impact(sequence: int, seconds: float) -> dict[str, Any]:
        report = {
            "eventId": DOC_EVENT_ID,
            "eventType": "Freeze",
            "measure": "pause",
            "announcedSeconds": 5,
            "measuredSeconds": seconds,
            "start": DOC_NOW.isoformat(),
            "end": (DOC_NOW + timedelta(seconds=seconds)).isoformat(),
            "clock": "monotonic",
        }
        return {**envelope(identity, sequence=sequence, kind="impact"), "impact": report}

    measured, vms = run([impact(20, 1.0), impact(21, 4.0), impact(22, 2.0)], vm_records=vms, record=scheduled.record)
    assert measured is not None
    sighting = measured.record.vms["WestNO_0"]
    assert (sighting.impactSeconds, sighting.impactMeasure) == (4.0, "pause")
    rows = [r for r in measured.rows if r.RecordType == "Impact"]
    assert [(r.VmName, r.MeasuredSeconds, r.DurationInSeconds, r.ImpactMeasure, r.Actor) for r in rows] == [
        ("WestNO_0", 1.0, scheduled.record.durationInSeconds, "pause", "forwarder"),
        ("WestNO_0", 4.0, scheduled.record.durationInSeconds, "pause", "forwarder"),
    ]
    # The rest of the example (Started, then gone from both VMs): the sighting keeps its measure, and the completion
    # raises the card that shows it.
    later = [{**e, "sequence": e["sequence"] + 30} for e in items[2:]]
    completed, _ = run(later, now=DOC_NOW + timedelta(minutes=3), vm_records=vms, record=measured.record)
    assert completed is not None
    assert completed.record.state == "Completed"
    assert completed.record.vms["WestNO_0"].impactSeconds == 4.0
    assert completed.alerts == ["completed"]


def test_leader_is_the_first_live_vm_in_resources():
    change, _ = run(documented_example()[1:2] + documented_example()[5:6])
    record = change.record
    seen = {"WestNO_0": DOC_NOW, "WestNO_1": DOC_NOW}
    leader = choose_executor(record, seen, DOC_NOW - timedelta(minutes=5))
    assert leader is not None
    assert leader.name == "WestNO_0"
    seen["WestNO_0"] = DOC_NOW - timedelta(hours=1)
    fallback = choose_executor(record, seen, DOC_NOW - timedelta(minutes=5))
    assert fallback is not None
    assert fallback.name == "WestNO_1"
    seen["WestNO_1"] = DOC_NOW - timedelta(hours=1)
    assert choose_executor(record, seen, DOC_NOW - timedelta(minutes=5)) is None


def _executor(
    *,
    avoid: frozenset[str] | set[str] = frozenset(),
    busy: frozenset[str] | set[str] = frozenset(),
    terminate: bool = False,
) -> str | None:
    """Who executes the documented two-VM Reboot (WestNO_0 leads; both reported just now), or its Terminate."""
    change, _ = run(documented_example()[1:2] + documented_example()[5:6])
    record = change.record
    if terminate:
        record = record.model_copy(update={"eventType": "Terminate", "resources": ["WestNO_0"]})
    seen = {"WestNO_0": DOC_NOW, "WestNO_1": DOC_NOW}
    chosen = choose_executor(record, seen, DOC_NOW - timedelta(minutes=5), avoid=frozenset(avoid), busy=frozenset(busy))
    return chosen.name if chosen is not None else None


def test_an_executor_whose_listener_did_not_answer_is_passed_over_for_a_peer_never_for_a_terminate():
    """The executing VM died (its listener gone): the approval goes through a peer that can execute it at the next
    attempt, not after the 5-minute heartbeat timeout (issue 22); a Terminate has no peer to go through."""
    assert _executor(avoid={"WestNO_0"}) == "WestNO_1"
    # Every VM that could execute it failed to answer: the leader again rather than nobody.
    assert _executor(avoid={"WestNO_0", "WestNO_1"}) == "WestNO_0"
    assert _executor(avoid={"WestNO_0"}, terminate=True) == "WestNO_0"


def test_a_vm_another_event_is_disrupting_executes_only_when_no_other_can():
    """The leader is being rebooted by another approved event: its listener goes away mid-request and the approval
    would wait for that request to lapse before a peer could take it over (oracle seed 970, where that was past
    NotBefore). A peer that is not disrupted goes first; the busy leader when it is the only one left."""
    assert _executor(busy={"WestNO_0"}) == "WestNO_1"
    assert _executor(busy={"WestNO_0", "WestNO_1"}) == "WestNO_0"
    # A VM that did not answer is passed over first: a busy one that may answer beats one that did not.
    assert _executor(avoid={"WestNO_1"}, busy={"WestNO_0"}) == "WestNO_0"
    assert _executor(busy={"WestNO_0"}, terminate=True) == "WestNO_0"


def test_a_terminate_is_never_executed_by_a_peer():
    change, _ = run(
        [
            envelope(
                vm("WestNO_1", index=2),
                sequence=1,
                incarnation=2,
                events=[scheduled_event(event_type="Terminate", resources=["WestNO_0"])],
            )
        ]
    )
    record = change.record
    assert choose_executor(record, {}, DOC_NOW - timedelta(minutes=5)) is None
    freeze = record.model_copy(update={"eventType": "Freeze"})
    executor = choose_executor(freeze, {}, DOC_NOW - timedelta(minutes=5))
    assert executor is not None
    assert executor.name == "WestNO_1"


def test_envelopes_are_read_in_arrival_order_and_a_new_state_restarts_the_position():
    identity = vm("WestNO_0", index=1)

    def item(state: str, sequence: int) -> dict[str, Any]:
        data = envelope(identity, sequence=sequence, incarnation=sequence, events=[])
        data["stateId"] = state
        return data

    first = observe(None, envelopes([item("a", 5), item("a", 6)]))
    assert (first.record.stateId, first.record.lastSequence, first.record.epoch) == ("a", 6, 0)
    # Arrival order: b's 1 and 2 (a forwarder that lost its state), a late delivery of a's 6 (dropped: a has left
    # it behind), b's 2 again (a duplicate).
    second = observe(first.record, envelopes([item("b", 1), item("b", 2), item("a", 6), item("b", 2)]))
    assert (second.applied, second.duplicates) == (2, 2)
    assert (second.record.stateId, second.record.lastSequence, second.record.epoch) == ("b", 2, 1)
    assert list(second.record.otherStates) == ["a"]
    assert second.record.otherStates["a"].lastSequence == 6
    assert [r.Outcome for r in second.rows] == ["reset"]
    assert not second.conflict
    # a speaks again with a sequence new for a: not a replay, a second writer. Heard at a's own position (a new
    # epoch, so its positions compare after b's), a conflict row and one alert; b is kept with its position.
    third = observe(second.record, envelopes([item("a", 7), item("b", 3), item("a", 8)]))
    assert (third.applied, third.duplicates) == (3, 0)
    assert (third.record.stateId, third.record.lastSequence, third.record.epoch) == ("a", 8, 4)
    assert third.record.otherStates["b"].lastSequence == 3
    assert [r.Outcome for r in third.rows] == ["conflict", "conflict", "conflict"]
    assert third.conflict
    assert third.record.stateConflict == sorted([state_tag("a"), state_tag("b")])
    # The same pair speaking again later is the same conflict: no new alert.
    fourth = observe(third.record, envelopes([item("b", 4)]))
    assert (fourth.applied, fourth.conflict) == (1, False)
    # No sequence under another state silences a: a forged state with a huge sequence is a new state; a's next
    # envelope is still heard.
    fifth = observe(fourth.record, envelopes([item("forged", 2**62), item("a", 9)]))
    assert (fifth.applied, fifth.duplicates) == (2, 0)
    assert (fifth.record.stateId, fifth.record.lastSequence) == ("a", 9)
    # Without a stateId (older forwarders), as before: by sequence.
    legacy = observe(None, envelopes([item("", 3), item("", 2), item("", 4)]))
    assert (legacy.applied, legacy.duplicates, legacy.record.lastSequence) == (2, 1, 4)


def test_a_sighting_that_contradicts_the_facts_is_kept_as_a_conflict_not_merged():
    w0, w1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    first, vms = run(
        [envelope(w0, sequence=1, incarnation=2, events=[scheduled_event(event_type="Reboot", duration=-1)])]
    )
    assert first is not None
    # Another VM (or a process sending as it) says the same EventId is a 5 s Freeze of itself alone, already Started.
    forged = scheduled_event(event_type="Freeze", duration=5, status="Started", resources=["WestNO_1"])
    item = envelope(w1, sequence=1, incarnation=2, events=[forged])
    change, vms = run([item], vm_records=vms, record=first.record)
    assert change is not None
    record = change.record
    assert (record.eventType, record.durationInSeconds, record.state) == ("Reboot", -1, "Scheduled")
    assert sorted(record.resources) == ["WestNO_0", "WestNO_1"]
    assert not record.everStarted
    assert "WestNO_1" not in record.vms, "the contradicting sighting is not merged as the VM's sighting"
    assert record.conflictCount == 1
    assert record.conflicts[0].vm == "WestNO_1"
    assert record.conflicts[0].facts == {
        "EventType": ("Reboot", "Freeze"),
        "DurationInSeconds": ("-1", "5"),
        "Resources": ("WestNO_0, WestNO_1", "WestNO_1"),
    }
    (row,) = [r for r in change.rows if r.Outcome == "conflict"]
    assert (row.RecordType, row.VmName, row.EventType) == ("Observation", "WestNO_1", "Reboot")
    assert "EventType 'Freeze' (recorded 'Reboot')" in row.Reason
    assert change.alerts == ["facts-conflict"]
    # The same envelope delivered again is the same conflict; a further one is counted, the card is not repeated.
    again = apply_observations(record, observe(None, envelopes([item])).observations, DOC_NOW)
    assert again is not None
    assert again.record.conflictCount == 1
    assert not again.alerts
    later = envelope(w1, sequence=2, incarnation=3, events=[forged])
    third = apply_observations(record, observe(vms[w1["vmId"]], envelopes([later])).observations, DOC_NOW)
    assert third is not None
    assert third.record.conflictCount == 2
    assert not third.alerts


def test_the_same_facts_in_another_notation_are_no_conflict():
    w0, w1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    first, vms = run([envelope(w0, sequence=1, incarnation=2, events=[scheduled_event()])])
    iso = scheduled_event(not_before="2022-04-11T22:26:58Z", resources=["WestNO_1", "WestNO_0"])
    change, _ = run([envelope(w1, sequence=1, incarnation=2, events=[iso])], vm_records=vms, record=first.record)
    assert change is not None
    assert change.record.conflictCount == 0
    assert sorted(change.record.vms) == ["WestNO_0", "WestNO_1"]


def test_a_retired_vm_does_not_conclude_an_event_its_other_vms_have_not_reported():
    w3 = vm("web_3", index=3)
    freeze = scheduled_event(resources=["web_0", "web_1"])
    change, _ = run([envelope(w3, sequence=1, incarnation=2, events=[freeze])])
    assert change is not None
    record = change.record
    # web_3 (a reporter, not named) was deleted; web_0 and web_1 have not reported yet (their envelopes held back).
    held = EventChange(record=clone(record))
    advance(held, DOC_NOW, retired={"web_3": "TERMINATE-1"})
    assert held.record.state == "Scheduled"
    # Once a VM the event names saw it leave, it is over.
    gone = clone(record)
    gone.vms["web_0"] = gone.vms["web_3"].model_copy(update={"name": "web_0", "status": "Gone"})
    over = EventChange(record=gone)
    advance(over, DOC_NOW, retired={"web_3": "TERMINATE-1"})
    assert over.record.state == "Canceled"


def test_the_timer_concludes_an_event_whose_only_reporter_was_deleted_once_its_named_vms_spoke_without_it():
    """The fleet demo's redeploy (fresh-clone CI run): web_1, a peer, reported a redeploy of web_0 and was deleted;
    web_0's poll was throttled (429) while the event lasted and its later documents never listed it. A batch waits
    (web_0's envelope listing it may still come); the timer concludes once every named VM has been heard since the
    event was first seen (a VM's envelopes arrive in order), and not before."""
    w1 = vm("web_1", index=2)
    redeploy = scheduled_event(resources=["web_0", "web_2"])
    change, _ = run([envelope(w1, sequence=1, incarnation=6, events=[redeploy])])
    assert change is not None
    record = change.record
    first_seen = record.vms["web_1"].firstSeen
    retired = {"web_1": "TERMINATE-1"}
    later, before = first_seen + timedelta(seconds=5), first_seen - timedelta(seconds=5)

    def advanced(heard: dict[str, datetime] | None, silent: frozenset[str] = frozenset()) -> EventRecord:
        held = EventChange(record=clone(record))
        advance(held, first_seen + timedelta(seconds=30), retired=retired, heard=heard, silent_vms=silent)
        return held.record

    assert advanced(None).state == "Scheduled"  # a batch does not know who was heard: the timer decides
    assert advanced({"web_0": later, "web_2": before}).state == "Scheduled"  # web_2 may still list it
    assert advanced({"web_0": later, "web_2": before}, silent=frozenset({"web_2"})).state == "Canceled"
    assert advanced({"web_0": later}).state == "Canceled"  # web_2 has no forwarder: it never lists it
    concluded = advanced({"web_0": later, "web_2": later})
    assert concluded.state == "Canceled"
    assert concluded.stateSince == first_seen + timedelta(seconds=30)


def test_no_approval_goes_through_a_vm_that_another_event_is_removing():
    w0, w1 = vm("web_0", index=1, scale_set="web"), vm("web_1", index=2, scale_set="web")
    freeze = scheduled_event(resources=["web_0", "web_1"])
    change, _ = run(
        [
            envelope(w0, sequence=1, incarnation=2, events=[freeze]),
            envelope(w1, sequence=1, incarnation=2, events=[freeze]),
        ]
    )
    assert change is not None
    seen = {"web_0": DOC_NOW, "web_1": DOC_NOW}
    executor = choose_executor(change.record, seen, DOC_NOW - timedelta(minutes=5))
    assert executor is not None
    assert executor.name == "web_0"
    delete = EventRecord(
        eventId="TERMINATE-1",
        eventType="Terminate",
        resources=["web_0"],
        stateSince=DOC_NOW,
        createdAt=DOC_NOW,
        notBefore=DOC_NOW + timedelta(minutes=5),
    )
    assert leaving_vms([delete], DOC_NOW) == {}  # pending: web_0 is still there
    # Decided but not yet delivered (the approvals of one batch go out together): web_0 may be gone before a
    # Freeze sent through it beside its delete is answered.
    delete.approval = ApprovalRecord(decisionId="d", rule="r", actor="rule:r", decidedAt=DOC_NOW)
    assert leaving_vms([delete], DOC_NOW) == {"web_0": "TERMINATE-1"}
    delete.approval.delivered = True
    leaving = leaving_vms([delete], DOC_NOW)
    assert leaving == {"web_0": "TERMINATE-1"}
    executor = choose_executor(change.record, seen, DOC_NOW - timedelta(minutes=5), leaving=leaving)
    assert executor is not None
    assert executor.name == "web_1"
    # The delete itself still goes through the VM it deletes.
    delete.vms = {"web_0": change.record.vms["web_0"]}
    executor = choose_executor(delete, seen, DOC_NOW - timedelta(minutes=5), leaving=leaving)
    assert executor is not None
    assert executor.name == "web_0"


def test_an_approval_not_followed_by_started_is_overdue_unless_held_or_removed():
    w0 = vm("web_0", index=1, scale_set="web")
    change, _ = run([envelope(w0, sequence=1, incarnation=2, events=[scheduled_event(resources=["web_0"])])])
    assert change is not None
    record = clone(change.record)
    record.state = "Approved"
    by = DOC_NOW + timedelta(minutes=5)
    record.approval = ApprovalRecord(
        decisionId="d", rule="r", actor="rule:r", decidedAt=DOC_NOW, delivered=True, outcome="approved", confirmBy=by
    )
    seen = {"web_0": by + timedelta(seconds=1)}
    assert not start_overdue(record, by - timedelta(seconds=1), seen)
    assert start_overdue(record, by, seen)
    record.platformHold = PlatformHold(eventId="other", since=DOC_NOW)
    assert not start_overdue(record, by, seen), "a delete the platform holds is not overdue"
    record.platformHold = None
    record.everStarted = True
    assert not start_overdue(record, by, seen)
    record.everStarted = False
    record.eventType = "Terminate"
    assert start_overdue(record, by, seen), "its VM still speaks after the deadline: not removed, not started"
    assert not start_overdue(record, by, {"web_0": by - timedelta(seconds=30)}), "silent: removed, not overdue"


def test_a_hook_report_counts_only_for_the_vm_whose_envelope_carried_it():
    w0, w1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    listed = [envelope(w, sequence=1, incarnation=2, events=[scheduled_event()]) for w in (w0, w1)]
    first, vms = run(listed)
    assert first is not None
    # web_1's envelope reports the event's prepare phase succeeded: it is web_1's phase, whatever it means to say.
    hook = {"eventId": DOC_EVENT_ID, "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.0, "steps": []}
    change, _ = run([envelope(w1, sequence=2, kind="hook", hook=hook)], vm_records=vms, record=first.record)
    assert change is not None
    assert change.record.vms["WestNO_1"].hooks == {"prepare": "succeeded"}
    assert change.record.vms["WestNO_0"].hooks == {}


def test_an_event_closed_by_a_forged_gone_opens_again_when_its_vm_lists_it():
    w0 = vm("WestNO_0", index=1)

    def item(state: str, sequence: int, events: list[dict[str, Any]]) -> dict[str, Any]:
        data = envelope(w0, sequence=sequence, incarnation=sequence, events=events)
        data["stateId"] = state
        return data

    first, vms = run([item("real", 1, [scheduled_event(resources=["WestNO_0"])])])
    assert first is not None
    # Another process sends as WestNO_0 under a state of its own, with an empty document: the event looks gone.
    forged, vms = run([item("forged", 2**62, [])], vm_records=vms, record=first.record)
    assert forged is not None
    assert forged.record.state == "Canceled"
    # WestNO_0's own forwarder reports it Started: opened again, then Started, not lost as Canceled.
    started = scheduled_event(resources=["WestNO_0"], status="Started")
    real, _ = run([item("real", 2, [started])], vm_records=vms, record=forged.record)
    assert real is not None
    assert real.record.state == "Started"
    transitions = [(r.PreviousState, r.State) for r in real.rows if r.RecordType == "Transition"]
    assert transitions == [("Canceled", "Scheduled"), ("Scheduled", "Started")]


def test_a_gone_counts_only_from_a_vm_the_event_names():
    """A peer of the placement group sees the event too, but its 'gone' does not conclude an event the VM it names
    still lists (issue 21 item 6)."""
    named, peer = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    freeze = scheduled_event(resources=["WestNO_0"])
    first, vms = run(
        [
            envelope(named, sequence=1, incarnation=2, events=[freeze]),
            envelope(peer, sequence=1, incarnation=2, events=[freeze]),
        ]
    )
    assert first is not None
    peer_gone, vms = run([envelope(peer, sequence=2, incarnation=3, events=[])], vm_records=vms, record=first.record)
    assert peer_gone is not None
    assert peer_gone.record.state == "Scheduled"
    named_gone, _ = run(
        [envelope(named, sequence=2, incarnation=3, events=[])], vm_records=vms, record=peer_gone.record
    )
    assert named_gone is not None
    assert named_gone.record.state == "Canceled"


def test_a_peers_gone_concludes_only_once_the_vm_it_names_cannot_still_list_it():
    """Only a peer has reported the event when the peer says 'gone' (the VM it names has a late forwarder, or none).
    A batch does not conclude it (it does not know who has a forwarder); the timer does once the named VM cannot
    still list it: no forwarder, fallen silent, or heard since the event was first seen without listing it. Its VM
    listing it later finds it open (it used to be Canceled by the peer, with its card, and opened again)."""
    named, peer = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    freeze = scheduled_event(resources=["WestNO_0"])
    first, vms = run([envelope(peer, sequence=1, incarnation=2, events=[freeze])])
    assert first is not None
    gone, vms = run([envelope(peer, sequence=2, incarnation=3, events=[])], vm_records=vms, record=first.record)
    assert gone is not None
    assert gone.record.state == "Scheduled"
    seen = gone.record.vms["WestNO_1"].firstSeen
    second = timedelta(seconds=1)

    def tick(heard: dict[str, datetime], silent: frozenset[str] = frozenset()) -> str:
        change = EventChange(record=clone(gone.record))
        advance(change, DOC_NOW + timedelta(seconds=30), silent_vms=silent, heard=heard)
        return change.record.state

    assert tick({"WestNO_0": seen - second, "WestNO_1": seen}) == "Scheduled"  # its listing may be on its way
    assert tick({"WestNO_1": seen}) == "Canceled"  # no forwarder on WestNO_0
    assert tick({"WestNO_0": seen + second, "WestNO_1": seen}) == "Canceled"  # heard since, not listing it
    assert tick({"WestNO_0": seen - second}, silent=frozenset({"WestNO_0"})) == "Canceled"
    listed, _ = run([envelope(named, sequence=1, incarnation=2, events=[freeze])], vm_records=vms, record=gone.record)
    assert listed is not None
    assert listed.record.state == "Scheduled"
    assert [r for r in listed.rows if r.RecordType == "Transition"] == []


def test_a_contradicting_sighting_behind_its_vms_newer_position_is_still_kept_as_a_conflict():
    """A process on a VM (its own attested identity, a forwarder state of its own) lies about a peer's event before
    the VM's real forwarder first speaks; both arrive in one batch. The real forwarder's state is the VM's newer
    position, yet said it earlier (observedAt): merged by time, the lie sits behind the VM's truthful sighting. It is
    still a contradiction of the facts, kept as a conflict with its row and card, never silently dropped."""
    w0, w1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    truth = scheduled_event(event_type="Reboot", duration=-1)
    first, vms = run([envelope(w0, sequence=1, incarnation=2, events=[truth])])
    assert first is not None
    lie = envelope(
        w1,
        sequence=2**62,
        incarnation=2,
        events=[{**truth, "EventSource": "User"}],
        observed_at=DOC_NOW + timedelta(seconds=2),
    )
    lie["stateId"] = "forged"
    honest = envelope(w1, sequence=1, incarnation=2, events=[truth], observed_at=DOC_NOW + timedelta(seconds=1))
    honest["stateId"] = "real"
    change, _ = run([lie, honest], vm_records=vms, record=first.record)
    assert change is not None
    record = change.record
    assert record.eventSource == "Platform"
    assert record.vms["WestNO_1"].epoch == 1, "the VM's sighting is its real forwarder's"
    assert record.conflictCount == 1
    assert record.conflicts[0].facts == {"EventSource": ("Platform", "User")}
    (row,) = [r for r in change.rows if r.Outcome == "conflict"]
    assert (row.RecordType, row.VmName) == ("Observation", "WestNO_1")
    assert change.alerts == ["facts-conflict"]
