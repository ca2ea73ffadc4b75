"""Cards, the second step of every run's tail (pipeline/tail.py): posts the cards committed transitions recorded.

A card is recorded in its event's outbox (``pendingAlerts``) by the same write that commits the transition, then
posted here. The batch path logs the cards it sent in one ``alertsent`` entity (one write per batch); the timer
reads those logs and clears the cards from the events (``settled``), and sends again the cards still pending after
``ALERT_GRACE`` (a failed send, or a crash after the write). A card that fails stays pending; the pipeline goes on.
A run posts within ``CARDS_WITHIN`` and stops at its first card that fails: what it leaves stays pending too.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import get_args

from coordinator.adapters import telemetry
from coordinator.adapters.teams import AlertError
from coordinator.domain.cards import build_card, build_vm_card
from coordinator.domain.history_rows import alert_row
from coordinator.domain.lifecycle import EventChange, clone
from coordinator.domain.model import AlertKind, EventRecord, SentAlerts, VmGroupRecord, VmRecord
from coordinator.pipeline.record import stage_loose
from coordinator.pipeline.run import Run, Work
from coordinator.state.commit import commit
from coordinator.state.events import commit_event, read_event
from coordinator.state.store import ConcurrencyConflict, Stored

log = logging.getLogger("coordinator")

# Cards are sent right after the write that records them; the timer sends those still pending after this.
ALERT_GRACE = timedelta(seconds=30)
# Every kind a card can be built for: a pending entry of any other string (a record written by a newer coordinator)
# is left alone rather than sent as a card this code cannot title.
TITLED_KINDS: frozenset[str] = frozenset(get_args(AlertKind))
# VM cards by the group their VM is kept in, then vmId (lower case): {group: {vmId: [kinds]}}.
VmCards = dict[str, dict[str, list[str]]]
# A run posts its cards within this time and stops at its first card that fails; the rest stay pending in their
# outboxes, for the timer (after ALERT_GRACE). Each card has its own deadline in the sink (30 s for Teams): without
# this, a webhook that hung or throttled held a tail for one deadline per card, and the budgets it frees and the
# history after it waited as long.
CARDS_WITHIN = timedelta(seconds=10)


class _Posting:
    """Whether the run may post one more card (``go``): not once its time for cards is spent or a card failed;
    ``held`` counts those left pending."""

    def __init__(self) -> None:
        self._until = time.monotonic() + CARDS_WITHIN.total_seconds()
        self.failed = False
        self.held = 0

    def go(self) -> bool:
        if self.failed or time.monotonic() >= self._until:
            self.held += 1
            return False
        return True

    def sent(self, ok: bool) -> bool:
        self.failed = self.failed or not ok
        return ok


def post_and_log(run: Run) -> None:
    """A batch's or a person's cards: posted, and those sent logged in one write (the timer clears them from the
    events' and VMs' outboxes)."""
    sent, sent_vms = _post(run)
    if sent or sent_vms:
        # Their Alert rows are stored before the log that keeps any run from posting them again: a process that
        # stops between the two steps loses neither a card nor its row.
        stage_loose(run)
        log_sent(run, sent, vms=sent_vms)


def post_and_settle(run: Run, settled: dict[str, list[str]], settled_vms: VmCards) -> None:
    """The timer's cards: posted, then cleared from the outboxes with those the batches' logs say were sent
    (``settled``, ``settled_vms``)."""
    sent, sent_vms = _post(run)
    if sent or sent_vms:
        stage_loose(run)  # as post_and_log: the rows before the outboxes forget the cards
    for event_id, kinds in sent.items():
        settled.setdefault(event_id, []).extend(kinds)
    clear_sent(run, settled)
    for key, vms in sent_vms.items():
        for vm_id, kinds in vms.items():
            settled_vms.setdefault(key, {}).setdefault(vm_id, []).extend(kinds)
    clear_vm_sent(run, settled_vms)


def _post(run: Run) -> tuple[dict[str, list[str]], VmCards]:
    """Posts the run's cards (the events as committed; others are read); returns those sent."""
    run.enter("cards")
    work, posting = run.work, _Posting()
    records = dict(work.records)
    sent: dict[str, list[str]] = defaultdict(list)
    if work.alerts:
        for event_id in {e for e, _ in work.alerts if e not in records}:
            current = read_event(run.parts.store, event_id)
            if current is not None:
                records[event_id] = current.record
        # One card per event: its alerts of this run together (cards.build_card's ``also``), in the order raised.
        by_event: dict[str, list[AlertKind]] = {}
        for event_id, kind in work.alerts:
            if event_id in records and kind not in by_event.setdefault(event_id, []):
                by_event[event_id].append(kind)
        for event_id, kinds in by_event.items():
            if posting.go() and posting.sent(send_card(run, records[event_id], kinds)):
                sent[event_id].extend(kinds)
    sent_vms = send_vm_cards(run, posting)
    if posting.held:
        run.report.alerts_held += posting.held
        why = "a card failed" if posting.failed else f"the run's {CARDS_WITHIN.total_seconds():g} s for cards passed"
        log.warning("%d cards left pending for the timer: %s", posting.held, why)
    return sent, sent_vms


