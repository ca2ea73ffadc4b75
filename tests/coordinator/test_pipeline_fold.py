"""Fold (coordinator/pipeline/fold.py): each VM's envelopes read against its position, folded into event records
(decided inside the same write) and VM positions; what one VM's envelopes break costs only that VM; duplicates
counted; a VM whose cached position was stale is redone from a fresh read."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

from contracts.envelope import Envelope
from coordinator.domain.model import VIEW_GRACE, VmGroupRecord, VmRecord, VmSighting
from coordinator.domain.observations import VmUpdate
from coordinator.domain.observations import vm_observations as real
from coordinator.pipeline import act, fold, ingest, positions, timer
from coordinator.pipeline.housekeeping import Housekeeping
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.run import Run
from coordinator.state.store import ConcurrencyConflict, Stored
from tests.coordinator.helpers import DOC_NOW, decision_record, envelope, event_record, grid_event, scheduled_event
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import NOT_BEFORE, Bench, identity, message, put_event, put_vm

FREEZE = "EV-FREEZE"


def report(name: str, sequence: int, *events: dict[str, Any], **fields: Any) -> RawMessage:
    """``name``'s forwarder reporting its document (``events``) as envelope ``sequence``."""
    data = envelope(
        identity(name).model_dump(),
        sequence=sequence,
        incarnation=sequence,
        events=list(events),
        observed_at=DOC_NOW + timedelta(seconds=sequence),
    )
    return message({**data, **fields})


def short_freeze(*names: str) -> dict[str, Any]:
    return scheduled_event(FREEZE, resources=list(names or ["WestNO_0", "WestNO_1"]))


def batch(
    bench: Bench, messages: Sequence[RawMessage], channel: ingest.Channel = "vms"
) -> tuple[Run, positions.VmBatch]:
    run = bench.run()
    run.report.received = len(messages)
    updates = fold.fold(run, ingest.read_batch(run, messages, channel))
    return run, updates


def test_a_batch_is_folded_into_events_and_positions_and_decided_inside_the_write(bench: Bench):
    run, updates = batch(bench, [report("WestNO_0", 1, short_freeze()), report("WestNO_1", 1, short_freeze())])
    assert run.stages == ["ingest", "fold", "decide"]
    record = bench.event(FREEZE)
    assert set(record.vms) == {"WestNO_0", "WestNO_1"}
    # Decided in the write that created it: the approval is stored, and this run is the one to send it.
    assert record.approval is not None
    assert record.decision is not None
    assert run.work.deliveries == [FREEZE]
    assert (run.report.accepted, run.report.events_changed, run.report.duplicates) == (2, 1, 0)
    assert bench.vm("WestNO_0").lastSequence == 1
    assert bench.vm("WestNO_0").listed == [FREEZE]
    assert updates.new_vms == {identity("WestNO_0").vmId.lower(), identity("WestNO_1").vmId.lower()}

    _, again = batch(bench, [report("WestNO_0", 2, short_freeze())])
    assert again.new_vms == set()


class LostAnswer(MemoryStateStore):
    """The first events write lands, and its answer is lost: the caller sees a conflict, as a timed-out insert
    retried by the Table SDK is refused "already exists" (its first try had landed)."""

    lost = True

    def save_events(self, items: Any, **kw: Any) -> list[str]:
        etags = super().save_events(items, **kw)
        if self.lost:
            self.lost = False
            raise ConcurrencyConflict("EntityAlreadyExists (the first try landed; its answer was lost)")
        return etags


def test_an_approval_whose_deciding_write_landed_unseen_is_still_sent_by_its_run():
    """Oracle seed 56 (e1): the run retried the write, re-read the event, found its own approval there and took it
    for another run's in flight: no Decision row, nothing sent, and the timer's 90 s grace outlived the notice."""
    bench = Bench(store=LostAnswer())
    run, _ = batch(bench, [report("WestNO_0", 1, short_freeze())])
    record = bench.event(FREEZE)
    assert record.approval is not None
    assert record.decision is not None
    assert run.work.deliveries == [FREEZE]
    decisions = [r for r in run.work.rows if r.RecordType == "Decision"]
    assert [(r.DecisionId, r.Outcome) for r in decisions] == [(record.approval.decisionId, "approve")]
    act.deliver(run, last_seen=None)
    assert bench.callback.vms == ["WestNO_0"]
    assert bench.event(FREEZE).state == "Approved"


