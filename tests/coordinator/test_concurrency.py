"""Two coordinator instances (separate stores and caches, one table) racing on the same event decide once."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any

from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.state.tables import TableStateStore
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from tests.coordinator.helpers import DOC_NOW, envelope, scheduled_event, vm
from tests.coordinator.runs import batches_at_once, table_coordinator


class InterleavingStore(TableStateStore):
    """Runs ``interleave`` once, right after this instance read its events and before it writes them: the other
    instance commits in between, so this one's write meets a changed ETag."""

    interleave: Callable[[], None] | None = None

    def get_events(self, event_ids: Iterable[str], *, cached: bool = False) -> Any:
        result = super().get_events(event_ids, cached=cached)
        action, self.interleave = self.interleave, None
        if action is not None:
            action()
        return result


def make(azurite: AzuriteEndpoints, imds: ImdsEmulator, table: str, tmp: Any, store_class: type[TableStateStore]):
    return table_coordinator(
        azurite, imds, table, tmp, lambda: DOC_NOW, policy=load_policy(DEFAULT_POLICY_PATH), store_class=store_class
    )


def message(data: dict[str, Any]) -> RawMessage:
    import json

    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


def test_an_interleaved_write_is_refused_by_etag_and_the_event_is_decided_once(azurite, imds, tmp_path):
    table = "race" + uuid.uuid4().hex[:12]
    a, history_a = make(azurite, imds, table, tmp_path / "a", InterleavingStore)
    b, history_b = make(azurite, imds, table, tmp_path / "b", TableStateStore)
    event_id = imds.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900)["EventId"]
    freeze = scheduled_event(event_id)
    from_0 = message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=[freeze]))
    from_1 = message(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=[freeze]))

    assert isinstance(a.parts.store, InterleavingStore)
    a.parts.store.interleave = lambda: b.process_batch([from_1])
    report = a.process_batch([from_0])

    assert report.conflicts >= 1  # A's first write met B's ETag
    decisions = [r for r in history_a.rows + history_b.rows if r.RecordType == "Decision"]
    assert len(decisions) == 1
    assert len([x for x in imds.approvals() if x["EventId"] == event_id]) == 1
    stored = a.event(event_id)
    assert stored is not None
    assert sorted(stored.record.vms) == ["WestNO_0", "WestNO_1"]  # both observations merged, none lost
    assert stored.record.state == "Approved"


def test_two_instances_in_threads_approve_each_event_once(azurite, imds, tmp_path):
    table = "race" + uuid.uuid4().hex[:12]
    a, _ = make(azurite, imds, table, tmp_path / "a", TableStateStore)
    b, _ = make(azurite, imds, table, tmp_path / "b", TableStateStore)
    ids = [
        imds.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"], NoticeSeconds=900)["EventId"]
        for _ in range(4)
    ]
    events = [scheduled_event(i) for i in ids]
    batch_a = [message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=2, events=events))]
    batch_b = [message(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=2, events=events))]
    batches_at_once([(a, batch_a), (b, batch_b)])
    approvals = [x["EventId"] for x in imds.approvals() if x["EventId"] in ids]
    assert sorted(approvals) == sorted(ids)  # each once
    for event_id in ids:
        stored = a.event(event_id)
        assert stored is not None
        assert sorted(stored.record.vms) == ["WestNO_0", "WestNO_1"]


def test_a_vm_moved_by_another_instance_is_redone_from_its_fresh_position(azurite, imds, tmp_path):
    """A partition changes hands: A's cached group still holds WestNO_1 as it was before B moved it. A's derived
    observations would miss that WestNO_1 no longer lists the event; the conflict on the group makes A redo
    WestNO_1 from the fresh position, so the event is seen gone."""
    table = "race" + uuid.uuid4().hex[:12]
    a, _ = make(azurite, imds, table, tmp_path / "a", TableStateStore)
    b, _ = make(azurite, imds, table, tmp_path / "b", TableStateStore)
    west0, west1 = vm("WestNO_0", index=1), vm("WestNO_1", index=2)
    reboot = scheduled_event("EV-MOVED", event_type="Reboot", duration=-1, resources=["WestNO_1"])
    a.process_batch([message(envelope(west0, sequence=1, incarnation=1)), message(envelope(west1, sequence=1))])
    b.process_batch([message(envelope(west1, sequence=2, incarnation=2, events=[reboot]))])

    report = a.process_batch([message(envelope(west1, sequence=3, incarnation=3, events=[]))])

    assert report.conflicts >= 1
    assert report.accepted == 1
    stored = a.event("EV-MOVED")
    assert stored is not None
    assert stored.record.vms["WestNO_1"].status == "Gone"
    assert stored.record.state == "Canceled"
    positions = a.parts.store.get_vm_groups(["pg:avset-westno"])["pg:avset-westno"].record.vms
    assert {vm.identity.name: vm.lastSequence for vm in positions.values()} == {"WestNO_0": 1, "WestNO_1": 3}
