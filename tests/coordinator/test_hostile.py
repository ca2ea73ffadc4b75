"""Hypothesis-generated garbage among good envelopes: every bad message is dead-lettered and counted, every good
one is processed, and nothing carried by a refused message is ever approved."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.alerts import FolderCardSink
from coordinator.direct_callback import DirectImdsCallback
from coordinator.history import MemoryHistory
from coordinator.rules import DEFAULT_POLICY_PATH, load_policy
from coordinator.service import Coordinator, RawMessage
from coordinator.store import TableStateStore
from tests.coordinator.helpers import DOC_NOW, envelope, scheduled_event, vm

# Ways to spoil an envelope that carries an approve-at-once (User) event; each must be refused.
SPOILERS: dict[str, Any] = {
    "schema-v2": lambda e: {**e, "schema": "scheduled-events.envelope/2"},
    "naive-time": lambda e: {**e, "observedAt": datetime(2022, 4, 11, 22, 0).isoformat()},
    "negative-sequence": lambda e: {**e, "sequence": -1},
    "no-document": lambda e: {k: v for k, v in e.items() if k != "document"},
    "bad-status": lambda e: {
        **e,
        "document": {**e["document"], "Events": [{**e["document"]["Events"][0], "EventStatus": "Approved"}]},
    },
    "empty-event-id": lambda e: {
        **e,
        "document": {**e["document"], "Events": [{**e["document"]["Events"][0], "EventId": ""}]},
    },
    "vm-without-id": lambda e: {**e, "vm": {**e["vm"], "vmId": ""}},
    "incarnation-text": lambda e: {**e, "document": {**e["document"], "DocumentIncarnation": "two"}},
}

garbage = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=12,
    ).map(lambda value: json.dumps(value).encode()),
    st.sampled_from(sorted(SPOILERS)),
)


def test_garbage_among_good_envelopes(azurite, imds, tmp_path):
    table = "hostile" + uuid.uuid4().hex[:10]
    store = TableStateStore.from_connection_string(azurite.connection_string, table_name=table)
    history = MemoryHistory()
    coordinator = Coordinator(
        store=store,
        history=history,
        alerts=FolderCardSink(tmp_path / "cards"),
        callback=DirectImdsCallback(base_url=imds.url),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=lambda: DOC_NOW,
    )
    approvals_before = len(imds.approvals())
    totals = {"bad": 0, "good": 0}
    sequence = iter(range(1, 1_000_000))

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(bad=st.lists(garbage, min_size=1, max_size=6), good_count=st.integers(min_value=1, max_value=4))
    def run(bad: list[Any], good_count: int) -> None:
        messages: list[RawMessage] = []
        good_ids = []
        for item in bad:
            if isinstance(item, str):
                # A User event would be approved at once if it got through: it must not.
                user = scheduled_event(str(uuid.uuid4()).upper(), source="User", event_type="Reboot")
                spoiled = SPOILERS[item](envelope(vm("WestNO_0", index=1), sequence=1, incarnation=9, events=[user]))
                body = json.dumps(spoiled).encode()
            else:
                body = item
            messages.append(RawMessage(body=body, partition_key=None))
        for _ in range(good_count):
            event_id = "GOOD-" + uuid.uuid4().hex
            good_ids.append(event_id)
            reboot = scheduled_event(event_id, event_type="Reboot", duration=-1)
            data = envelope(vm("WestNO_1", index=2), sequence=next(sequence), incarnation=3, events=[reboot])
            messages.append(RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower()))
        report = coordinator.process_batch(messages)
        assert report.dead_lettered == len(bad)
        assert report.accepted == good_count
        totals["bad"] += len(bad)
        totals["good"] += good_count
        # Nothing lost: the last good document lists its event (earlier good ones are gone for the VM: each
        # document replaces the previous one).
        assert store.get_event(good_ids[-1]) is not None

    run()
    assert len(store.dead_letters()) == totals["bad"]
    assert len([r for r in history.rows if r.RecordType == "DeadLetter"]) == totals["bad"]
    assert len(imds.approvals()) == approvals_before  # nothing approved on the strength of a refused message
    assert all(r.Outcome != "approve" for r in history.rows if r.RecordType == "Decision")