def test_duplicates_are_counted_and_not_applied_twice(bench: Bench):
    first = report("WestNO_0", 1, short_freeze("WestNO_0"))
    run, _ = batch(bench, [first, first])
    assert (run.report.accepted, run.report.duplicates) == (1, 1)
    replay, _ = batch(bench, [first])  # the partition replayed after a restart
    assert (replay.report.accepted, replay.report.duplicates, replay.report.events_changed) == (0, 1, 0)
    assert replay.work.deliveries == []


def test_a_vm_whose_envelopes_cannot_be_read_is_dead_lettered_and_the_others_go_on(bench: Bench, monkeypatch):
    broken = identity("WestNO_1").vmId

    def vm_observations(
        previous: VmRecord | None, envelopes: Iterable[Envelope], *, heard_at: Sequence[datetime]
    ) -> VmUpdate:
        ordered = list(envelopes)
        if ordered[0].vm.vmId == broken:
            raise RuntimeError("a position this code cannot read")
        return real(previous, ordered, heard_at=heard_at)

    monkeypatch.setattr(positions, "vm_observations", vm_observations)
    messages = [
        report("WestNO_0", 1, short_freeze()),
        report("WestNO_1", 1, short_freeze()),
        report("WestNO_1", 2, short_freeze()),
        RawMessage(body=b"{not json", partition_key="nobody"),
    ]
    run, updates = batch(bench, messages)

    assert run.report.dead_lettered == 3  # both of WestNO_1's messages, and the one ingest refused
    letters = bench.store.dead_letters()
    assert len(letters) == 3
    reasons = [r.Reason for r in run.work.rows if r.RecordType == "DeadLetter"]
    assert reasons.count("processing failed: RuntimeError: a position this code cannot read") == 2
    assert updates.failed == {broken.lower(): "RuntimeError: a position this code cannot read"}
    # WestNO_0 went on: its sighting, its position. WestNO_1's position did not move.
    assert set(bench.event(FREEZE).vms) == {"WestNO_0"}
    assert bench.vm("WestNO_0").lastSequence == 1
    assert bench.store.get_vm_groups(["pg:avset-westno"])["pg:avset-westno"].record.vms.keys() == {
        identity("WestNO_0").vmId.lower()
    }


def test_a_vm_back_from_silence_resumes_with_a_row(bench: Bench):
    put_vm(bench.store, "WestNO_0", last_seen=DOC_NOW - timedelta(minutes=10), heartbeatLost=True)
    run, updates = batch(bench, [report("WestNO_0", 2)])
    assert [(r.RecordType, r.Outcome) for r in run.work.rows] == [("Heartbeat", "resumed")]
    assert updates.updates[identity("WestNO_0").vmId.lower()].resumed
    assert not bench.vm("WestNO_0").heartbeatLost


def test_a_heartbeat_showing_imds_failing_raises_the_vms_card(bench: Bench):
    health = {"lastGoodPollAt": (DOC_NOW - timedelta(minutes=5)).isoformat(), "consecutivePollErrors": 300}
    beat = envelope(identity("WestNO_0").model_dump(), sequence=1, kind="heartbeat", observed_at=DOC_NOW)
    run, _ = batch(bench, [message({**beat, "health": health})])
    assert [(vm.identity.name, kind) for vm, kind in run.work.vm_alerts] == [("WestNO_0", "imds-failing")]
    stored = bench.vm("WestNO_0")
    assert stored.imdsFailing is not None
    assert stored.pendingAlerts == ["imds-failing"]


