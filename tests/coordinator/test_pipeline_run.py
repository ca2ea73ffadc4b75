"""The run (coordinator/pipeline/run.py): options that refuse contradictions, counts reported per kind of run, the
work a committed change leaves, and dry-run from either switch."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from coordinator.domain.lifecycle import EventChange
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.run import RETIRE_GRACE, Options, Report, Work
from tests.coordinator.helpers import DOC_NOW, event_record
from tests.coordinator.runs import Bench

# What a tick reports (the timer's own counts and the tail's); test_pipeline_stages.py reads it from a real tick.
TICK_COUNTS = {
    "open_events",
    "events_changed",
    "approvals_sent",
    "alerts_sent",
    "alerts_held",
    "heartbeats_lost",
    "vms_retired",
    "history_rows",
    "events_purged",
    "set_aside",
    "deliveries_continued",
    "vms_purged",
    "copies_removed",
    "budgets_purged",
    "history_adopted",
    "bindings_written",
}


@pytest.mark.parametrize("grace", [timedelta(minutes=5), timedelta(minutes=6)])
def test_options_refuse_a_retire_grace_not_shorter_than_the_heartbeat_timeout(grace):
    # A removed VM must be retired before it would count as lost: else every scale-in raises "heartbeat lost".
    with pytest.raises(ValueError, match=r"retire_grace \(\d+ s\) must be shorter than heartbeat_timeout \(300 s\)"):
        Options(heartbeat_timeout=timedelta(minutes=5), retire_grace=grace)


def test_options_take_a_shorter_retire_grace_and_are_frozen():
    options = Options(heartbeat_timeout=timedelta(minutes=5), retire_grace=timedelta(seconds=299))
    assert options.retire_grace == timedelta(seconds=299)
    assert Options().retire_grace == RETIRE_GRACE < Options().heartbeat_timeout
    # Frozen: no stage can change what the run was started with.
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dry_run = True  # type: ignore[misc]


def test_each_kind_of_run_reports_its_own_counts():
    counts = {field.name: index for index, field in enumerate(dataclasses.fields(Report)) if field.name != "kind"}
    reports = {kind: Report(kind=kind, **counts) for kind in ("batch", "tick", "person", "delivery")}

    batch = reports["batch"].as_dict()
    assert list(batch) == [
        "received",
        "accepted",
        "dead_lettered",
        "duplicates",
        "events_changed",
        "approvals_sent",
        "alerts_sent",
        "alerts_failed",
        "alerts_held",
        "history_rows",
        "conflicts",
        "vms_moved",
        "set_aside",
        "deliveries_continued",
    ]
    assert set(reports["tick"].as_dict()) == TICK_COUNTS
    # The delivery queue's run (function_app.continue_approval); a person's run counts the same, and the deliveries
    # it continued.
    delivery = {"events_changed", "approvals_sent", "alerts_sent", "alerts_failed", "alerts_held", "history_rows"}
    delivery.add("set_aside")
    assert set(reports["delivery"].as_dict()) == delivery
    assert set(reports["person"].as_dict()) == delivery | {"deliveries_continued"}
    # Each name carries its own count (not another's).
    for report in reports.values():
        assert all(value == counts[name] for name, value in report.as_dict().items())


def test_conflicts_are_counted_one_at_a_time():
    report = Report(kind="batch")
    report.count_conflict()
    report.count_conflict()
    assert report.as_dict()["conflicts"] == 2


def test_work_collects_a_change_and_sends_an_approval_only_from_the_change_that_decided_it():
    work = Work()
    record = event_record("EV-1")
    reread = EventChange(record=record, changed=True, alerts=["new-event"])
    work.collect(reread)
    # Another instance decided it (this change only re-read the approval): nothing to send from here.
    assert work.deliveries == []
    assert work.alerts == [("EV-1", "new-event")]
    assert work.records == {"EV-1": record}

    decided = EventChange(record=record, changed=True, approval_decided=True)
    work.collect(decided)
    work.collect(decided)
    assert work.deliveries == ["EV-1"]


def test_dry_run_is_the_settings_or_the_policys(bench: Bench):
    assert bench.run().dry_run is False
    assert bench.run(dry_run=True).dry_run is True
    bench.policy = parse_policy("dryRun: true\nrules:\n  - name: all\n    action: approve-now\n")
    assert bench.run().dry_run is True


def test_a_run_notes_each_stage_it_enters_in_order(bench: Bench):
    run = bench.run("tick")
    assert (run.kind, run.now, run.stages) == ("tick", DOC_NOW, [])
    run.enter("timer")
    run.enter("deliver")
    assert run.stages == ["timer", "deliver"]


def test_work_hands_the_fleet_cache_only_what_it_committed_since_it_last_did():
    """A batch puts its records into the fleet cache before it returns; its tail, after it, only the records it
    committed since: put again, the batch's could overwrite newer ones a later batch cached meanwhile."""
    work = Work()
    first, other = event_record("EV-1"), event_record("EV-2")
    work.records.update({"EV-1": first, "EV-2": other})
    assert work.uncached() == [first, other]
    assert work.uncached() == []
    answered = first.model_copy(update={"state": "Approved"})
    work.records["EV-1"] = answered  # the tail committed the answer to EV-1
    assert work.uncached() == [answered]
