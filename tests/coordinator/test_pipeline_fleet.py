"""The fleet as one run sees it (coordinator/pipeline/fleet.py): the view budget rules read, the deletes and the
VMs leaving as the run changes them, and budget claims that hold fleet-wide (all domains or none, a lease for a
claim whose approval never came)."""

from __future__ import annotations

from datetime import timedelta

from coordinator.domain.budgets import BudgetDomain
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.model import (
    ApprovalRecord,
    DecisionRecord,
    Retirement,
    VmRecord,
)
from coordinator.pipeline.budget_claims import CLAIM_LEASE
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.fleet_cache import by_not_before
from coordinator.state.commit import COMMIT_ATTEMPTS
from coordinator.state.store import ConcurrencyConflict
from tests.coordinator.helpers import DOC_NOW, event_record
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import NOT_BEFORE, identity, put_event, put_vm

APPROVAL = ApprovalRecord(decisionId="d", rule="r", actor="rule:r", decidedAt=DOC_NOW)


def domain(key: str, *vms: str, limit: int = 1, kind: str = "scaleSet") -> BudgetDomain:
    return BudgetDomain(kind, key, frozenset(vms), frozenset(), 4, limit)  # type: ignore[arg-type]


def claims(store: MemoryStateStore, key: str) -> list[str]:
    stored = store.get_budget(key)
    return sorted(stored.record.claims) if stored else []


def test_a_claim_takes_a_slot_in_every_domain_and_is_taken_once():
    store = MemoryStateStore()
    fleet = Fleet(store)
    record = event_record("EV-1", resources=["web_0"])
    domains = [domain("web", "web_0"), domain("1", "web_0", kind="zone")]
    assert fleet.budgets.claim(record, domains, DOC_NOW) == ("", "")
    assert claims(store, "web") == claims(store, "zone:1") == ["EV-1"]
    # Claimed again (a decision redone after a conflict): nothing more taken, nothing refused.
    assert fleet.budgets.claim(record, domains, DOC_NOW) == ("", "")


def test_a_claim_refused_in_one_domain_takes_none():
    store = MemoryStateStore()
    other = BudgetClaim(eventId="EV-OTHER", vms=["web_9"], claimedAt=DOC_NOW)
    store.save_budget(BudgetRecord(scaleSet="zone:1", claims={"EV-OTHER": other}), None)
    fleet = Fleet(store)
    refused, where = fleet.budgets.claim(
        event_record("EV-1"), [domain("web", "web_0"), domain("1", "web_0", kind="zone")], DOC_NOW
    )
    assert where == "zone:1"
    assert refused == "zone '1' would have 2 impacted instances (limit 1); held fleet-wide by EV-OTHER"
    # All or none: the scale set's slot is not taken either.
    assert claims(store, "web") == []


def test_an_old_claim_counts_only_while_its_event_holds_an_approval():
    store = MemoryStateStore()
    old = DOC_NOW - CLAIM_LEASE - timedelta(seconds=1)
    put_event(store, "EV-HOLDING", vms=("web_1",), scale_set="web", approval=APPROVAL)
    put_event(store, "EV-CRASHED", vms=("web_2",), scale_set="web")  # claimed, then the instance died
    held = {
        event_id: BudgetClaim(eventId=event_id, vms=[vm], claimedAt=old)
        for event_id, vm in (("EV-HOLDING", "web_1"), ("EV-CRASHED", "web_2"))
    }
    store.save_budget(BudgetRecord(scaleSet="web", claims=held), None)
    fleet = Fleet(store)
    assert fleet.budgets.claim(event_record("EV-1"), [domain("web", "web_0", limit=2)], DOC_NOW) == ("", "")
    # The lapsed claim is dropped as the budget is written again; the live one stays.
    assert claims(store, "web") == ["EV-1", "EV-HOLDING"]


def test_a_claim_contended_every_time_is_refused_for_the_timer_to_retry():
    class Contended(MemoryStateStore):
        def save_budget(self, record: BudgetRecord, etag: str | None) -> str:
            raise ConcurrencyConflict("another instance")

    refused, where = Fleet(Contended()).budgets.claim(event_record("EV-1"), [domain("web", "web_0")], DOC_NOW)
    assert (refused, where) == (f"budget 'web': contended for {COMMIT_ATTEMPTS} attempts; retried by the timer", "web")


def test_release_gives_back_one_events_slot():
    store = MemoryStateStore()
    fleet = Fleet(store)
    fleet.budgets.claim(event_record("EV-1"), [domain("web", "web_0", limit=2)], DOC_NOW)
    fleet.budgets.claim(event_record("EV-2"), [domain("web", "web_1", limit=2)], DOC_NOW)
    fleet.budgets.release("web", "EV-1")
    fleet.budgets.release("web", "EV-NEVER")  # nothing to give back: no write
    fleet.budgets.release("nowhere", "EV-1")
    assert claims(store, "web") == ["EV-2"]


