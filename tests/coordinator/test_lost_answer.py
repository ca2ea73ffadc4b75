"""A lost answer (coordinator/domain/lifecycle.py ``lost_answer``, ``started_unanswered``): a request that reached its
executor's listener, which went away before answering (the relay's 502: the VM deleted by the Terminate it had just
executed), has an unknown outcome, not a failed one; an event then seen Started before its NotBefore gets an Approval
row (Actor platform, Outcome started) that says so, and nothing more is sent. The fleet demo's flake, 2026-11-28:
web_1's listener POSTed StartRequests for scale-in-1, IMDS removed web_1 as the Terminate started, its forwarder was
killed before its answer left, and the history said "failed", then "seen Started without an approval from here"."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests
from azure.core.credentials import AzureNamedKeyCredential

from contracts.approval import ApprovalRequest
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.delivery_queue import QueuedDelivery
from coordinator.adapters.relay_sender import RelayApprovalSender
from coordinator.domain.model import ApprovalRecord
from coordinator.pipeline import act, delivery, fold, ingest
from coordinator.pipeline.run import Run
from tests.coordinator.helpers import DOC_NOW, envelope, scheduled_event
from tests.coordinator.runs import NOT_BEFORE, Bench, RecordingCallback, identity, message, put_event

EVENT = "EV-SCALE-IN-1"
RULE = "terminate-after-prepare-hooks"
LOST = (
    f"approval d-1 for event {EVENT} reached web_1's listener, whose answer was lost (attempt 1: HTTP 502 the "
    "listener disconnected before responding; the relay's 502: the listener went away with the request outstanding), "
    "so IMDS may have accepted StartRequests; no answer after 14 attempts via http://relay/approve (last: HTTP 503 "
    "no listener is connected)"
)


def terminate(bench: Bench, **fields: Any) -> None:
    """scale-in-1: a Terminate of web_1, which web_0 (its placement group) sees too, approved by its rule."""
    approval = ApprovalRecord(
        decisionId="d-1",
        rule=RULE,
        actor=f"rule:{RULE}",
        decidedAt=DOC_NOW,
        nextAttemptAt=DOC_NOW + timedelta(seconds=90),
        **fields.pop("approval", {}),
    )
    put_event(
        bench.store,
        EVENT,
        vms=("web_1", "web_0"),
        scale_set="web",
        eventType="Terminate",
        resources=["web_1"],
        seenScheduled=True,
        approval=approval,
        **{"notBefore": NOT_BEFORE, **fields},
    )


def lost_on_the_way(bench: Bench) -> None:
    bench.callback = RecordingCallback(error=ApprovalDeliveryError(LOST, answer_lost=True))


def seen_started(bench: Bench, *, at: timedelta = timedelta(seconds=2)) -> Run:
    """A batch in which web_0 lists the Terminate Started, ``at`` after DOC_NOW (the service's clock)."""
    bench.now = DOC_NOW + at
    started = scheduled_event(EVENT, event_type="Terminate", status="Started", resources=["web_1"], duration=-1)
    data = envelope(identity("web_0", scale_set="web").model_dump(), sequence=2, incarnation=2, events=[started])
    run = bench.run()
    fold.fold(run, ingest.read_batch(run, [message(data)], "vms"))
    return run


def approval_rows(run: Run) -> list[tuple[str, str, str]]:
    return [(r.Actor, r.Outcome, r.VmName) for r in run.work.rows if r.RecordType == "Approval"]


def test_a_lost_answer_then_started_before_not_before_is_recorded_as_such_and_nothing_more_is_sent(bench: Bench):
    """Through the Relay sender: the relay answers 502 (the listener disconnected before responding), then 503 (no
    listener) until the sender gives up; then web_0 lists the Terminate Started, 898 s before its NotBefore."""
    terminate(bench)
    relay = Relay((502, "the listener disconnected before responding"), (503, "no listener is connected"))
    bench.callback = sender(relay, now=DOC_NOW)  # type: ignore[assignment]
    sent = bench.run()
    sent.work.deliveries = [EVENT]
    act.deliver(sent, last_seen=None)

    # Unknown, not failed: the request reached web_1's listener, which may have had IMDS accept it before it went.
    assert approval_rows(sent) == [
        ("rule:terminate-after-prepare-hooks", "sending", "web_1"),
        (f"rule:{RULE}", "unknown", "web_1"),
    ]
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.outcome, record.approval.delivered) == ("Scheduled", "unknown", False)
    assert record.approval.lostAnswer is not None
    assert (record.approval.lostAnswer.executor, record.approval.lostAnswer.sentAt) == ("web_1", DOC_NOW)
    # It may still be executed until its notAfter: the request stays open (no other VM or decision before then).
    assert record.openRequest is not None
    assert (record.openRequest.executor, record.openRequest.decisionId) == ("web_1", "d-1")

    posts = relay.posts
    run = seen_started(bench)

    record = bench.event(EVENT)
    assert record.state == "Started"
    assert record.startedSeenAt == DOC_NOW + timedelta(seconds=2)
    [moved] = [r for r in run.work.rows if r.RecordType == "Transition"]
    assert moved.State == "Started"
    assert moved.Reason == (
        "seen Started before its NotBefore: most likely that approval's start (unconfirmed), after approval d-1 "
        "reached web_1, whose answer was lost"
    )
    [started] = [r for r in run.work.rows if r.RecordType == "Approval"]
    assert (started.Actor, started.Outcome, started.VmName, started.DecisionId, started.Rule) == (
        "platform",
        "started",
        "web_1",
        "d-1",
        RULE,
    )
    assert started.Reason is not None
    assert started.Reason.startswith(
        f"seen Started at {(DOC_NOW + timedelta(seconds=2)).isoformat()}, 898.0 s before its NotBefore "
        f"{NOT_BEFORE.isoformat()}, after approval d-1, sent at {DOC_NOW.isoformat()}, reached web_1's listener, "
        "whose answer was lost; a Terminate is executed only by the VM it deletes, web_1: started early"
    )
    assert "HTTP 502 the listener disconnected before responding" in started.Reason
    assert started.Details == {
        "requestSentAt": DOC_NOW.isoformat(),
        "startedSeenAt": (DOC_NOW + timedelta(seconds=2)).isoformat(),
        "notBefore": NOT_BEFORE.isoformat(),
        "secondsBeforeNotBefore": 898.0,
    }
    # The coordinator claims no approval it cannot support: no 'approved' row, never the Approved state, no card.
    assert all(r.Outcome != "approved" for r in run.work.rows)
    assert "approved" not in record.alerts
    # And sends nothing because of it.
    assert run.work.deliveries == []
    assert relay.posts == posts