def test_event_grid_sightings_of_an_unknown_vm_make_it_agentless_and_repeats_count_as_duplicates(bench: Bench):
    event = grid_event(FREEZE, resources=["web_0"])
    run, _ = batch(bench, [message_of(event), message_of([event])], "platform")
    assert (run.report.accepted, run.report.duplicates) == (1, 1)
    record = bench.event(FREEZE)
    assert list(record.vms) == ["web_0"]
    sighting = record.vms["web_0"]
    assert sighting.vmId.startswith("arm-")
    [group] = bench.store.all_vm_groups()
    assert [vm.agentless for vm in group.record.vms.values()] == [True]


def message_of(body: Any) -> RawMessage:
    """A message Event Grid routed to its hub: no partition key of a VM."""
    return RawMessage(body=json.dumps(body).encode())


class StaleCacheStore(MemoryStateStore):
    """Answers a cached read of a VM group with ``cache`` when it holds the group: an instance whose cache is
    behind, because another instance took over the VMs' partition and wrote meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, Stored[VmGroupRecord]] = {}

    def get_vm_groups(self, keys: Iterable[str], *, cached: bool = False) -> dict[str, Stored[VmGroupRecord]]:
        fresh = super().get_vm_groups(keys)
        return {key: self.cache.get(key, stored) for key, stored in fresh.items()} if cached else fresh


@pytest.mark.parametrize("stale", [True, False])
def test_a_vm_whose_cached_position_was_stale_is_redone_from_a_fresh_read(stale):
    store = StaleCacheStore()
    bench = Bench(store=store)
    reboot = scheduled_event("EV-R", event_type="Reboot", resources=["WestNO_0"], duration=-1)
    batch(bench, [report("WestNO_0", 1)])  # listed nothing
    cached = {group.record.group: group for group in store.all_vm_groups()}
    batch(bench, [report("WestNO_0", 2, reboot)])  # another instance: the Reboot is listed
    assert bench.event("EV-R").state == "Scheduled"

    if stale:
        store.cache = cached  # this instance still holds the position from before the Reboot
    run, _ = batch(bench, [report("WestNO_0", 3)])  # listed nothing: the Reboot is gone for WestNO_0

    # Read against the stale position the envelope says nothing of the Reboot; redone against the fresh one it
    # says it is gone, and the event (gone from its only VM without starting) is canceled.
    assert bench.event("EV-R").state == "Canceled"
    assert bench.vm("WestNO_0").lastSequence == 3
    assert run.report.accepted == 1
    assert (run.report.conflicts > 0) is stale


def test_a_stale_vms_sighting_is_written_once_as_redone_not_also_as_first_derived():
    """A VM's sightings are stored with its position; redone from a fresh read, its rows are derived again. The
    first pass's rows went too: kept, the 'gone' was written twice, once with the event's state as the stale
    position had it (a kill test found the doubled rows in the history)."""
    store = StaleCacheStore()
    bench = Bench(store=store)
    reboot = scheduled_event("EV-R", event_type="Reboot", resources=["WestNO_0"], duration=-1)
    batch(bench, [report("WestNO_0", 1, reboot)])
    cached = {group.record.group: group for group in store.all_vm_groups()}
    batch(bench, [report("WestNO_0", 2, reboot)])  # another instance: the same document again
    store.cache = cached  # this instance still holds the position from before it

    run, _ = batch(bench, [report("WestNO_0", 3)])  # listed nothing: the Reboot is gone for WestNO_0

    assert run.report.conflicts > 0
    assert bench.event("EV-R").state == "Canceled"
    staged = [row for entry in run.work.staged for row in entry.rows]
    gone = [(row.State, row.Sequence) for row in staged if row.RecordType == "Observation"]
    assert gone == [("Canceled", 3)]
    assert sorted(row.RecordType for row in run.work.rows) == ["Observation", "Transition"]


def test_one_envelope_folded_by_two_instances_is_one_row_of_what_the_vm_said():
    """A partition handed over while its last batch was in flight: the new owner folds the same envelope a second
    later, from a cached position the old owner has since moved to that envelope. Both derive the VM's rows (the
    new owner's write of the position is set aside, its rows are not: they may be its own lost-answer attempt's);
    what the VM said is one fact, so both runs' rows of it carry one RecordId (two rows before, at two ``now``)."""
    store = StaleCacheStore()
    bench = Bench(store=store)
    reboot = scheduled_event("EV-R", event_type="Reboot", resources=["WestNO_0"], duration=-1)
    batch(bench, [report("WestNO_0", 1, reboot)])
    store.cache = {group.record.group: group for group in store.all_vm_groups()}  # the new owner's, from before
    gone = report("WestNO_0", 2)  # listed nothing: the Reboot is gone for WestNO_0
    old_owner, _ = batch(bench, [gone])
    bench.now = DOC_NOW + timedelta(seconds=1)
    new_owner, _ = batch(bench, [gone])

    def said(run: Run) -> list[tuple[str, datetime, int | None]]:
        return [(r.RecordId, r.TimeGenerated, r.Sequence) for r in run.work.rows if r.RecordType == "Observation"]

    first, second = said(old_owner), said(new_owner)
    assert [sequence for _, _, sequence in first + second] == [2, 2]
    assert first[0][1] != second[0][1], "two runs at two `now`"
    assert first[0][0] == second[0][0]