def test_the_view_counts_events_holding_budget_and_those_queued_for_it():
    store = MemoryStateStore()
    put_event(store, "EV-APPROVED", vms=("web_0",), scale_set="web", state="Approved")
    budget_wait = DecisionRecord(
        decisionId="d", rule="r", action="approve-within-budget", verdict="wait", reason="full", decidedAt=DOC_NOW,
        holdKind="budget",
    )  # fmt: skip
    put_event(store, "EV-QUEUED", vms=("web_1",), scale_set="web", notBefore=NOT_BEFORE, decision=budget_wait)
    put_event(store, "EV-PERSON", vms=("web_2",), scale_set="web")
    view = Fleet(store).view()
    assert view.impacted == {"web": frozenset({"web_0"})}
    assert view.queued == ((NOT_BEFORE, "EV-QUEUED", frozenset({"web_1"})),)
    assert set(view.vms) == {"web_0", "web_1", "web_2"}
    assert Fleet(store).view(census=False).vms == {}


def test_the_census_leaves_out_retired_vms_and_takes_this_batchs_reports():
    store = MemoryStateStore()
    put_vm(store, "web_0", scale_set="web")
    gone = Retirement(eventId="EV-DEL", eventType="Terminate", at=DOC_NOW)
    put_vm(store, "web_1", scale_set="web", retired=gone)
    fleet = Fleet(store)
    assert set(fleet.view().vms) == {"web_0"}
    # A new VM's first envelope in this batch: its position is written after its event is decided.
    new = VmRecord(
        identity=identity("web_7", scale_set="web").model_copy(update={"tags": {"tier": "db"}}), lastSeen=DOC_NOW
    )
    fleet.note_vms([new])
    assert fleet.view().vms["web_7"].tags == {"tier": "db"}


def test_deletes_and_leaving_vms_follow_what_the_run_decided():
    store = MemoryStateStore()
    put_event(store, "EV-DEL", vms=("web_0",), scale_set="web", eventType="Terminate", notBefore=NOT_BEFORE)
    fleet = Fleet(store)
    assert [r.eventId for r in fleet.deletes_of(["web"])] == ["EV-DEL"]
    assert fleet.leaving(DOC_NOW) == {}
    # This run decided to approve the delete: web_0 is leaving from that write on.
    decided = fleet.deletes_of(["web"])[0].model_copy(update={"approval": APPROVAL})
    fleet.note(decided)
    assert fleet.leaving(DOC_NOW) == {"web_0": "EV-DEL"}
    assert fleet.deletes_of(["web"])[0].approval == APPROVAL


def test_busy_vms_are_those_another_open_event_holds_as_stored_and_as_the_run_decided():
    store = MemoryStateStore()
    running = put_event(store, "EV-RUNNING", vms=("web_0",), state="Started")
    waiting = put_event(store, "EV-WAITING", vms=("web_1",))
    put_event(store, "EV-MINE", vms=("web_0", "web_1", "web_2"))
    fleet = Fleet(store)
    assert fleet.busy(["web_0", "web_1", "web_2"], "EV-MINE") == {"web_0"}
    # The event's own approval never makes its VMs busy for itself.
    assert fleet.busy(["web_0"], "EV-RUNNING") == set()
    # This run approved EV-WAITING: web_1 is busy from that write on; then it concluded: web_0 is free.
    fleet.note(waiting.model_copy(update={"approval": APPROVAL}))
    assert fleet.busy(["web_0", "web_1", "web_2"], "EV-MINE") == {"web_0", "web_1"}
    concluded = running.model_copy(update={"state": "Completed", "revision": running.revision + 1})
    fleet.note(concluded)
    assert fleet.busy(["web_0", "web_1", "web_2"], "EV-MINE") == {"web_1"}
    # The instance's cache lets it go too, for the runs after this one.
    assert fleet.cache.holding_of(["web_0"]) == {"web_0": {"EV-RUNNING"}}
    fleet.cache.absorb([concluded])
    assert fleet.cache.holding_of(["web_0", "web_1"]) == {}


def test_held_in_names_the_pending_deletes_of_those_scale_sets_held_by_another():
    store = MemoryStateStore()
    held = DecisionRecord(
        decisionId="d", rule="r", action="approve-now", verdict="wait", reason="held", decidedAt=DOC_NOW,
        heldBy="EV-T0",
    )  # fmt: skip
    put_event(store, "EV-T0", vms=("web_0",), scale_set="web", eventType="Terminate")
    put_event(store, "EV-T1", vms=("web_1",), scale_set="web", eventType="Terminate", decision=held)
    put_event(store, "EV-T2", vms=("api_0",), scale_set="api", eventType="Terminate", decision=held)
    fleet = Fleet(store)
    assert fleet.held_in(["web"], DOC_NOW) == ["EV-T1"]
    assert fleet.held_in([], DOC_NOW) == []


def test_events_compete_closest_to_not_before_first_and_those_without_one_last():
    records = [
        event_record("EV-B", notBefore=NOT_BEFORE),
        event_record("EV-C"),
        event_record("EV-A", notBefore=NOT_BEFORE),
        event_record("EV-D", notBefore=DOC_NOW),
    ]
    assert [r.eventId for r in sorted(records, key=by_not_before)] == ["EV-D", "EV-A", "EV-B", "EV-C"]