def test_an_answer_lost_while_the_event_was_already_seen_started_is_recorded_when_it_comes(bench: Bench):
    """The flake's order: a batch sends (its tail awaits the answer after it returned), the next batch folds web_0's
    Started, and only then does the send give up, its answer lost: the row comes with the outcome."""
    terminate(bench)
    lost_on_the_way(bench)
    bench.callback.hold = threading.Event()
    sent = bench.run(tail_after_batch=True)
    sent.work.deliveries = [EVENT]
    act.send_decided(sent)
    assert len(sent.work.sending) == 1  # on its way, unanswered

    started = seen_started(bench)
    assert bench.event(EVENT).state == "Started"
    [moved] = [r for r in started.work.rows if r.RecordType == "Transition"]
    assert moved.Reason == (
        "seen Started while approval d-1 awaited its answer (NotBefore passed, approved elsewhere, or that "
        "approval; its answer, if one comes, is recorded)"
    )
    assert approval_rows(started) == []

    bench.callback.hold.set()
    act.deliver(sent, last_seen=None)

    assert [(actor, outcome) for actor, outcome, _ in approval_rows(sent)] == [
        (f"rule:{RULE}", "sending"),
        (f"rule:{RULE}", "unknown"),
        ("platform", "started"),
    ]
    record = bench.event(EVENT)
    assert record.state == "Started"
    assert record.approval is not None
    assert record.approval.lostAnswer is not None
    assert not record.approval.delivered
    assert len(bench.callback.sent) == 1


def test_started_at_or_after_not_before_says_nothing_of_the_lost_answer(bench: Bench):
    """At NotBefore the platform starts the event whatever: the start is no sign that the request was executed."""
    terminate(bench, notBefore=DOC_NOW + timedelta(seconds=5))
    lost_on_the_way(bench)
    sent = bench.run()
    sent.work.deliveries = [EVENT]
    act.deliver(sent, last_seen=None)

    run = seen_started(bench, at=timedelta(seconds=6))

    assert approval_rows(run) == []
    [moved] = [r for r in run.work.rows if r.RecordType == "Transition"]
    assert moved.Reason == "seen Started at or after NotBefore, after approval d-1 reached web_1, whose answer was lost"


def test_a_failure_that_reached_no_listener_stays_failed(bench: Bench):
    terminate(bench)
    bench.callback = RecordingCallback(error=ApprovalDeliveryError("HTTP 503 no listener", unreached=True))
    sent = bench.run()
    sent.work.deliveries = [EVENT]
    act.deliver(sent, last_seen=None)
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.approval.outcome, record.approval.lostAnswer, record.openRequest) == ("failed", None, None)

    run = seen_started(bench)
    assert approval_rows(run) == []
    [moved] = [r for r in run.work.rows if r.RecordType == "Transition"]
    assert moved.Reason == "seen Started without an approval from here (NotBefore passed or approved elsewhere)"


