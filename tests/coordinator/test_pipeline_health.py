"""Forwarder health (coordinator/pipeline/health.py): when a heartbeat shows IMDS failing, and the VM's
``imdsFailing`` flag raised once with its row and card, kept quiet while it lasts, cleared on recovery."""

from __future__ import annotations

from datetime import timedelta

import pytest

from contracts.envelope import ForwarderHealth
from coordinator.domain.observations import VmUpdate
from coordinator.pipeline import health
from coordinator.pipeline.run import Work
from tests.coordinator.helpers import DOC_NOW, vm_position

AFTER = timedelta(seconds=60)


def failing(health_report: ForwarderHealth) -> str | None:
    return health.imds_failing(health_report, DOC_NOW, after=AFTER, errors=60)


@pytest.mark.parametrize(
    ("age", "shown"),
    [(timedelta(seconds=0), False), (timedelta(seconds=60), False), (timedelta(seconds=61), True)],
)
def test_imds_fails_once_the_last_good_poll_is_older_than_the_limit(age, shown):
    report = ForwarderHealth(lastGoodPollAt=DOC_NOW - age, consecutivePollErrors=61, lastPollError="HTTP 500")
    reason = failing(report)
    assert (reason is not None) is shown
    if reason is not None:
        assert reason == "no good IMDS poll for 61 s (limit 60 s), 61 failed in a row; last error: HTTP 500"


def test_a_recent_good_poll_outweighs_many_failed_ones():
    # The count of failures alone says nothing while a good poll is recent (a burst of 503s between two good ones).
    assert failing(ForwarderHealth(lastGoodPollAt=DOC_NOW, consecutivePollErrors=10_000)) is None


@pytest.mark.parametrize(("errors", "shown"), [(59, False), (60, True)])
def test_with_no_good_poll_ever_it_takes_that_many_failed_polls_in_a_row(errors, shown):
    reason = failing(ForwarderHealth(lastGoodPollAt=None, consecutivePollErrors=errors))
    assert (reason is not None) is shown
    if reason is not None:
        assert reason == "no good IMDS poll since the forwarder started, 60 failed in a row (limit 60)"


def update(report: ForwarderHealth | None, *, failing_since: bool = False) -> VmUpdate:
    record = vm_position(
        "WestNO_0",
        index=1,
        imdsFailing={"since": DOC_NOW - timedelta(minutes=5), "reason": "earlier"} if failing_since else None,
    )
    return VmUpdate(
        record=record,
        observations=[],
        applied=1,
        duplicates=0,
        resumed=False,
        health=(report, DOC_NOW) if report is not None else None,
    )


def assessed(report: ForwarderHealth | None, *, failing_since: bool = False) -> tuple[VmUpdate, Work]:
    """``update(report, failing_since=...)`` after ``health.assess``, and the work it left for the run."""
    work = Work()
    vm = update(report, failing_since=failing_since)
    health.assess(vm, DOC_NOW, work, after=AFTER, errors=60)
    return vm, work


BAD = ForwarderHealth(lastGoodPollAt=DOC_NOW - timedelta(minutes=2), consecutivePollErrors=120)
GOOD = ForwarderHealth(lastGoodPollAt=DOC_NOW, consecutivePollErrors=0)


def test_assess_raises_the_flag_once_with_a_heartbeat_row_and_a_card():
    vm, work = assessed(BAD)
    assert vm.record.imdsFailing is not None
    assert vm.record.imdsFailing.since == DOC_NOW
    assert vm.record.pendingAlerts == ["imds-failing"]
    assert [(r.RecordType, r.Outcome) for r in work.rows] == [("Heartbeat", "imds-failing")]
    assert work.rows[0].Details is not None
    assert work.rows[0].Details["consecutivePollErrors"] == 120
    assert [(v.identity.name, kind) for v, kind in work.vm_alerts] == [("WestNO_0", "imds-failing")]


def test_assess_says_nothing_more_while_imds_keeps_failing():
    vm, work = assessed(BAD, failing_since=True)
    assert vm.record == update(BAD, failing_since=True).record
    assert (work.rows, work.vm_alerts) == ([], [])


def test_assess_clears_the_flag_on_a_good_poll_with_a_recovered_row_and_no_card():
    vm, work = assessed(GOOD, failing_since=True)
    assert vm.record.imdsFailing is None
    assert [(r.Outcome, r.Reason) for r in work.rows] == [
        ("imds-recovered", f"IMDS polled again (failing since {(DOC_NOW - timedelta(minutes=5)).isoformat()})")
    ]
    assert work.vm_alerts == []


def test_assess_leaves_a_vm_without_a_health_report_alone():
    vm, work = assessed(None, failing_since=True)
    assert vm.record == update(None, failing_since=True).record
    assert work.rows == []