def send_vm_cards(run: Run, posting: _Posting) -> VmCards:
    """Sends the run's VM cards while ``posting`` lets it; returns those sent, by group and vmId (an Alert row each,
    sent or failed)."""
    sent: VmCards = {}
    for vm, kind in run.work.vm_alerts:
        if posting.go() and posting.sent(send_vm_card(run, vm, kind)):
            vm_id = vm.identity.vmId.lower()
            group = run.work.vm_groups.get(vm_id) or run.fleet.group_of(vm.identity)
            sent.setdefault(group, {}).setdefault(vm_id, []).append(kind)
    return sent


def vm_card_key(vm: VmRecord, kind: AlertKind) -> str:
    """Names the condition's occurrence, so a card sent again (the folder sink overwrites) is the same card: the last
    envelope before a heartbeat was lost, a pair of forwarder states found speaking for the VM, or an IMDS failure
    by when it began."""
    if kind == "heartbeat-lost":
        return f"{vm.identity.vmId}-{kind}-{vm.lastSeen.strftime('%Y%m%dT%H%M%S')}"
    if kind == "imds-failing" and vm.imdsFailing is not None:
        return f"{vm.identity.vmId}-{kind}-{vm.imdsFailing.since.strftime('%Y%m%dT%H%M%S')}"
    return f"{vm.identity.vmId}-{kind}-{'-'.join(vm.stateConflict)}"


def send_vm_card(run: Run, vm: VmRecord, kind: AlertKind) -> bool:
    """A card about a VM rather than an event (heartbeat lost, two forwarders as one VM, IMDS failing). A card that
    fails stays in the VM's outbox for the timer."""
    now, report, work = run.now, run.report, run.work
    timeout = int(run.options.heartbeat_timeout.total_seconds()) if kind == "heartbeat-lost" else None
    try:
        run.parts.alerts.send(build_vm_card(kind, vm, now=now, timeout_seconds=timeout), key=vm_card_key(vm, kind))
    except AlertError as error:
        log.warning("%s card for %s not delivered, kept pending: %s", kind, vm.identity.name, error)
        report.alerts_failed += 1
        work.rows.append(alert_row(about=vm.identity, kind=kind, now=now, outcome="failed", reason=str(error)))
        telemetry.alert(kind, "failed")
        return False
    report.alerts_sent += 1
    work.rows.append(alert_row(about=vm.identity, kind=kind, now=now, outcome="sent"))
    telemetry.alert(kind, "sent")
    return True


def queue_vm_pending(vm: VmRecord, now: datetime, work: Work, settled_vms: VmCards, *, group: str) -> None:
    """The VMs' outbox, as ``queue_pending`` for events: cards recorded but not sent after ALERT_GRACE (``group``:
    the group ``vm``'s position was read from)."""
    if not vm.pendingAlerts or (vm.pendingSince is not None and vm.pendingSince > now - ALERT_GRACE):
        return
    vm_id = vm.identity.vmId.lower()
    queued: set[str] = {kind for queued_vm, kind in work.vm_alerts if queued_vm.identity.vmId.lower() == vm_id}
    queued.update(settled_vms.get(group, {}).get(vm_id, ()))
    for kind in vm.pendingAlerts:
        if kind in TITLED_KINDS and kind not in queued:
            work.vm_alert(vm, kind, group=group)  # type: ignore[arg-type]


def clear_vm_sent(run: Run, sent: VmCards) -> None:
    """Clears sent cards from the VMs' outboxes: one ETag-checked write per group; a group another instance wrote
    meanwhile is read again."""
    store = run.parts.store
    for key, vms in sent.items():

        def cleared(
            current: Stored[VmGroupRecord] | None, vms: dict[str, list[str]] = vms
        ) -> tuple[VmGroupRecord, dict[str, VmRecord]] | None:
            if current is None:
                return None
            changed = {
                vm_id: vm.model_copy(
                    update={
                        "pendingAlerts": [k for k in vm.pendingAlerts if k not in vms[vm_id]],
                        "pendingSince": vm.pendingSince if set(vm.pendingAlerts) - set(vms[vm_id]) else None,
                    }
                )
                for vm_id, vm in current.record.vms.items()
                if vm_id in vms and set(vm.pendingAlerts) & set(vms[vm_id])
            }
            if not changed:
                return None
            return current.record.model_copy(update={"vms": {**current.record.vms, **changed}}), changed

        try:
            commit(
                lambda _attempt, key=key: store.get_vm_groups([key]).get(key),  # type: ignore[misc]
                cleared,
                lambda write, current: store.save_vm_group(
                    write[0], current.etag if current else None, vm_ids=write[1]
                ),
                what=f"sent VM cards of {key}",
            )
        except ConcurrencyConflict:
            log.warning("VM cards of group %s sent but still marked pending: the timer may send them again", key)


