"""The timer (coordinator/pipeline/timer.py): what no envelope triggers. Heartbeats lost (once), VMs a delete removed
retired, events expired, approvals retried and found not started, the hourly housekeeping; then the tail."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

from coordinator.domain.model import ApprovalRecord, Retirement
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline import timer
from coordinator.pipeline.housekeeping import Housekeeping
from coordinator.pipeline.run import Run
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.runs import NOT_BEFORE, Bench, MemoryDeliveries, identity, put_event, put_vm

TAIL = ["deliver", "cards", "budgets", "history"]


def tick(bench: Bench, at: datetime = DOC_NOW, housekeeping: Housekeeping | None = None) -> Run:
    bench.now = at
    run = bench.run("tick")
    timer.tick(run, housekeeping or Housekeeping())
    return run


def rows_of(run: Run, bench: Bench, record_type: str) -> list[tuple[str, str]]:
    """This tick's rows of one type (the history sink holds every tick's), as (VM or event, outcome)."""
    mine = bench.history.rows[-run.report.history_rows :] if run.report.history_rows else []
    return [(r.VmName or r.EventId, r.Outcome or r.State) for r in mine if r.RecordType == record_type]


def test_a_tick_takes_the_timer_stage_then_the_tail(bench: Bench):
    run = tick(bench)
    assert run.stages == ["timer", *TAIL]


def test_a_silent_vms_heartbeat_is_lost_once_with_one_card(bench: Bench):
    put_vm(bench.store, "WestNO_0", last_seen=DOC_NOW - timedelta(minutes=6))
    put_vm(bench.store, "WestNO_1", last_seen=DOC_NOW)
    # Known only from Event Grid: no heartbeat is expected of it.
    put_vm(bench.store, "EastNO_0", last_seen=DOC_NOW - timedelta(days=1), agentless=True)

    first = tick(bench)
    assert first.report.heartbeats_lost == 1
    assert rows_of(first, bench, "Heartbeat") == [("WestNO_0", "lost")]
    lost = bench.vm("WestNO_0")
    assert lost.heartbeatLost
    assert bench.alerts.keys == [f"{lost.identity.vmId}-heartbeat-lost-20220411T220558"]
    # Sent by this tick's own tail: out of the VM's outbox.
    assert lost.pendingAlerts == []

    again = tick(bench, DOC_NOW + timedelta(minutes=1))
    assert again.report.heartbeats_lost == 0
    assert rows_of(again, bench, "Heartbeat") == []
    assert len(bench.alerts.cards) == 1


def removed_by_delete(bench: Bench) -> None:
    """web_0's delete was seen Started; web_0 has been silent for 4 minutes (more than the retire grace, less
    than the heartbeat timeout); web_1 still reports."""
    put_event(
        bench.store,
        "EV-DEL",
        vms=("web_0",),
        scale_set="web",
        seen=DOC_NOW - timedelta(minutes=4),
        status="Started",
        eventType="Terminate",
        state="Started",
        everStarted=True,
        seenScheduled=True,
    )
    put_vm(bench.store, "web_1", scale_set="web", last_seen=DOC_NOW)


def test_a_vm_a_delete_removed_is_retired_and_its_event_concludes(bench: Bench):
    removed_by_delete(bench)
    run = tick(bench)
    assert run.report.vms_retired == 1
    retired = bench.vm("web_0", scale_set="web").retired
    assert isinstance(retired, Retirement)
    assert (retired.eventId, retired.eventType, retired.at) == ("EV-DEL", "Terminate", DOC_NOW)
    assert rows_of(run, bench, "Heartbeat") == [("web_0", "retired")]
    record = bench.event("EV-DEL")
    assert (record.state, record.removed) == ("Completed", ["web_0"])
    # Retired, not lost: when the other VM falls silent later, only it raises "heartbeat lost".
    later = tick(bench, DOC_NOW + timedelta(minutes=10))
    assert rows_of(later, bench, "Heartbeat") == [("web_1", "lost")]
    assert later.report.vms_retired == 0


def test_a_silent_vm_without_a_removing_event_is_not_retired(bench: Bench):
    put_event(bench.store, "EV-R", vms=("web_0",), scale_set="web", seen=DOC_NOW - timedelta(minutes=4))
    run = tick(bench)
    assert run.report.vms_retired == 0
    assert bench.vm("web_0", scale_set="web").retired is None


def test_an_event_past_not_before_without_approval_expires_with_its_card(bench: Bench):
    put_event(bench.store, "EV-R", vms=("WestNO_0",), notBefore=DOC_NOW - timedelta(seconds=1))
    run = tick(bench)
    assert (run.report.open_events, run.report.events_changed) == (1, 1)
    assert bench.event("EV-R").state == "Expired"
    assert ("EV-R", "Expired") in rows_of(run, bench, "Transition")
    assert "EV-R-expired" in bench.alerts.keys


def put_freeze(bench: Bench, **fields: Any) -> None:
    """EV-F, a 5-second Freeze of WestNO_0 not before NOT_BEFORE, as its batch left it (``fields`` add to it)."""
    put_event(bench.store, "EV-F", eventType="Freeze", durationInSeconds=5, notBefore=NOT_BEFORE, **fields)


def test_an_undecided_event_is_decided_and_its_approval_delivered(bench: Bench):
    # Its batch's decision failed (the rules could not be read then): the timer decides it.
    put_freeze(bench)
    run = tick(bench)
    assert bench.callback.vms == ["WestNO_0"]
    assert bench.event("EV-F").state == "Approved"
    assert run.report.approvals_sent == 1


def approval(**fields: Any) -> ApprovalRecord:
    base = {"decisionId": "d-1", "rule": "short-freeze", "actor": "rule:short-freeze", "decidedAt": DOC_NOW}
    return ApprovalRecord.model_validate({**base, **fields})


def test_an_approval_whose_sender_stopped_is_sent_again_when_due_and_not_before(bench: Bench):
    put_freeze(bench, approval=approval(nextAttemptAt=DOC_NOW + timedelta(seconds=90)))
    tick(bench, DOC_NOW + timedelta(seconds=60))
    assert bench.callback.sent == []

    run = tick(bench, DOC_NOW + timedelta(seconds=90))
    assert bench.callback.vms == ["WestNO_0"]
    # No outcome was ever recorded: a row says it is sent again with the same decisionId.
    assert [outcome for _, outcome in rows_of(run, bench, "Approval")] == ["unknown", "sending", "approved"]
    assert bench.event("EV-F").state == "Approved"


def test_an_approved_event_not_seen_started_in_time_raises_not_started_once(bench: Bench):
    put_freeze(
        bench,
        state="Approved",
        approval=approval(delivered=True, outcome="approved", executor="WestNO_0", confirmBy=DOC_NOW),
    )
    run = tick(bench, DOC_NOW + timedelta(seconds=1))
    assert [(r.Actor, r.Outcome) for r in bench.rows("Approval")] == [("platform", "not-started")]
    assert "EV-F-not-started" in bench.alerts.keys
    assert run.report.events_changed == 1
    tick(bench, DOC_NOW + timedelta(seconds=61))
    assert len(bench.rows("Approval")) == 1


def test_housekeeping_runs_on_the_first_tick_then_hourly(bench: Bench):
    calls: list[tuple[dict[str, datetime], datetime]] = []
    housekeeping = Housekeeping(cleanup=lambda seen, now: calls.append((seen, now)))
    put_vm(bench.store, "WestNO_0", last_seen=DOC_NOW)
    gone = Retirement(eventId="EV-DEL", eventType="Terminate", at=DOC_NOW)
    put_vm(bench.store, "WestNO_1", last_seen=DOC_NOW - timedelta(hours=2), retired=gone)

    tick(bench, DOC_NOW, housekeeping)
    tick(bench, DOC_NOW + timedelta(minutes=30), housekeeping)
    tick(bench, DOC_NOW + timedelta(minutes=59), housekeeping)
    assert [now for _, now in calls] == [DOC_NOW]
    # A retired VM is left out: its hybrid connection is one the fleet no longer needs.
    assert calls[0][0] == {identity("WestNO_0").hybrid_connection_name: DOC_NOW}

    tick(bench, DOC_NOW + timedelta(minutes=60), housekeeping)
    assert [now for _, now in calls] == [DOC_NOW, DOC_NOW + timedelta(minutes=60)]


def test_housekeeping_purges_concluded_events_past_the_retention(bench: Bench):
    old, recent = DOC_NOW - timedelta(days=31), DOC_NOW - timedelta(days=29)
    put_event(bench.store, "EV-OLD", state="Completed", stateSince=old, createdAt=old)
    put_event(bench.store, "EV-RECENT", state="Canceled", stateSince=recent, createdAt=recent)
    run = tick(bench)
    assert run.report.events_purged == 1
    assert bench.store.get_event("EV-OLD") is None
    assert bench.store.get_event("EV-RECENT") is not None


def test_a_failing_cleanup_does_not_stop_the_tick(bench: Bench):
    def cleanup(seen: dict[str, datetime], now: datetime) -> None:
        raise RuntimeError("ARM unreachable")

    put_event(bench.store, "EV-R", notBefore=DOC_NOW - timedelta(seconds=1))
    run = tick(bench, housekeeping=Housekeeping(cleanup=cleanup))
    assert run.stages == ["timer", *TAIL]
    assert bench.event("EV-R").state == "Expired"


def test_a_tick_waits_for_no_absent_listener_and_leaves_the_handed_over_approval_to_the_queue(bench: Bench):
    """Every tick waited ~30 s for one absent listener (issue 22): now it gives the retry in_run_delivery, hands it
    to the delivery queue, and the ticks within the handover grace do not send it again."""
    bench.deliveries = MemoryDeliveries()
    bench.callback.hold = threading.Event()  # WestNO_0's listener does not answer
    bench.options = {"in_run_delivery": timedelta(milliseconds=200)}
    put_freeze(bench, approval=approval(attempts=1, outcome="failed", nextAttemptAt=DOC_NOW))
    try:
        started = time.monotonic()
        run = tick(bench)
        held = time.monotonic() - started
        assert held < 1.5, f"the tick waited {held:.1f} s for an absent listener"
        assert bench.callback.vms == ["WestNO_0"]
        assert run.report.deliveries_continued == 1
        assert [d.eventId for d in bench.deliveries.queued] == ["EV-F"]
        tick(bench, DOC_NOW + timedelta(seconds=60))
        assert bench.callback.vms == ["WestNO_0"], "sent again while the queue has it"
    finally:
        bench.callback.hold.set()


def test_an_approval_the_timer_decides_is_sent_through_a_vm_it_hears_by_its_heartbeats(bench: Bench):
    """The tick plans an approval it decides before its write (its intent committed with it), by when it last heard
    each VM (heartbeats count), as it judges every VM: WestNO_0 listed the Reboot 19 minutes ago, heartbeats since."""
    bench.policy = parse_policy(
        """
