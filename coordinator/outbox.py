"""The cards' outbox, the second half of ``act``: posts the cards committed transitions recorded, and settles them.

A card is recorded in its event's outbox (``pendingAlerts``) by the same write that commits the transition, then
posted here. The batch path logs the cards it sent in one ``alertsent`` entity (one write per batch); the timer
reads those logs and clears the cards from the events (``settled``), and sends again the cards still pending after
``ALERT_GRACE`` (a failed send, or a crash after the write). A card that fails stays pending; the pipeline goes on.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime, timedelta
from typing import get_args

from coordinator import telemetry
from coordinator.alerts import AlertError, build_card, build_vm_card
from coordinator.commit import commit
from coordinator.context import BatchReport, Context, TickReport, Work
from coordinator.events import commit_event, read_event
from coordinator.model import AlertKind, EventRecord, SentAlerts, VmRecord
from coordinator.record import alert_row
from coordinator.sightings import EventChange, clone
from coordinator.tables import ConcurrencyConflict, Stored

log = logging.getLogger("coordinator")

# Cards are sent right after the write that records them; the timer sends those still pending after this.
ALERT_GRACE = timedelta(seconds=30)
# Every kind a card can be built for: a pending entry of any other string (a record written by a newer coordinator)
# is left alone rather than sent as a card this code cannot title.
TITLED_KINDS: frozenset[str] = frozenset(get_args(AlertKind))


def post(
    ctx: Context,
    work: Work,
    records: dict[str, EventRecord],
    now: datetime,
    report: BatchReport | TickReport,
    *,
    settled: dict[str, list[str]] | None,
) -> None:
    """Posts ``work``'s cards (``records``: the events as committed; others are read). Without ``settled`` (a batch)
    the cards sent are logged; with it (the timer) they join what the logs said was sent, cleared from the events."""
    sent: dict[str, list[str]] = defaultdict(list)
    if work.alerts:
        for event_id in {e for e, _ in work.alerts if e not in records}:
            current = read_event(ctx.store, event_id)
            if current is not None:
                records[event_id] = current.record
        for event_id, kind in work.alerts:
            if event_id in records and send_card(ctx, records[event_id], kind, now, work=work, report=report):
                sent[event_id].append(kind)
        if settled is None and sent:
            log_sent(ctx, sent, now)
    if settled is not None:
        for event_id, kinds in sent.items():
            settled.setdefault(event_id, []).extend(kinds)
        clear_sent(ctx, settled)
    for vm, kind in work.vm_alerts:
        send_vm_card(ctx, vm, kind, now, report, key=vm_card_key(vm, kind))


def vm_card_key(vm: VmRecord, kind: AlertKind) -> str:
    """Names the condition's occurrence, so a card sent again (the folder sink overwrites) is the same card: a pair
    of forwarder states found speaking for the VM, or an IMDS failure by when it began."""
    if kind == "imds-failing" and vm.imdsFailing is not None:
        return f"{vm.identity.vmId}-{kind}-{vm.imdsFailing.since.strftime('%Y%m%dT%H%M%S')}"
    return f"{vm.identity.vmId}-{kind}-{'-'.join(vm.stateConflict)}"


def send_vm_card(
    ctx: Context,
    vm: VmRecord,
    kind: AlertKind,
    now: datetime,
    report: BatchReport | TickReport,
    *,
    key: str,
    timeout_seconds: int | None = None,
) -> None:
    """A card about a VM rather than an event (heartbeat lost, two forwarders as one VM): sent once, not kept in
    an outbox (the condition is flagged on the VM's position, so it is not raised again)."""
    try:
        ctx.alerts.send(build_vm_card(kind, vm, now=now, timeout_seconds=timeout_seconds), key=key)
        report.alerts_sent += 1
        telemetry.alert(kind, "sent")
    except AlertError as error:
        log.warning("%s card for %s not delivered: %s", kind, vm.identity.name, error)
        telemetry.alert(kind, "failed")


def send_card(
    ctx: Context, record: EventRecord, kind: AlertKind, now: datetime, *, work: Work, report: BatchReport | TickReport
) -> bool:
    approve_url = ctx.approve_url(record.eventId) if ctx.approve_url else None
    card = build_card(kind, record, now=now, approve_url=approve_url)
    key = f"{record.eventId}-{kind}"
    try:
        ctx.alerts.send(card, key=key)
    except AlertError as error:
        log.warning("alert %s not delivered, kept pending: %s", key, error)
        if isinstance(report, BatchReport):
            report.alerts_failed += 1
        work.rows.append(alert_row(record, kind, now, "failed", str(error)))
        telemetry.alert(kind, "failed")
        return False
    report.alerts_sent += 1
    telemetry.alert(kind, "sent")
    work.rows.append(alert_row(record, kind, now, "sent", ""))
    return True


def log_sent(ctx: Context, sent: dict[str, list[str]], now: datetime) -> None:
    try:
        ctx.store.log_sent_alerts(SentAlerts(sentAt=now, events=dict(sent)))
    except Exception:  # the cards went out; without the log the timer may send them once more
        log.exception("could not record %d sent cards; the timer may send them again", len(sent))


def clear_sent(ctx: Context, sent: dict[str, list[str]]) -> None:
    """Clears sent cards from the events' outbox: one transaction, event by event when another instance wrote
    one meanwhile."""
    if not sent:
        return

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
            lambda _attempt: ctx.store.get_events(sent, cached=True),
            cleared,
            lambda items, _stored: ctx.store.save_events(items),
            what="sent cards",
            attempts=1,
        )
        return
    except ConcurrencyConflict:
        pass
    for event_id, kinds in sent.items():
        try:
            commit_event(ctx, event_id, lambda r, kinds=kinds: clear_alerts_pending(r, kinds))  # type: ignore[misc]
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
