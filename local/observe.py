"""Reads what happened in a local run: the history store as rows appear, what the forwarders sent (the Event Hubs
emulator's partitions), the coordinator's per-VM positions and dead letters (Azurite), and the IMDS emulator's
record of events and approvals. Data flows one way: nothing here writes to the pipeline."""

from __future__ import annotations

import hashlib
import sqlite3
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from contracts.envelope import Envelope
from coordinator import AlertKind, StateStore, history_schema
from emulators.eventhubs import EventHubsEmulator
from emulators.eventhubs.messages import MessageError, decode
from emulators.eventhubs.partition_log import StoredEvent
from local.expectations import Expected
from local.summary import Document, RunFacts, Sighting, sightings_from_documents
from local.timeline import Timeline

TABLE = str(history_schema()["table"])


class HistoryTail:
    """Follows the history table by rowid (SQLite WAL lets this reader run beside the coordinator's writer)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last = 0
        self._db: sqlite3.Connection | None = None

    def new_rows(self) -> list[dict[str, Any]]:
        if self._db is None:
            if not self.path.exists():
                return []
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
        try:
            cursor = self._db.execute(
                f'SELECT rowid AS _rowid, * FROM "{TABLE}" WHERE rowid > ? ORDER BY rowid',  # noqa: S608 -- fixed name
                (self._last,),
            )
        except sqlite3.OperationalError:  # the coordinator has not created the table yet
            return []
        rows = [dict(row) for row in cursor.fetchall()]
        if rows:
            self._last = int(rows[-1]["_rowid"])
        return rows

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def stored_envelopes(
    eventhubs: EventHubsEmulator, hub: str, *, refused: frozenset[str] = frozenset()
) -> tuple[list[tuple[StoredEvent, Envelope]], int]:
    """Every envelope stored in the hub with its stored event (partition by partition, in log order), and how many
    messages were not a VM's envelope at all (hostile or foreign-keyed ones a test injected, and those whose body's
    SHA-256 is in ``refused``: set aside at the door, e.g. in another VM's name without its attested document)."""
    found: list[tuple[StoredEvent, Envelope]] = []
    other = 0
    for stored in eventhubs.all_events(hub):
        try:
            message = decode(stored.message)
            # proton hands a data body out as a view into the message's own buffer: copy it while it lives.
            body: Any = message.body
            data = body if isinstance(body, bytes | str) else bytes(body)
            del message
            raw = data.encode() if isinstance(data, str) else data
            if hashlib.sha256(raw).hexdigest() in refused:
                other += 1
                continue
            envelope = Envelope.from_json_bytes(data)
        except (MessageError, ValidationError, ValueError, TypeError):
            other += 1
            continue
        if stored.partition_key is None or stored.partition_key.lower() != envelope.vm.partition_key:
            other += 1  # a VM speaks only under its own partition key; the coordinator refuses the rest
            continue
        found.append((stored, envelope))
    return found, other


def sent_envelopes(
    eventhubs: EventHubsEmulator, hub: str, *, refused: frozenset[str] = frozenset()
) -> tuple[list[Envelope], int]:
    """What the forwarders' sends achieved: every VM envelope stored in the hub, and the count of other messages."""
    found, other = stored_envelopes(eventhubs, hub, refused=refused)
    return [envelope for _, envelope in found], other


def sent_facts(envelopes: list[Envelope]) -> tuple[dict[str, int], dict[str, int], set[Sighting]]:
    """Envelope counts by kind, each VM's last sequence sent under its current forwarder state (the state of the
    VM's last stored envelope: one VM's envelopes share a partition, stored in send order), and the sightings."""
    kinds = Counter(str(envelope.kind) for envelope in envelopes)
    current: dict[str, str] = {}
    for envelope in envelopes:
        current[envelope.vm.name] = envelope.stateId
    last: dict[str, int] = {}
    documents: list[Document] = []
    for envelope in envelopes:
        name = envelope.vm.name
        if envelope.stateId == current[name]:
            last[name] = max(last.get(name, -1), envelope.sequence)
        if envelope.document is not None:
            events = [(event.EventId, str(event.EventStatus)) for event in envelope.document.Events]
            documents.append((name, envelope.stateId, envelope.sequence, events))
    return dict(kinds), last, sightings_from_documents(documents)


def logged_sightings(history_path: Path) -> set[Sighting]:
    db = sqlite3.connect(f"file:{history_path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            f"SELECT VmName, EventId, EventStatus FROM \"{TABLE}\" WHERE RecordType = 'Observation'"  # noqa: S608
        ).fetchall()
    finally:
        db.close()
    return {(str(vm), str(event_id), str(status)) for vm, event_id, status in rows}


def applied_positions(store: StateStore) -> dict[str, int]:
    return {vm.identity.name: vm.lastSequence for stored in store.all_vm_groups() for vm in stored.record.vms.values()}


