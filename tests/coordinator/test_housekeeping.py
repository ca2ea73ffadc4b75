"""Housekeeping removes what no longer counts: the positions of VMs retired longer than RETIRED_RETENTION (a group
left with none goes), and the budget entities no claim holds; a backlog larger than one run goes on at the next
tick. On the in-memory store (tests/coordinator/memory_store.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.claims import BudgetClaim, BudgetRecord
from coordinator.domain.model import Retirement, VmGroupRecord, VmRecord
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.pipeline import housekeeping
from coordinator.service import Coordinator
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, event_record, vm_position
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import make_coordinator


class Refusing:
    """No approval is expected here."""

    def send(self, *_: object, **__: object) -> object:
        raise AssertionError("nothing to approve")


def retired(name: str, index: int, *, days: float) -> VmRecord:
    at = DOC_NOW - timedelta(days=days)
    return vm_position(
        name, index=index, lastSeen=at, retired=Retirement(eventId="EV-GONE", eventType="Terminate", at=at)
    )


def group(key: str, *vms: VmRecord) -> VmGroupRecord:
    return VmGroupRecord(group=key, vms={vm.identity.vmId.lower(): vm for vm in vms})


def coordinator(store: MemoryStateStore, tmp_path: Path, clock: Clock) -> Coordinator:
    return make_coordinator(
        store=store,
        history=MemoryHistory(),
        alerts=FolderCardSink(tmp_path),
        callback=Refusing(),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=clock,
    )


def test_retired_vms_past_the_retention_and_spent_budgets_are_removed(tmp_path):
    store = MemoryStateStore()
    live = vm_position("web_0", index=1)
    store.save_vm_group(group("pg:web", live, retired("web_1", 2, days=8), retired("web_2", 3, days=1)), None)
    store.save_vm_group(group("pg:old", retired("old_0", 4, days=30)), None)
    store.save_budget(BudgetRecord(scaleSet="web"), None)
    claim = BudgetClaim(eventId="EV-HELD", vms=["web_0"], claimedAt=DOC_NOW - timedelta(hours=1))
    store.save_event(event_record("EV-HELD", state="Approved"), None)
    store.save_budget(BudgetRecord(scaleSet="zone:westeurope/1", claims={"EV-HELD": claim}), None)

    report = coordinator(store, tmp_path, Clock(DOC_NOW)).tick()

    assert (report.vms_purged, report.budgets_purged) == (2, 1)
    kept = store.get_vm_groups(["pg:web", "pg:old"])
    assert list(kept) == ["pg:web"]  # the group left with no VM is gone
    assert sorted(vm.identity.name for vm in kept["pg:web"].record.vms.values()) == ["web_0", "web_2"]
    assert [s.record.scaleSet for s in store.budgets()] == ["zone:westeurope/1"]  # its claim's event holds it


def test_a_backlog_is_taken_up_by_the_next_ticks(tmp_path, monkeypatch):
    monkeypatch.setattr(housekeeping, "PURGE_GROUPS_PER_RUN", 2)
    store = MemoryStateStore()
    for n in range(5):
        store.save_vm_group(group(f"pg:{n}", retired(f"vm_{n}", n + 1, days=10)), None)
    clock = Clock(DOC_NOW)
    instance = coordinator(store, tmp_path, clock)

    purged = []
    for _ in range(3):
        purged.append(instance.tick().vms_purged)
        clock.now += timedelta(minutes=1)  # within the hour: only the backlog makes housekeeping run again

    assert purged == [2, 2, 1]
    assert store.all_vm_groups() == []