version: 1
blackouts:
  - {name: nightly, schedule: "0 22 * * *", duration: 30m, timeZone: UTC}
rules:
  - {name: reboots, match: {eventType: [Reboot]}, action: approve-now}
"""
    )
    put_event(bench.store, "EV-R", vms=("WestNO_0",), notBefore=DOC_NOW + timedelta(hours=1))
    after = DOC_NOW.replace(minute=31, second=0)  # the blackout over (22:00-22:30)
    put_vm(bench.store, "WestNO_0", last_seen=after - timedelta(seconds=20))
    tick(bench, after)
    assert bench.callback.vms == ["WestNO_0"]
    assert [(r.RecordType, r.Outcome) for r in bench.rows("Approval")] == [
        ("Approval", "sending"),
        ("Approval", "approved"),
    ]


def test_a_peers_gone_concludes_at_the_tick_once_the_named_vm_was_heard_without_listing_it(bench: Bench):
    """WestNO_1, a peer, reported WestNO_0's Reboot and then its leaving; WestNO_0 has a forwarder. Until WestNO_0
    is heard after the event was first seen (its envelope listing the event may be on its way) the tick leaves it
    open; once heard without listing it, the tick concludes it."""
    put_vm(bench.store, "WestNO_0", last_seen=DOC_NOW - timedelta(seconds=10))
    put_event(bench.store, "EV-PEER", vms=["WestNO_1"], status="Gone", resources=["WestNO_0"])
    tick(bench, DOC_NOW + timedelta(seconds=30))
    assert bench.event("EV-PEER").state == "Scheduled"
    put_vm(bench.store, "WestNO_0", last_seen=DOC_NOW + timedelta(seconds=20))
    tick(bench, DOC_NOW + timedelta(seconds=40))
    assert bench.event("EV-PEER").state == "Canceled"


def test_a_peers_gone_concludes_at_the_tick_when_the_named_vm_has_no_forwarder(bench: Bench):
    put_event(bench.store, "EV-PEER", vms=["WestNO_1"], status="Gone", resources=["WestNO_0"])
    tick(bench, DOC_NOW + timedelta(seconds=30))
    assert bench.event("EV-PEER").state == "Canceled"