def test_a_vm_whose_clock_runs_six_minutes_slow_is_fresh_by_the_enqueued_time_and_executes(bench: Bench):
    """Freshness is the service's clock (the message's Event Hubs enqueued time), not the VM's observedAt: a VM
    whose clock runs 6 minutes slow, past the 5-minute heartbeat timeout, was judged silent, its approval had no
    executor and its event expired (issue 22)."""
    slow = DOC_NOW - timedelta(minutes=6)
    events = [short_freeze("WestNO_0")]
    data = envelope(identity("WestNO_0").model_dump(), sequence=1, incarnation=1, events=events, observed_at=slow)
    enqueued = RawMessage(
        body=json.dumps(data).encode(), partition_key=identity("WestNO_0").resourceId.lower(), enqueued_time=DOC_NOW
    )
    run, _ = batch(bench, [enqueued])

    assert bench.vm("WestNO_0").lastSeen == DOC_NOW
    assert bench.event(FREEZE).vms["WestNO_0"].lastSeen == DOC_NOW
    # What the VM said stays in the history as it said it.
    (row,) = [r for r in run.work.rows if r.RecordType == "Observation"]
    assert row.ObservedAt == slow
    act.deliver(run, last_seen=None)
    assert bench.callback.vms == ["WestNO_0"]
    assert bench.event(FREEZE).state == "Approved"


class Interleaved(MemoryStateStore):
    """Runs ``between`` once, just before this run's first write of ``before`` ("save_events": after its reads;
    "save_vm_groups": after its events' write, before its VM positions'): another run's work at that moment (two
    partitions' runs of one instance side by side)."""

    between: Any = None
    before = "save_events"

    def _interleave(self, write: str) -> None:
        if write == self.before:
            action, self.between = self.between, None
            if action is not None:
                action()

    def save_events(self, items: Any, **kw: Any) -> list[str]:
        self._interleave("save_events")
        return super().save_events(items, **kw)

    def save_vm_groups(self, items: Any, **kw: Any) -> list[str]:
        self._interleave("save_vm_groups")
        return super().save_vm_groups(items, **kw)


def hooked(name: str, event_id: str) -> RawMessage:
    """``name``'s forwarder reporting that its prepare hook for ``event_id`` succeeded."""
    hook = {"eventId": event_id, "phase": "prepare", "outcome": "succeeded", "durationSeconds": 2.0, "steps": []}
    data = envelope(
        identity(name, scale_set="web").model_dump(),
        sequence=2,
        kind="hook",
        hook=hook,
        observed_at=DOC_NOW + timedelta(seconds=2),
    )
    return message(data)


