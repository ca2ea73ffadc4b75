"""Judges a local run's history for durability (issue 33): every row the run must have is there once. Read at rest
(``at_rest``: every envelope the hub holds consumed and checkpointed, the outbox empty, no card pending), against
what the run truly did: the envelopes the forwarders stored in the hub, the approvals the IMDS emulator accepted,
the event records the coordinator stored, the cards it wrote. Nothing here writes to the pipeline.
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from azure.storage.blob import BlobServiceClient

from coordinator import TableStateStore
from local.observe import TABLE, cards_written, logged_sightings, sent_envelopes, sent_facts
from local.runner import AZURITE_BLOB_API_VERSION
from local.stack import HUB, LocalStack

CHECKPOINTS = "azure-webjobs-eventhub"  # local.runner.FunctionHost's container, as the Functions host names it
# One fact per key: a second row with the same key under another RecordId is the fact written twice.
FACT_KEYS: dict[str, tuple[str, ...]] = {
    "Observation": ("VmName", "EventId", "EventStatus", "Sequence", "DocumentIncarnation", "Outcome"),
    "Transition": ("EventId", "PreviousState", "State", "DecisionId"),
    "Decision": ("EventId", "DecisionId", "Action", "HoldKind", "HoldName"),
    # An intent (``sending``) is one per send: a decision continued from the delivery queue is sent, and intended,
    # again (labelled "attempt 1" again), so only the answers are one per decision and VM.
    "Approval": ("EventId", "DecisionId", "Outcome", "VmName"),
    "Alert": ("EventId", "VmId", "Action", "Outcome"),
    "Impact": ("EventId", "VmName", "ImpactMeasure"),
}


@dataclass
class KillVerdict:
    seed: int
    kills: int
    rows: int
    doubled: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    # Approvals IMDS accepted whose decision has only its Decision and intent rows: the listener's answer died with
    # the instance awaiting it and no later run recorded an outcome (no row was made to lose; reported, not a loss).
    unanswered: list[str] = field(default_factory=list)
    approvals: int = 0
    events: int = 0
    approved_twice: list[str] = field(default_factory=list)
    never_approved: list[str] = field(default_factory=list)
    # What kept the run from coming to rest before it was judged (nothing when it did).
    unsettled: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"seed {self.seed}: kills {self.kills}, rows {self.rows}, lost {len(self.lost)}, doubled "
            f"{len(self.doubled)}, approvals {self.approvals} for {self.events} events (twice "
            f"{len(self.approved_twice)}, never {len(self.never_approved)})"
            + f", unanswered {len(self.unanswered)}"
            + (f", unsettled {len(self.unsettled)}" if self.unsettled else "")
        )

    def problems(self) -> list[str]:
        return (
            [f"lost: {item}" for item in self.lost]
            + [f"doubled: {item}" for item in self.doubled]
            + [f"approved twice: {item}" for item in self.approved_twice]
            + [f"never approved: {item}" for item in self.never_approved]
            + [f"unsettled: {item}" for item in self.unsettled]
        )

    @staticmethod
    def total(verdicts: list[KillVerdict]) -> str:
        return (
            f"total: runs {len(verdicts)}, kills {sum(v.kills for v in verdicts)}, rows {sum(v.rows for v in verdicts)}"
            f", lost {sum(len(v.lost) for v in verdicts)}, doubled {sum(len(v.doubled) for v in verdicts)}, "
            f"approvals {sum(v.approvals for v in verdicts)} for {sum(v.events for v in verdicts)} events, "
            f"approved twice {sum(len(v.approved_twice) for v in verdicts)}, "
            f"never {sum(len(v.never_approved) for v in verdicts)}, "
            f"unanswered {sum(len(v.unanswered) for v in verdicts)}, "
            f"unsettled runs {sum(1 for v in verdicts if v.unsettled)}"
        )


def _store(stack: LocalStack) -> TableStateStore:
    assert stack.storage is not None
    return TableStateStore.from_connection_string(stack.storage.connection_string, table_name="scheduledevents")


def unconsumed(stack: LocalStack) -> dict[str, int]:
    """Per partition of the VMs' hub, how many stored events are past its checkpoint (not yet consumed)."""
    assert stack.eventhubs is not None
    assert stack.storage is not None
    last: dict[str, int] = {}
    for stored in stack.eventhubs.all_events(HUB):
        last[stored.partition_id] = max(last.get(stored.partition_id, -1), stored.sequence_number)
    blobs = BlobServiceClient.from_connection_string(
        stack.storage.connection_string, api_version=AZURITE_BLOB_API_VERSION
    )
    checkpoints: dict[str, int] = {}
    try:
        container = blobs.get_container_client(CHECKPOINTS)
        for blob in container.list_blobs(include=["metadata"]):
            parts = blob.name.lower().split("/")
            if len(parts) >= 2 and parts[-2] == "checkpoint" and f"/{HUB}/" in blob.name.lower():
                checkpoints[parts[-1]] = int((blob.metadata or {}).get("sequencenumber", -1))
    finally:
        blobs.close()
    return {p: n - checkpoints.get(p, -1) for p, n in last.items() if n > checkpoints.get(p, -1)}


def pending(stack: LocalStack) -> list[str]:
    """What the coordinator has still to do for what it stored: outbox entries, cards recorded and not cleared."""
    store = _store(stack)
    waits = []
    entries = store.outbox()
    if entries:
        waits.append(f"{len(entries)} outbox entries ({sum(len(e.rows) for e in entries)} rows)")
    events = store.open_events() + store.closed_events_with_pending_alerts()
    cards = [stored.record for stored in events if stored.record.pendingAlerts]
    if cards:
        waits.append(f"cards pending on {len(cards)} events")
    vm_cards = [vm for g in store.all_vm_groups() for vm in g.record.vms.values() if vm.pendingAlerts]
    if vm_cards:
        waits.append(f"cards pending on {len(vm_cards)} VMs")
    return waits


