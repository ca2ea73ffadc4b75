"""The people's routes (coordinator/pipeline/people.py): a person's approval of one event (not found, conflict,
already approved, approved, sent, dry-run) ending with the tail, and the open events as the endpoints show them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.domain.model import PlatformHold
from coordinator.pipeline import people
from coordinator.pipeline.run import Run
from tests.coordinator.helpers import DOC_NOW, approval_record, decision_record, event_record
from tests.coordinator.runs import NOT_BEFORE, Bench, put_event, put_vm

TAIL = ["deliver", "cards", "budgets", "history"]
PERSON = "ops@example.com"


def waiting_reboot(bench: Bench, event_id: str = "EV-R", **fields: Any) -> None:
    # The default policy: a Reboot waits for a person.
    put_event(bench.store, event_id, vms=("WestNO_0",), **{"notBefore": NOT_BEFORE, **fields})


def approve(bench: Bench, event_id: str = "EV-R", **options: object) -> tuple[people.ManualApproval, Run]:
    run = bench.run("person", **options)
    return people.approve_manually(run, event_id, person=PERSON), run


def test_an_unknown_event_is_not_found_and_nothing_runs(bench: Bench):
    result, run = approve(bench, "EV-NOBODY")
    assert (result.status, result.message) == ("not-found", "no event 'EV-NOBODY' is known")
    assert run.stages == ["person"]


def test_only_a_scheduled_event_can_be_approved(bench: Bench):
    waiting_reboot(bench, state="Started")
    result, _ = approve(bench)
    assert (result.status, result.message) == ("conflict", "event EV-R is Started; only Scheduled can be approved")
    assert bench.callback.sent == []


def test_an_event_already_approved_is_not_sent_again(bench: Bench):
    earlier = approval_record(delivered=True)
    waiting_reboot(bench, approval=earlier)
    result, _ = approve(bench)
    assert result.status == "already-approved"
    assert result.message.startswith("event EV-R is already approved by rule:r at ")
    assert result.message.endswith("nothing more is sent")
    assert bench.callback.sent == []


def test_an_event_being_approved_is_not_decided_again(bench: Bench):
    # A rule's approval on its way (not yet delivered): a person's click must not make a second decision, whose new
    # decisionId the VM's listener would not recognise as the first.
    earlier = approval_record(attempts=1, outcome="failed")
    waiting_reboot(bench, approval=earlier)
    result, _ = approve(bench)
    assert result.status == "already-approved"
    assert "being delivered: attempt 1 answered failed" in result.message
    assert bench.callback.sent == []
    assert bench.rows("Decision") == []


def test_a_persons_approval_is_decided_delivered_and_recorded_through_the_tail(bench: Bench):
    waiting_reboot(bench)
    result, run = approve(bench)
    assert (result.status, result.message) == ("approved", f"event EV-R approved by {PERSON}")
    assert run.stages == ["person", *TAIL]
    assert bench.callback.vms == ["WestNO_0"]
    record = bench.event("EV-R")
    assert record.state == "Approved"
    assert record.decision is not None
    assert record.approval is not None
    assert (record.decision.rule, record.decision.actor) == ("manual", f"person:{PERSON}")
    assert record.approval.decisionId == record.decision.decisionId
    assert [(r.RecordType, r.Actor) for r in bench.rows("Decision")] == [("Decision", f"person:{PERSON}")]
    assert result.event is not None
    assert (result.event["state"], result.event["approval"]["actor"]) == ("Approved", f"person:{PERSON}")
    assert run.report.as_dict()["events_changed"] == 1


def test_a_listener_that_cannot_be_reached_leaves_the_approval_to_be_retried(bench: Bench):
    waiting_reboot(bench)
    bench.callback.error = ApprovalDeliveryError("nobody listening")
    result, _ = approve(bench)
    assert (result.status, result.message) == ("sent", "approval of EV-R decided; delivery is retried until NotBefore")
    approval = bench.event("EV-R").approval
    assert approval is not None
    assert approval.nextAttemptAt is not None
    assert not approval.delivered


def test_in_dry_run_the_persons_decision_is_recorded_and_nothing_sent(bench: Bench):
    waiting_reboot(bench)
    result, run = approve(bench, dry_run=True)
    assert (result.status, result.message) == (
        "dry-run",
        f"dry run: {PERSON}'s approval of EV-R recorded, nothing sent",
    )
    assert bench.callback.sent == []
    record = bench.event("EV-R")
    assert record.decision is not None
    assert record.decision.dryRun
    assert record.approval is None
    assert [r.DryRun for r in bench.rows("Decision")] == [True]
    assert run.stages == ["person", *TAIL]


def test_the_approve_link_is_in_the_summary(bench: Bench):
    waiting_reboot(bench)
    result, _ = approve(bench, approve_url=lambda event_id: f"https://app.example/api/events/{event_id}/approve")
    assert result.event is not None
    assert result.event["approveUrl"] == "https://app.example/api/events/EV-R/approve"


def test_pending_lists_open_events_closest_to_not_before_first(bench: Bench):
    waiting_reboot(bench, "EV-LATE", notBefore=NOT_BEFORE + timedelta(minutes=5))
    waiting_reboot(bench, "EV-SOON")
    waiting_reboot(bench, "EV-UNKNOWN-NB", notBefore=None)
    waiting_reboot(bench, "EV-DONE", state="Completed")
    listed = people.pending(bench.store, approve_url=None)
    assert [e["eventId"] for e in listed] == ["EV-SOON", "EV-LATE", "EV-UNKNOWN-NB"]
    assert listed[0]["reportingVms"] == ["WestNO_0"]
    assert listed[0]["approveUrl"] is None


def test_held_by_names_the_platform_or_the_coordinator_or_nothing():
    hold = PlatformHold(eventId="EV-T1", vm="web_1", until=NOT_BEFORE, since=DOC_NOW)
    platform = event_record("EV-T0", eventType="Terminate", state="Approved", platformHold=hold)
    assert people.held_by(platform) == {
        "by": "platform",
        "eventId": "EV-T1",
        "vm": "web_1",
        "until": NOT_BEFORE.isoformat(),
        "reason": hold.describe(),
    }
    decision = decision_record(
        action="approve-after-hooks", reason="held with the pending deletes", heldBy="EV-T2", heldByVm="web_2"
    )
    coordinator = event_record("EV-T0", eventType="Terminate", decision=decision)
    held = people.held_by(coordinator)
    assert held is not None
    assert (held["by"], held["eventId"], held["until"]) == ("coordinator", "EV-T2", None)
    assert people.held_by(event_record("EV-R")) is None


def test_a_person_approving_long_after_the_event_was_listed_finds_its_vm_by_its_heartbeats(bench: Bench):
    """Issue 33: approved 10 minutes after WestNO_0 listed the event (its sighting's last change), while WestNO_0
    sent a heartbeat every minute (its position): the timer counts it alive, and so does the person's run. Before,
    the person got "no VM of ['WestNO_0'] reported within 300 s"."""
    waiting_reboot(bench)
    bench.now = DOC_NOW + timedelta(minutes=10)
    put_vm(bench.store, "WestNO_0", last_seen=bench.now - timedelta(seconds=40))  # its last heartbeat
    result, _ = approve(bench)
    assert (result.status, result.message) == ("approved", f"event EV-R approved by {PERSON}")
    assert bench.callback.vms == ["WestNO_0"]
    approval = bench.event("EV-R").approval
    assert approval is not None
    assert "reported within" not in approval.reason


def test_a_person_approving_while_its_vm_is_silent_still_finds_no_executor(bench: Bench):
    waiting_reboot(bench)
    bench.now = DOC_NOW + timedelta(minutes=10)
    put_vm(bench.store, "WestNO_0", last_seen=DOC_NOW + timedelta(minutes=4))  # silent for 6 minutes
    result, _ = approve(bench)
    assert result.status == "sent"
    assert bench.callback.vms == []
    approval = bench.event("EV-R").approval
    assert approval is not None
    assert approval.reason == "no VM of ['WestNO_0'] reported within 300 s"
