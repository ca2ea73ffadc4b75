"""Cards (coordinator/pipeline/outbox.py): the cards committed writes recorded, posted; a batch logs what it sent in
one write, the timer clears the outboxes; a card that fails stays pending for the timer."""

from __future__ import annotations

import json
import time
from datetime import timedelta

from coordinator.domain.model import ImdsFailure, SentAlerts, VmRecord, group_key
from coordinator.pipeline import outbox
from coordinator.pipeline.run import Run, Work
from tests.coordinator.helpers import DOC_NOW, event_record
from tests.coordinator.runs import NOT_BEFORE, Bench, identity, put_event, put_vm


def with_card(bench: Bench, event_id: str, *kinds: str) -> None:
    put_event(bench.store, event_id, notBefore=NOT_BEFORE, pendingAlerts=list(kinds), pendingSince=DOC_NOW)


def posting(bench: Bench, *cards: tuple[str, str]) -> Run:
    run = bench.run()
    run.work.alerts = list(cards)  # type: ignore[arg-type]
    return run


def test_a_batch_posts_its_cards_and_logs_what_it_sent_in_one_write(bench: Bench):
    with_card(bench, "EV-1", "new-event")
    with_card(bench, "EV-2", "new-event", "approved")
    run = posting(bench, ("EV-1", "new-event"), ("EV-2", "new-event"), ("EV-2", "approved"))
    outbox.post_and_log(run)

    # One card per event: EV-2's two alerts of this run are one card, the latest's, naming the other.
    assert bench.alerts.keys == ["EV-1-new-event", "EV-2-approved"]
    assert run.report.alerts_sent == 2
    assert [(r.EventId, r.Action, r.Outcome, r.Reason) for r in run.work.rows] == [
        ("EV-1", "new-event", "sent", ""),
        ("EV-2", "new-event", "sent", "in EV-2-approved"),
        ("EV-2", "approved", "sent", ""),
    ]
    texts = json.dumps(bench.alerts.cards[1][1])
    assert "Event approved: " in texts
    assert "Also since the last card: New scheduled event" in texts
    assert "Also since the last card" not in json.dumps(bench.alerts.cards[0][1])
    logs = bench.store.sent_alert_logs()
    assert len(logs) == 1
    assert logs[0][1].events == {"EV-1": ["new-event"], "EV-2": ["new-event", "approved"]}
    # The batch does not clear the outboxes itself (one write per batch): the timer does, from the log.
    assert bench.event("EV-2").pendingAlerts == ["new-event", "approved"]
    assert run.stages == ["cards"]


def test_a_card_that_fails_stays_pending_and_nothing_is_logged(bench: Bench):
    with_card(bench, "EV-1", "new-event")
    bench.alerts.failing = True
    run = posting(bench, ("EV-1", "new-event"))
    outbox.post_and_log(run)
    assert run.report.alerts_sent == 0
    assert run.report.alerts_failed == 1
    assert [(r.RecordType, r.Outcome, r.Reason) for r in run.work.rows] == [
        ("Alert", "failed", "card EV-1-new-event refused (stand-in)")
    ]
    assert bench.store.sent_alert_logs() == []
    assert bench.event("EV-1").pendingAlerts == ["new-event"]


def test_a_card_standing_for_two_alerts_that_fails_leaves_both_pending(bench: Bench):
    with_card(bench, "EV-1", "new-event", "approved")
    bench.alerts.failing = True
    run = posting(bench, ("EV-1", "new-event"), ("EV-1", "approved"))
    outbox.post_and_log(run)
    assert (run.report.alerts_sent, run.report.alerts_failed) == (0, 1)
    assert [(r.Action, r.Outcome) for r in run.work.rows] == [("new-event", "failed"), ("approved", "failed")]
    assert bench.store.sent_alert_logs() == []
    assert bench.event("EV-1").pendingAlerts == ["new-event", "approved"]