def test_a_handed_over_approval_whose_event_started_meanwhile_is_not_sent_again(bench: Bench):
    """The delivery queue's run continues an approval only while its event is Scheduled: once the event is seen
    Started there is nothing left to approve (the timer's retries stop there too)."""
    terminate(bench, approval={"outcome": "continued", "executor": "web_1"})
    seen_started(bench)
    assert bench.event(EVENT).state == "Started"

    run = bench.run("delivery")
    delivery.take_over(run, QueuedDelivery(eventId=EVENT, decisionId="d-1", executor="web_1", handedOverAt=DOC_NOW))

    assert run.work.deliveries == []
    assert bench.callback.sent == []


class Relay:
    """A stand-in for the relay's HTTP face: answers each POST with the next (status, text) of ``answers``."""

    def __init__(self, *answers: tuple[int, str]) -> None:
        self.answers = list(answers)
        self.posts = 0

    def post(self, url: str, **_: Any) -> requests.Response:
        status, text = self.answers[min(self.posts, len(self.answers) - 1)]
        self.posts += 1
        response = requests.Response()
        response.status_code = status
        response.headers["Content-Type"] = "text/plain; charset=utf-8"
        response._content = text.encode()
        response.url = url
        return response

    def close(self) -> None:
        pass


def request(valid_for: timedelta) -> ApprovalRequest:
    now = datetime.now(UTC)
    return ApprovalRequest(
        eventId=EVENT, decisionId="d-1", rule=RULE, issuedAt=now, expiresAt=now + valid_for, notAfter=now + valid_for
    )


def sender(relay: Relay, *, now: datetime | None = None) -> RelayApprovalSender:
    """The Relay sender over ``relay``, giving up after 0.3 s; its clock at ``now`` (a bench's runs are at DOC_NOW)."""
    return RelayApprovalSender(
        endpoint="http://relay.test",
        credential=AzureNamedKeyCredential("send", "a2V5"),
        backoff_initial=0.01,
        listener_wait_maximum=0.02,
        max_retry_seconds=0.3,
        session=relay,  # type: ignore[arg-type]
        clock=(lambda: now) if now is not None else (lambda: datetime.now(UTC)),
        not_after_tolerance=timedelta(0),
    )


def test_the_relays_502_is_a_lost_answer_not_no_listener():
    """The relay's 502: the listener went away with the request outstanding. Retried as briefly as "no listener"
    (a listener may come back and answer from its ledger), but the request reached it: not ``unreached`` (another VM
    must wait for it to lapse) and its answer lost, whatever the 503s after it say."""
    relay = Relay((502, "the listener disconnected before responding"), (503, "no listener is connected"))
    with pytest.raises(ApprovalDeliveryError) as failed:
        sender(relay).send(request(timedelta(seconds=30)), vm=identity("web_1", scale_set="web"))
    assert relay.posts > 2
    assert failed.value.answer_lost
    assert not failed.value.unreached
    assert "reached web_1's listener, whose answer was lost (attempt 1: HTTP 502 the listener disconnected" in str(
        failed.value
    )


def test_the_relays_503_alone_reached_no_one():
    relay = Relay((503, "no listener is connected"))
    with pytest.raises(ApprovalDeliveryError, match="no listener connected within") as failed:
        sender(relay).send(request(timedelta(seconds=30)), vm=identity("web_1", scale_set="web"))
    assert failed.value.unreached
    assert not failed.value.answer_lost


def test_no_listener_is_retried_within_tens_of_milliseconds_at_first(monkeypatch: pytest.MonkeyPatch):
    """An on-demand listener connects as its VM sees the event, about when the approval is sent: the relay's "no
    listener" (503) is retried from 20 ms (doubling, full jitter, capped at 1 s), not from the 200 ms other failures
    back off from. Production defaults; the waits are what the sender sleeps."""
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 8:
            raise TimeoutError("enough waits seen")

    monkeypatch.setattr("coordinator.adapters.relay_sender.time.sleep", sleep)
    relay = Relay((503, "no listener is connected"))
    quick = RelayApprovalSender(
        endpoint="http://relay.test",
        credential=AzureNamedKeyCredential("send", "a2V5"),
        max_retry_seconds=30,
        session=relay,  # type: ignore[arg-type]
    )
    with pytest.raises(TimeoutError):
        quick.send_within(request(timedelta(minutes=5)), vm=identity("web_1", scale_set="web"), seconds=30.0)
    assert all(0 <= wait <= min(1.0, 0.02 * 2**n) for n, wait in enumerate(waits)), waits
