"""Each kind of run takes its stages once, in order, and ends with the one tail (deliver -> cards -> budgets ->
history): a batch with an approved Freeze, a dead letter and a card; a tick; a person's approval."""

from __future__ import annotations

from datetime import timedelta

from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline import people, timer
from coordinator.pipeline.housekeeping import Housekeeping
from coordinator.pipeline.ingest import RawMessage
from tests.coordinator.helpers import DOC_NOW, envelope, scheduled_event, vm
from tests.coordinator.test_pipeline_run import TICK_COUNTS
from tests.coordinator.test_service import approvals, build, raw

TAIL = ["deliver", "cards", "budgets", "history"]


def test_a_batch_enters_each_stage_once_in_order(azurite, imds, tmp_path):
    coordinator, history, _ = build(azurite, imds, tmp_path)
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0"], NoticeSeconds=900)["EventId"]
    freeze = scheduled_event(event_id, resources=["WestNO_0"])
    run = coordinator.run_batch(
        [
            raw(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze])),
            RawMessage(body=b"{not json", partition_key="nobody"),
        ]
    )
    assert run.stages == ["ingest", "fold", "decide", *TAIL]
    report = run.report.as_dict()
    assert (report["received"], report["accepted"], report["dead_lettered"]) == (2, 1, 1)
    assert report["approvals_sent"] == 1
    cards = [row.Action for row in history.rows if row.RecordType == "Alert" and row.Outcome == "sent"]
    # New and approved in one batch: one card standing for both alerts, an Alert row each.
    assert (report["alerts_sent"], cards) == (1, ["new-event", "approved"])
    assert approvals(imds, event_id) == 1
    kinds = [row.RecordType for row in history.rows]
    assert kinds.count("DeadLetter") == 1
    assert [row.Outcome for row in history.rows if row.RecordType == "Approval"] == ["sending", "approved"]
    # The history is written last, once: every row the batch made is in the sink.
    assert report["history_rows"] == len(history.rows)


def test_a_tick_and_a_person_end_with_the_same_tail(azurite, imds, tmp_path):
    policy = parse_policy("rules:\n  - name: people\n    match: {eventType: [Reboot]}\n    action: wait-for-person\n")
    coordinator, history, clock = build(azurite, imds, tmp_path, policy=policy)
    event_id = imds.create_event(EventType="Reboot", Resources=["WestNO_0"], NoticeSeconds=900)["EventId"]
    reboot = scheduled_event(event_id, event_type="Reboot", resources=["WestNO_0"], duration=-1)
    batch = coordinator.run_batch([raw(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[reboot]))])
    assert batch.stages == ["ingest", "fold", "decide", *TAIL]
    assert approvals(imds, event_id) == 0

    clock.now = DOC_NOW + timedelta(minutes=1)
    tick = coordinator.start("tick")  # the tick's own run, to read its stages
    timer.tick(tick, Housekeeping())
    assert tick.stages == ["timer", *TAIL]
    assert set(tick.report.as_dict()) == TICK_COUNTS

    person = coordinator.start("person")
    result = people.approve_manually(person, event_id, person="ops@example.com")
    assert result.status == "approved", result.message
    assert person.stages == ["person", *TAIL]
    assert approvals(imds, event_id) == 1
    decisions = [r.Actor for r in history.rows if r.RecordType == "Decision"]
    assert decisions == ["rule:people", "person:ops@example.com"]