def test_a_run_stops_posting_at_its_first_card_that_fails_and_leaves_the_rest_pending(bench: Bench):
    """Teams down (each card up to its 30 s deadline): the run tries one card, not all, and leaves the others in
    their outboxes for the timer, counted; the timer posts them once Teams answers."""
    for n in range(5):
        with_card(bench, f"EV-{n}", "new-event")
    bench.alerts.failing = True
    run = posting(bench, *((f"EV-{n}", "new-event") for n in range(5)))
    outbox.post_and_log(run)
    assert (run.report.alerts_failed, run.report.alerts_held, run.report.alerts_sent) == (1, 4, 0)
    assert all(bench.event(f"EV-{n}").pendingAlerts == ["new-event"] for n in range(5))

    bench.alerts.failing = False
    timer = posting(bench, *((f"EV-{n}", "new-event") for n in range(5)))
    outbox.post_and_settle(timer, {}, {})
    assert timer.report.alerts_sent == 5
    assert all(bench.event(f"EV-{n}").pendingAlerts == [] for n in range(5))


def test_a_run_posts_cards_within_its_time_and_leaves_the_rest_pending(bench: Bench, monkeypatch):
    """A webhook that answers, slowly: the run posts what fits in its time for cards (0.25 s here, 10 s as shipped)
    and leaves the rest pending, so its budgets and history do not wait for every card."""
    monkeypatch.setattr(outbox, "CARDS_WITHIN", timedelta(seconds=0.25))
    slow = bench.alerts.send

    def send(card, *, key):
        time.sleep(0.1)
        slow(card, key=key)

    monkeypatch.setattr(bench.alerts, "send", send)
    for n in range(10):
        with_card(bench, f"EV-{n}", "new-event")
    run = posting(bench, *((f"EV-{n}", "new-event") for n in range(10)))
    outbox.post_and_log(run)
    assert 1 <= run.report.alerts_sent < 10
    assert run.report.alerts_held == 10 - run.report.alerts_sent
    assert run.report.alerts_failed == 0


def test_a_card_of_an_event_this_run_did_not_change_is_built_from_the_stored_record(bench: Bench):
    with_card(bench, "EV-1", "new-event")
    bench.options = {"approve_url": lambda event_id: f"https://app.example/api/events/{event_id}/approve"}
    outbox.post_and_log(posting(bench, ("EV-1", "new-event"), ("EV-GONE", "new-event")))
    # An event gone meanwhile has no card to build; the one read has its approval link.
    assert bench.alerts.keys == ["EV-1-new-event"]
    assert "https://app.example/api/events/EV-1/approve" in str(bench.alerts.cards[0][1])


def test_the_timer_clears_what_the_logs_and_its_own_posts_say_was_sent(bench: Bench):
    with_card(bench, "EV-1", "new-event")
    with_card(bench, "EV-2", "new-event", "expired")
    run = posting(bench, ("EV-2", "expired"))
    # A batch logged EV-1's card and EV-2's new-event card as sent.
    outbox.post_and_settle(run, {"EV-1": ["new-event"], "EV-2": ["new-event"]}, {})
    assert bench.alerts.keys == ["EV-2-expired"]
    for event_id in ("EV-1", "EV-2"):
        record = bench.event(event_id)
        assert (record.pendingAlerts, record.pendingSince) == ([], None)


def test_clearing_keeps_the_cards_not_yet_sent(bench: Bench):
    with_card(bench, "EV-1", "new-event", "approved")
    outbox.post_and_settle(posting(bench), {"EV-1": ["new-event"]}, {})
    record = bench.event("EV-1")
    assert (record.pendingAlerts, record.pendingSince) == (["approved"], DOC_NOW)


def test_sent_logs_gather_every_batchs_log(bench: Bench):
    bench.store.log_sent_alerts(SentAlerts(sentAt=DOC_NOW, events={"EV-1": ["new-event"]}))
    bench.store.log_sent_alerts(
        SentAlerts(
            sentAt=DOC_NOW + timedelta(seconds=1),
            events={"EV-1": ["approved"]},
            vms={"pg:a": {"vm-1": ["heartbeat-lost"]}},
        )
    )
    logs, settled, settled_vms = outbox.sent_logs(bench.run("tick"))
    assert len(logs) == 2
    # Oldest log first.
    assert settled == {"EV-1": ["new-event", "approved"]}
    assert settled_vms == {"pg:a": {"vm-1": ["heartbeat-lost"]}}


