"""A dead executor's approval when NotBefore is near: the first request must lapse early enough that the delivery
run can still send the event through a peer, and the peer execute it, before NotBefore (pipeline/plan.py
``_valid_for``, domain/approvals.py ``reroutable_within``; docs/liveness.md, *Liveness*)."""

from __future__ import annotations

from datetime import timedelta
from typing import NoReturn

import pytest

from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.domain import approvals
from coordinator.domain.model import ApprovalRecord, EventRecord, VmSighting
from coordinator.pipeline import act, delivery, handover
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.runs import Bench, DeadFor, MemoryDeliveries, put_event, put_vm

EVENT = "EV-NEAR"
# What the reroute takes once the request has lapsed: the delivery run (a read, a decision, a write) and the peer's
# listener (its IMDS read and POST), on two loaded cores.
PEER_WAY = timedelta(seconds=1.5)


class LostAnswers(DeadFor):
    """The listeners of ``dead`` lose every request: the relay answers 502 at once (its request reached the
    listener, which may still execute it until its notAfter)."""

    def fail(self, vm: VmIdentity, seconds: float) -> NoReturn:
        raise ApprovalDeliveryError(f"{vm.name}'s listener disconnected before responding", answer_lost=True)


def a_freeze_seen_only_by_its_dead_vm(bench: Bench, notice: timedelta) -> EventRecord:
    approval = ApprovalRecord(
        decisionId="d-1",
        rule="short-freeze",
        actor="rule:short-freeze",
        decidedAt=DOC_NOW,
        nextAttemptAt=DOC_NOW + timedelta(seconds=90),
        notAfter=DOC_NOW + notice,
        notAfterReason="the event's NotBefore",
    )
    return put_event(
        bench.store,
        EVENT,
        vms=("WestNO_0",),
        eventType="Freeze",
        durationInSeconds=5,
        notBefore=DOC_NOW + notice,
        approval=approval,
    )


@pytest.mark.parametrize(
    ("tolerance", "notice"),
    [
        # The local stack's tolerance (one clock), a Freeze decided 5.5 s before its NotBefore (a 15-minute notice
        # played 120 times faster, decided 2 s after it appeared on two loaded cores).
        (timedelta(seconds=0.25), timedelta(seconds=5.5)),
        # Azure's tolerance, a Freeze found 10 s before its NotBefore.
        (timedelta(seconds=2), timedelta(seconds=10)),
    ],
)
def test_a_dead_executors_request_lapses_in_time_for_a_peer_to_execute_it_before_a_near_not_before(
    bench: Bench, tolerance: timedelta, notice: timedelta
):
    """The first request went to the only VM that had reported the event, whose listener is dead; its peer reports
    the event a moment later. The request was valid for the run's 3 s and 2 s more (no peer yet), so the peer could
    be sent the event only after NotBefore: missed. Now it lapses early enough for the reroute to land in time."""
    bench.deliveries = MemoryDeliveries()
    bench.callback = callback = LostAnswers("WestNO_0")
    not_before = a_freeze_seen_only_by_its_dead_vm(bench, notice).notBefore
    assert not_before is not None

    first = bench.run(not_after_tolerance=tolerance)
    first.work.deliveries = [EVENT]
    act.deliver(first, last_seen=None)
    record = bench.event(EVENT)
    assert record.approval is not None
    assert record.openRequest is not None
    assert (record.approval.outcome, record.openRequest.executor) == ("continued", "WestNO_0")
    lapsed = record.openRequest.until + approvals.REROUTE_MARGIN
    # Room left after the lapse for the delivery run and the peer, within the peer's own request's tolerance.
    assert lapsed + PEER_WAY <= not_before - tolerance, (
        f"a peer may be sent the event only {(not_before - lapsed).total_seconds():.2f} s before NotBefore"
    )
    # The run waited for an answer no longer than the listener could execute the request: handed over at once.
    executable = (record.openRequest.until - tolerance - DOC_NOW).total_seconds()
    waited = min(executable, first.options.in_run_delivery.total_seconds())
    assert callback.within == [pytest.approx(waited, abs=0.05)]

    # The peer reports the event; the delivery run comes once the request has lapsed and sends it through the peer.
    sighting = VmSighting(firstSeen=DOC_NOW, lastSeen=DOC_NOW, lastSequence=1, incarnation=1, status="Scheduled")
    put_vm(bench.store, "WestNO_1", sightings={EVENT: sighting})
    assert bench.deliveries.delays == [timedelta(0)]  # handed over, visible at once
    queued = bench.deliveries.queued[0]
    assert handover.lapse_wait(bench.event(EVENT), queued, DOC_NOW) == lapsed - DOC_NOW
    bench.now = lapsed
    continued = bench.run("delivery", not_after_tolerance=tolerance)
    delivery.take_over(continued, queued)
    act.deliver(continued, last_seen=None)
    assert callback.vms == ["WestNO_0", "WestNO_1"]
    record = bench.event(EVENT)
    assert record.approval is not None
    assert (record.state, record.approval.executor) == ("Approved", "WestNO_1")
    request, _ = callback.sent[-1]
    assert request.notAfter == not_before  # sent while still executable before NotBefore


def test_a_far_not_before_keeps_the_runs_whole_wait_and_the_allowance_of_an_unpeered_request(bench: Bench):
    """Nothing changes for the usual notice: the request stays valid for the run's 3 s and, no peer having reported
    yet, 2 s more (a listener the Relay holds a few seconds still executes it)."""
    bench.deliveries = MemoryDeliveries()
    bench.callback = callback = LostAnswers("WestNO_0")
    a_freeze_seen_only_by_its_dead_vm(bench, timedelta(minutes=15))
    run = bench.run()
    run.work.deliveries = [EVENT]
    act.deliver(run, last_seen=None)
    record = bench.event(EVENT)
    assert record.openRequest is not None
    options = run.options
    valid = options.in_run_delivery + timedelta(seconds=2)
    assert record.openRequest.until == DOC_NOW + valid + options.not_after_tolerance
    assert callback.within == [pytest.approx(options.in_run_delivery.total_seconds(), abs=0.05)]


@pytest.mark.parametrize(
    ("left", "valid"),
    [
        (60.0, 5.0),  # far: as asked
        (8.0, 5.0),  # near, but room enough for the reroute after 5 s
        (5.5, 2.5),  # nearer: room for the reroute
        (3.0, 1.5),  # no room left: never below the shortest validity
        (1.0, 1.5),
    ],
)
def test_a_requests_validity_leaves_room_for_a_reroute_before_not_before(left: float, valid: float):
    tolerance = timedelta(seconds=0.25)
    got = approvals.reroutable_within(
        timedelta(seconds=5), DOC_NOW + timedelta(seconds=left), DOC_NOW, tolerance=tolerance
    )
    assert got == timedelta(seconds=valid)
    assert approvals.reroutable_within(timedelta(seconds=1), DOC_NOW, DOC_NOW, tolerance=tolerance) == timedelta(
        seconds=1
    )  # never longer than asked
    assert approvals.reroutable_within(timedelta(seconds=5), None, DOC_NOW, tolerance=tolerance) == timedelta(seconds=5)
