"""Forwarder health, from the heartbeats that carry it (``contracts.envelope.ForwarderHealth``): a forwarder alive but
unable to read IMDS misses every event, and only its own report shows it.

Part of fold (a batch applies each VM's envelopes, then its health): records the per-VM health metrics, and moves the
VM's ``imdsFailing`` flag. When a heartbeat shows no good IMDS poll for longer than ``imds_failing_after`` (or, with
no good poll since the forwarder started, ``imds_failing_errors`` failed polls in a row), the flag is set with a
``Heartbeat`` row (``Outcome=imds-failing``) and one *imds-failing* card; while it lasts nothing more; a heartbeat
that shows a good poll again clears it with a row ``imds-recovered``, after which it can be raised again.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from contracts.envelope import ForwarderHealth
from coordinator.adapters import telemetry
from coordinator.domain.cards import raise_vm_alert
from coordinator.domain.history_rows import heartbeat_row, position_of
from coordinator.domain.model import ImdsFailure
from coordinator.domain.observations import VmUpdate
from coordinator.pipeline.run import Work


def imds_failing(health: ForwarderHealth, at: datetime, *, after: timedelta, errors: int) -> str | None:
    """Why this health report (observed ``at``) shows IMDS failing, or None when it does not."""
    age = health.poll_age_seconds(at)
    last_error = f"; last error: {health.lastPollError}" if health.lastPollError else ""
    if age is not None and age > after.total_seconds():
        return (
            f"no good IMDS poll for {age:.0f} s (limit {after.total_seconds():.0f} s), "
            f"{health.consecutivePollErrors} failed in a row{last_error}"
        )
    if age is None and health.consecutivePollErrors >= errors:
        return (
            f"no good IMDS poll since the forwarder started, {health.consecutivePollErrors} failed in a row "
            f"(limit {errors}){last_error}"
        )
    return None


def assess(update: VmUpdate, now: datetime, work: Work, *, after: timedelta, errors: int) -> None:
    """Records the VM's health metrics and moves its ``imdsFailing`` flag on ``update.record`` (written with the
    VM's position), with its history row and card."""
    if update.health is None:
        return
    health, at = update.health
    record = update.record
    telemetry.forwarder_health(record.identity, health, at)
    reason = imds_failing(health, at, after=after, errors=errors)
    if reason is not None and record.imdsFailing is None:
        record = record.model_copy(update={"imdsFailing": ImdsFailure(since=at, reason=reason[:1000])})
        record = raise_vm_alert(record, "imds-failing", now)
        work.rows.append(
            heartbeat_row(
                **position_of(record),
                now=now,
                outcome="imds-failing",
                reason=reason,
                details=_details(health),
            )
        )
        work.vm_alerts.append((record, "imds-failing"))
    elif reason is None and record.imdsFailing is not None:
        since = record.imdsFailing.since
        record = record.model_copy(update={"imdsFailing": None})
        work.rows.append(
            heartbeat_row(
                **position_of(record),
                now=now,
                outcome="imds-recovered",
                reason=f"IMDS polled again (failing since {since.isoformat()})",
                details=_details(health),
            )
        )
    update.record = record


def _details(health: ForwarderHealth) -> dict[str, object]:
    return health.model_dump(mode="json", include=set(ForwarderHealth.model_fields))