def test_sibling_deletes_ready_in_runs_side_by_side_are_approved_together():
    """The fleet demo's lost scale-in-2: web_1's and web_3's hooks succeed in two runs at once. Each decides its
    delete before the other's hook is in a VM position, so each holds its own by the other (and neither sees the
    other held, so ``release_held`` has nothing to release); the later run, reading its scale set again once its
    positions are written, approves both."""
    bench = Bench(store=Interleaved())
    store = bench.store
    assert isinstance(store, Interleaved)
    for name in ("web_1", "web_3"):
        put_event(store, f"EV-{name}", vms=(name,), scale_set="web", eventType="Terminate", notBefore=NOT_BEFORE)
    first, second = bench.run(), bench.run()
    store.between = lambda: fold.fold(second, ingest.read_batch(second, [hooked("web_3", "EV-web_3")], "vms"))
    fold.fold(first, ingest.read_batch(first, [hooked("web_1", "EV-web_1")], "vms"))
    for name in ("web_1", "web_3"):
        record = bench.event(f"EV-{name}")
        assert record.vms[name].hooks["prepare"] == "succeeded"
        assert record.decision is not None
        assert (record.decision.verdict, record.decision.heldBy) == ("approve", ""), record.decision.reason
        assert record.approval is not None
    # The second run held its delete by the first's; the first approved both and sent both, each through its VM.
    rows = [(r.EventId, r.Outcome) for r in second.work.rows + first.work.rows if r.RecordType == "Decision"]
    assert rows == [("EV-web_3", "wait"), ("EV-web_1", "wait"), ("EV-web_1", "approve"), ("EV-web_3", "approve")]
    assert sorted(first.work.deliveries) == ["EV-web_1", "EV-web_3"]
    assert sorted(vm.name for _, vm in bench.callback.sent) == ["web_1", "web_3"]


def test_a_run_reading_a_position_a_batch_has_not_written_yet_does_not_take_back_the_batchs_decision():
    """The people-browser fixture's flip: a batch decided web_1's delete ready (its hook succeeded; held only by
    web_3's delete) and wrote it; a tick read it before the batch wrote web_1's position, decided from web_1's older
    sighting (hooks not yet run) and wrote 'hooks' over 'delete'. A decision is never replaced by one taken from an
    older view of its VMs than its own."""
    bench = Bench(store=Interleaved())
    store = bench.store
    assert isinstance(store, Interleaved)
    store.before = "save_vm_groups"
    for name in ("web_1", "web_3"):
        put_event(store, f"EV-{name}", vms=(name,), scale_set="web", eventType="Terminate", notBefore=NOT_BEFORE)
    timer.tick(bench.run("tick"), Housekeeping())
    assert bench.event("EV-web_1").decision is not None
    assert bench.event("EV-web_1").decision.holdKind == "hooks"  # type: ignore[union-attr]
    ticks: list[Run] = []

    def a_tick() -> None:
        ticks.append(bench.run("tick"))
        timer.tick(ticks[-1], Housekeeping())

    store.between = a_tick
    run = bench.run()
    fold.fold(run, ingest.read_batch(run, [hooked("web_1", "EV-web_1")], "vms"))
    assert ticks, "the tick ran between the batch's two writes"
    record = bench.event("EV-web_1")
    assert record.vms["web_1"].hooks["prepare"] == "succeeded"
    assert record.decision is not None
    assert (record.decision.holdKind, record.decision.heldBy) == ("delete", "EV-web_3"), record.decision.reason
    assert [r.EventId for r in ticks[0].work.rows if r.RecordType == "Decision"] == []
    # Once the position is written, a tick decides from it as the batch did: nothing changes.
    timer.tick(bench.run("tick"), Housekeeping())
    assert bench.event("EV-web_1").decision == record.decision