def at_rest(stack: LocalStack, *, deadline: float, interval: float = 0.5) -> list[str]:
    """Waits until the hub is consumed and the coordinator has nothing left to do, twice in a row (a tail may be
    between two of its steps); what it still waited for at ``deadline`` (empty when at rest)."""
    waits: list[str] = ["a first look"]
    calm = 0
    while time.monotonic() < deadline:
        left = unconsumed(stack)
        waits = [f"{n} events past the checkpoint of partition {p}" for p, n in sorted(left.items())] + pending(stack)
        calm = calm + 1 if not waits else 0
        if calm >= 2:
            return []
        time.sleep(interval)
    return waits


def history_rows(path: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in db.execute(f'SELECT * FROM "{TABLE}" ORDER BY rowid')]  # noqa: S608
    finally:
        db.close()


def doubled_rows(rows: list[dict[str, Any]]) -> list[str]:
    """RecordIds held twice, and facts held twice under different RecordIds."""
    found = [f"RecordId {rid} x{n}" for rid, n in Counter(r["RecordId"] for r in rows).items() if n > 1]
    facts = Counter(
        (row["RecordType"], *(row[c] for c in FACT_KEYS[row["RecordType"]]))
        for row in rows
        if row["RecordType"] in FACT_KEYS and not (row["RecordType"] == "Approval" and row["Outcome"] == "sending")
    )
    found += [f"{key[0]} {key[1:]} x{n}" for key, n in facts.items() if n > 1]
    return found


def lost_rows(stack: LocalStack, rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Rows the run must have and the history lacks; and the approvals IMDS accepted with no outcome row."""
    assert stack.eventhubs is not None
    assert stack.imds is not None
    store = _store(stack)
    refused = frozenset(str(letter["BodySha256"]) for letter in store.dead_letters())
    envelopes, _ = sent_envelopes(stack.eventhubs, HUB, refused=refused)
    _, _, sent = sent_facts(envelopes)
    lost = [f"Observation {s}" for s in sorted(sent - logged_sightings(stack.history_path))]
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_type[row["RecordType"]].append(row)
    unanswered = []
    for event_id in sorted({str(a["EventId"]) for a in stack.imds.approvals()}):
        decided = {r["DecisionId"] for r in by_type["Decision"] if r["EventId"] == event_id and r["DecisionId"]}
        approvals = [r for r in by_type["Approval"] if r["EventId"] == event_id]
        intents = {r["DecisionId"] for r in approvals if r["Outcome"] == "sending"}
        outcomes = {r["DecisionId"] for r in approvals if r["Outcome"] != "sending"}
        if not decided & intents:
            lost.append(f"{event_id}: approved in IMDS, no decision with its Decision and intent rows")
        elif not decided & intents & outcomes:
            unanswered.append(f"{event_id}: decision {sorted(decided & intents)} has no outcome row")
    stored = store.get_events(str(e["EventId"]) for e in stack.imds.events())
    for event_id, item in sorted(stored.items()):
        lost += _broken_chain(event_id, item.record.state, by_type["Transition"])
    alerts = {(r["EventId"], r["Action"]) for r in by_type["Alert"] if r["Outcome"] == "sent"}
    vm_alerts = {(r["VmName"], r["Action"]) for r in by_type["Alert"] if r["Outcome"] == "sent"}
    names = {vm.vmId.lower(): vm.name for vm in stack.imds.vms()}
    for card in cards_written(stack.cards_dir, names):
        if card["eventId"] is not None and (card["eventId"], card["kind"]) not in alerts:
            lost.append(f"Alert row of card {card['kind']} of {card['eventId']}")
        if card["vm"] is not None and (card["vm"], card["kind"]) not in vm_alerts:
            lost.append(f"Alert row of card {card['kind']} of VM {card['vm']}")
    return lost, unanswered


def _broken_chain(event_id: str, state: str, transitions: list[dict[str, Any]]) -> list[str]:
    """The event's Transition rows, in time order, must each start where the last ended, the first from Scheduled,
    and the last end in ``state``, the one the coordinator stored."""
    mine = sorted((r for r in transitions if r["EventId"] == event_id), key=lambda r: str(r["TimeGenerated"]))
    at = "Scheduled"
    for row in mine:
        if row["PreviousState"] != at:
            return [f"{event_id}: a Transition from {at} to {row['PreviousState']}"]
        at = row["State"]
    return [] if at == state else [f"{event_id}: a Transition from {at} to {state} (the stored state)"]


def judge_kills(stack: LocalStack, *, seed: int, kills: int, unsettled: list[str]) -> KillVerdict:
    assert stack.imds is not None
    rows = history_rows(stack.history_path)
    approvals = Counter(str(a["EventId"]) for a in stack.imds.approvals())
    events = [str(e["EventId"]) for e in stack.imds.events()]
    lost, unanswered = lost_rows(stack, rows)
    return KillVerdict(
        seed=seed,
        kills=kills,
        rows=len(rows),
        doubled=doubled_rows(rows),
        lost=lost,
        unanswered=unanswered,
        approvals=sum(approvals.values()),
        events=len(events),
        approved_twice=[f"{event_id} x{n}" for event_id, n in approvals.items() if n > 1],
        # Every event of the kill scenario is one the policy approves at once, with a notice longer than a crash.
        never_approved=[event_id for event_id in events if event_id not in approvals],
        unsettled=unsettled,
    )