# A VM's cards are named {vmId}-{kind}-{suffix}.json; an event's {EventId}-{kind}.json.
VM_CARD_KINDS = ("heartbeat-lost", "forwarder-conflict", "imds-failing")
CARD_KINDS = tuple(kind for kind in get_args(AlertKind) if kind not in VM_CARD_KINDS)


def cards_written(folder: Path, vm_names: dict[str, str]) -> list[dict[str, str | None]]:
    """The cards the coordinator wrote, from their file names: ``{EventId}-{kind}.json`` for an event's card,
    ``{vmId}-{kind}-{suffix}.json`` for a VM's (heartbeat lost, two forwarders as one VM, IMDS failing); ``vm_names``
    maps vmId to the VM's name. A file of another shape is listed with kind ``unknown``."""
    cards: list[dict[str, str | None]] = []
    for path in sorted(folder.glob("*.json")):
        stem = path.stem
        vm_kind = next((k for k in VM_CARD_KINDS if f"-{k}-" in stem), None)
        if vm_kind is not None:
            vm_id = stem.split(f"-{vm_kind}-", 1)[0]
            cards.append({"kind": vm_kind, "eventId": None, "vm": vm_names.get(vm_id.lower(), vm_id)})
            continue
        kind = next((k for k in CARD_KINDS if stem.endswith(f"-{k}")), None)
        event_id = stem[: -len(kind) - 1] if kind is not None else None
        cards.append({"kind": kind or "unknown", "eventId": event_id, "vm": None})
    return cards


def event_details(timeline: Timeline, imds_approvals: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per EventId: the VM whose listener posted StartRequests (IMDS's record, else the history's Approval row),
    how long after the first sighting IMDS accepted it and the event started, and what holds it back."""
    accepted = {str(item["EventId"]): item for item in imds_approvals}
    result: dict[str, dict[str, Any]] = {}
    for event_id, path in timeline.paths.items():
        approval = accepted.get(event_id)
        approved_after = None
        if approval is not None and path.first_observed is not None:
            at = datetime.fromisoformat(str(approval["at"]).replace("Z", "+00:00"))
            approved_after = round((at - path.first_observed).total_seconds() * 1000.0, 1)
        started_after = path.latency_ms("started")
        result[event_id] = {
            "approvedThrough": (str(approval.get("vm") or "") if approval else "") or path.approved_via or None,
            "approvedAfterSeenMs": approved_after,
            "startedAfterSeenMs": round(started_after, 1) if started_after is not None else None,
            "heldBy": path.held_by or None,
        }
    return result


def collect(
    *,
    expected: list[Expected],
    timeline: Timeline,
    imds_events: list[dict[str, Any]],
    imds_approvals: list[dict[str, Any]],
    eventhubs: EventHubsEmulator,
    hub: str,
    store: StateStore,
    history_path: Path,
    envelopes_delivered: int,
    failed_batches: int,
    expected_dead_letters: int = 0,
    cards_folder: Path | None = None,
    vm_names: dict[str, str] | None = None,
) -> RunFacts:
    # What the coordinator refused at the door is no VM's word (dead letters are counted against the expected ones).
    letters = store.dead_letters()
    refused = frozenset(str(letter["BodySha256"]) for letter in letters)
    envelopes, _ = sent_envelopes(eventhubs, hub, refused=refused)
    kinds, last_sent, sightings = sent_facts(envelopes)
    latencies: dict[str, list[float]] = {}
    # The approval's moment is when IMDS accepted StartRequests (the emulator records it); the history's Approval
    # row carries the time its batch started.
    accepted = {str(item["EventId"]): str(item["at"]) for item in imds_approvals}
    for event_id, path in timeline.paths.items():
        if path.first_observed is not None and event_id in accepted:
            at = datetime.fromisoformat(accepted[event_id].replace("Z", "+00:00"))
            latencies.setdefault("approved in IMDS", []).append((at - path.first_observed).total_seconds() * 1000)
        for step in ("started", "completed"):
            value = path.latency_ms(step)
            if value is not None:
                latencies.setdefault(step, []).append(value)
    return RunFacts(
        expected=expected,
        imds_events=imds_events,
        imds_approvals=imds_approvals,
        coordinator_states={event_id: path.state for event_id, path in timeline.paths.items()},
        envelopes_sent=kinds,
        envelopes_delivered=envelopes_delivered,
        last_sequence_sent=last_sent,
        last_sequence_applied=applied_positions(store),
        sightings_sent=sightings,
        sightings_logged=logged_sightings(history_path),
        dead_letters=len(letters),
        failed_batches=failed_batches,
        expected_dead_letters=expected_dead_letters,
        latencies_ms=latencies,
        event_details=event_details(timeline, imds_approvals),
        cards=cards_written(cards_folder, vm_names or {}) if cards_folder is not None else [],
    )