def test_two_vms_hooks_folded_side_by_side_approve_their_event_without_waiting_for_the_timer():
    """One delete naming two VMs, each VM's hook report in its own batch: the second batch runs whole
    between the first's event write and its positions' write. Neither decided from both hooks (each read the
    other's older sighting); the first, re-deciding once its positions are written, approves."""
    bench = Bench(store=Interleaved())
    store = bench.store
    assert isinstance(store, Interleaved)
    store.before = "save_vm_groups"
    put_event(
        store, "EV-SCALE-IN", vms=("web_1", "web_2"), scale_set="web", eventType="Terminate", notBefore=NOT_BEFORE
    )
    timer.tick(bench.run("tick"), Housekeeping())
    assert bench.event("EV-SCALE-IN").decision is not None
    first, second = bench.run(), bench.run()
    store.between = lambda: fold.fold(second, ingest.read_batch(second, [hooked("web_2", "EV-SCALE-IN")], "vms"))
    fold.fold(first, ingest.read_batch(first, [hooked("web_1", "EV-SCALE-IN")], "vms"))
    assert store.between is None, "the second batch ran between the first's two writes"
    record = bench.event("EV-SCALE-IN")
    assert {name: s.hooks.get("prepare") for name, s in record.vms.items()} == {
        "web_1": "succeeded",
        "web_2": "succeeded",
    }
    assert record.decision is not None
    assert record.decision.verdict == "approve", record.decision.reason
    assert record.approval is not None
    assert [vm.name for _, vm in bench.callback.sent] in (["web_1"], ["web_2"])


def test_a_decisions_view_outranks_an_older_read_for_a_while_only():
    """A position that was never written (contended past its retries, too large to store) leaves the stored
    sighting older than the view of the decision taken with it: that holds the decision back only for VIEW_GRACE."""
    vm_id = identity("web_1").vmId
    sighting = VmSighting(
        name="web_1", vmId=vm_id, firstSeen=DOC_NOW, lastSeen=DOC_NOW, lastSequence=3, status="Scheduled"
    )
    decision = decision_record(viewed={vm_id.lower(): (0, 5)})
    record = event_record("EV-1", vms={"web_1": sighting}, decision=decision)
    assert record.older_view(DOC_NOW + timedelta(seconds=1)) == "web_1"
    assert record.older_view(DOC_NOW + VIEW_GRACE) == ""
    caught_up = sighting.model_copy(update={"hookSequence": 5})
    assert record.model_copy(update={"vms": {"web_1": caught_up}}).older_view(DOC_NOW) == ""


def test_a_batch_that_brings_no_hook_report_reads_nothing_again(monkeypatch: pytest.MonkeyPatch):
    """A run that brought no hook report decided nothing new about hooks: a wave of deletes whose VMs report none
    (benchmarks.wave --event-type Terminate) read every event again, 3x the wave's time, until this held."""
    bench = Bench()
    put_event(bench.store, "EV-SCALE-IN", vms=("web_1", "web_2"), scale_set="web", eventType="Terminate")
    timer.tick(bench.run("tick"), Housekeeping())
    fresh: list[str] = []
    read = bench.store.get_events

    def noted(event_ids: Any, *, cached: bool = False) -> Any:
        if not cached:
            fresh.extend(event_ids)
        return read(event_ids, cached=cached)

    monkeypatch.setattr(bench.store, "get_events", noted)
    listed = scheduled_event("EV-SCALE-IN", event_type="Terminate", resources=["web_1", "web_2"])
    data = envelope(identity("web_2", scale_set="web").model_dump(), sequence=2, incarnation=2, events=[listed])
    run = bench.run()
    fold.fold(run, ingest.read_batch(run, [message(data)], "vms"))
    assert list(run.work.records) == ["EV-SCALE-IN"]  # the batch wrote it
    assert fresh == []
    run = bench.run()
    fold.fold(run, ingest.read_batch(run, [hooked("web_1", "EV-SCALE-IN")], "vms"))
    assert fresh == ["EV-SCALE-IN"]  # a hook report: read again once its position is written