def test_queue_pending_takes_over_cards_left_after_the_grace(bench: Bench):
    work = Work()
    fresh = event_record("EV-FRESH", pendingAlerts=["new-event"], pendingSince=DOC_NOW)
    old = event_record(
        "EV-OLD",
        pendingAlerts=["new-event", "approved", "from-a-newer-coordinator"],
        pendingSince=DOC_NOW - outbox.ALERT_GRACE - timedelta(seconds=1),
    )
    now = DOC_NOW + timedelta(seconds=10)
    outbox.queue_pending(fresh, now, work, {})  # its sender has had less than ALERT_GRACE: left to it
    outbox.queue_pending(old, now, work, {"EV-OLD": ["approved"]})  # a batch logged 'approved' as sent
    # A kind this code cannot title is left alone.
    assert work.alerts == [("EV-OLD", "new-event")]
    assert list(work.records) == ["EV-OLD"]
    # Queued twice (a second pass of the same tick), sent once.
    outbox.queue_pending(old, now, work, {"EV-OLD": ["approved"]})
    assert work.alerts == [("EV-OLD", "new-event")]


def test_a_vm_card_that_fails_stays_in_the_vms_outbox_and_the_timer_sends_it_again(bench: Bench):
    lost = put_vm(
        bench.store,
        "WestNO_0",
        last_seen=DOC_NOW - timedelta(minutes=10),
        heartbeatLost=True,
        pendingAlerts=["heartbeat-lost"],
        pendingSince=DOC_NOW - timedelta(minutes=1),
    )
    bench.alerts.failing = True
    run = bench.run("tick")
    run.work.vm_alerts = [(lost, "heartbeat-lost")]
    outbox.post_and_settle(run, {}, {})
    assert run.report.alerts_failed == 1
    assert bench.vm("WestNO_0").pendingAlerts == ["heartbeat-lost"]

    bench.alerts.failing = False
    retry = bench.run("tick")
    outbox.queue_vm_pending(bench.vm("WestNO_0"), retry.now, retry.work, {}, group=group_key(lost.identity))
    outbox.post_and_settle(retry, {}, {})
    key = f"{lost.identity.vmId}-heartbeat-lost-{lost.lastSeen.strftime('%Y%m%dT%H%M%S')}"
    assert bench.alerts.keys == [key]
    assert (bench.vm("WestNO_0").pendingAlerts, bench.vm("WestNO_0").pendingSince) == ([], None)


def test_a_vm_card_a_batch_logged_is_cleared_not_sent_again(bench: Bench):
    put_vm(bench.store, "WestNO_0", pendingAlerts=["imds-failing"], pendingSince=DOC_NOW - timedelta(minutes=5))
    who = identity("WestNO_0")
    settled_vms = {group_key(who): {who.vmId.lower(): ["imds-failing"]}}
    run = bench.run("tick")
    outbox.queue_vm_pending(bench.vm("WestNO_0"), run.now, run.work, settled_vms, group=group_key(who))
    assert run.work.vm_alerts == []
    outbox.post_and_settle(run, {}, settled_vms)
    assert bench.alerts.cards == []
    assert bench.vm("WestNO_0").pendingAlerts == []


def test_a_vm_cards_key_names_the_occurrence_of_its_condition():
    vm = identity("WestNO_0")
    record = VmRecord(identity=vm, lastSeen=DOC_NOW, imdsFailing=ImdsFailure(since=DOC_NOW + timedelta(hours=1)))
    assert outbox.vm_card_key(record, "heartbeat-lost") == f"{vm.vmId}-heartbeat-lost-20220411T221158"
    assert outbox.vm_card_key(record, "imds-failing") == f"{vm.vmId}-imds-failing-20220411T231158"
    conflict = record.model_copy(update={"stateConflict": ["a1", "b2"]})
    assert outbox.vm_card_key(conflict, "forwarder-conflict") == f"{vm.vmId}-forwarder-conflict-a1-b2"