def send_card(run: Run, record: EventRecord, kinds: Sequence[AlertKind]) -> bool:
    """One card for the event's alerts ``kinds`` (in the order raised): the last one's, standing for the others too;
    an Alert row per kind, sent or failed together."""
    now, report, work = run.now, run.report, run.work
    *earlier, kind = kinds
    approve_url = run.options.approve_url(record.eventId) if run.options.approve_url else None
    card = build_card(kind, record, now=now, approve_url=approve_url, also=earlier)
    key = f"{record.eventId}-{kind}"
    try:
        run.parts.alerts.send(card, key=key)
    except AlertError as error:
        log.warning("alert %s not delivered, kept pending: %s", key, error)
        report.alerts_failed += 1
        for each in kinds:
            work.rows.append(alert_row(about=record, kind=each, now=now, outcome="failed", reason=str(error)))
            telemetry.alert(each, "failed")
        return False
    report.alerts_sent += 1
    for each in kinds:
        work.rows.append(
            alert_row(about=record, kind=each, now=now, outcome="sent", reason="" if each == kind else f"in {key}")
        )
        telemetry.alert(each, "sent")
    return True


def sent_logs(run: Run) -> tuple[list[tuple[str, SentAlerts]], dict[str, list[str]], VmCards]:
    """The batches' logs of sent cards, and what they say was sent: event cards by EventId, VM cards by group."""
    logs = run.parts.store.sent_alert_logs()
    settled: dict[str, list[str]] = defaultdict(list)
    settled_vms: VmCards = {}
    for _, entry in logs:
        for event_id, kinds in entry.events.items():
            settled[event_id].extend(kinds)
        for key, vms in entry.vms.items():
            for vm_id, kinds in vms.items():
                settled_vms.setdefault(key, {}).setdefault(vm_id, []).extend(kinds)
    return logs, settled, settled_vms


def log_sent(run: Run, sent: dict[str, list[str]], *, vms: VmCards) -> None:
    try:
        run.parts.store.log_sent_alerts(SentAlerts(sentAt=run.now, events=dict(sent), vms=vms))
    except Exception:  # the cards went out; without the log the timer may send them once more
        log.exception("could not record %d sent cards; the timer may send them again", len(sent))


def clear_sent(run: Run, sent: dict[str, list[str]]) -> None:
    """Clears sent cards from the events' outbox: one transaction, event by event when another instance wrote
    one meanwhile."""
    if not sent:
        return
    store = run.parts.store

    def cleared(stored: dict[str, Stored[EventRecord]]) -> list[tuple[EventRecord, str | None]]:
        items = []
        for event_id, kinds in sent.items():
            current = stored.get(event_id)
            change = clear_alerts_pending(current.record, kinds) if current else None
            if current is not None and change is not None:
                items.append((change.record, current.etag))
        return items

    try:
        commit(
            lambda _attempt: store.get_events(sent, cached=True),
            cleared,
            lambda items, _stored: store.save_events(items),
            what="sent cards",
            attempts=1,
        )
        return
    except ConcurrencyConflict:
        pass
    for event_id, kinds in sent.items():
        try:
            commit_event(store, event_id, lambda r, kinds=kinds: clear_alerts_pending(r, kinds))  # type: ignore[misc]
        except ConcurrencyConflict:
            log.warning("alerts %s of %s sent but still marked pending: the timer may send them again", kinds, event_id)


def clear_alerts_pending(record: EventRecord | None, kinds: list[str]) -> EventChange | None:
    if record is None or not set(kinds) & set(record.pendingAlerts):
        return None
    record = clone(record)
    record.pendingAlerts = [k for k in record.pendingAlerts if k not in kinds]
    if not record.pendingAlerts:
        record.pendingSince = None
    return EventChange(record=record, changed=True)


def queue_pending(record: EventRecord, now: datetime, work: Work, settled: dict[str, list[str]]) -> None:
    """The outbox: cards recorded but not sent (a failed send, or a crash after the write), once the sender
    has had ALERT_GRACE to do it. Cards a batch logged as sent are only cleared."""
    if not record.pendingAlerts or (record.pendingSince is not None and record.pendingSince > now - ALERT_GRACE):
        return
    queued: set[str] = {kind for event_id, kind in work.alerts if event_id == record.eventId}
    queued.update(settled.get(record.eventId, ()))
    for kind in record.pendingAlerts:
        if kind in TITLED_KINDS and kind not in queued:
            work.alerts.append((record.eventId, kind))  # type: ignore[arg-type]
    work.records.setdefault(record.eventId, record)
