"""A known local history: rows shaped as the coordinator writes them (the event columns on every event row, the
reporting VM's columns on observations, hooks and heartbeats), written with the real SQLite history writer.

Times are relative to ``now`` because the shipped queries look back from ``now()`` (7 d, 30 d, 1 d). Each event
or VM exercises something a query must include or leave out; the expected results are in test_kql_results.py.

    events                         what the queries should make of it
    freeze-web (Freeze, web_0/1)   approved at once by short-freeze, started, completed
    reboot-web2 (Reboot, web_2)    waited for a person and expired (in both expired queries)
    terminate-web3 (Terminate)     prepare hook failed then succeeded; first approval failed (its card failed, then
                                   went out), second approved;
                                   started, then web_3's heartbeat was lost (not silent: a Terminate removed it)
    redeploy-db0 (Redeploy, db_0)  approval rejected by the listener (its card failed twice); recover hook timed out
    reboot-old (Reboot, 10 days)   expired, but outside every 7-day window (inside the 30-day one)
    reboot-user (User, 3 days)     user-initiated, approved after 1 minute, 15 minutes of notice
    shadow policy (Shadow rows)    a candidate beside the live policy: would have approved reboot-web2 (then waited
                                   again) and freeze-web (as the live did), never reboot-user (two waiting rules)
    escalation (Decision rows)     reboot-web2's first decision took both steps of its rule's ladder at once (one
                                   late); reboot-old's too, outside the 7 days
    repairs (web, db)              web's suspended for freeze-web, then for reboot-user (after a failed Suspend) until
                                   the bound; db's still suspended for redeploy-db0
    heartbeats                     web_4 lost (silent); web_5 lost then resumed (not silent); db_1 lost 2 days
                                   ago (outside the 1-day lookback)
    return to service              freeze-web's rule wants its VMs back within 60 s of the completion: web_0 back
                                   after 3 s; web_1 late (its ready gate failing), back 12 s past the bound.
    reboot-api0 (Reboot, api_0)    approved by api-reboots 2 days ago, completed; api_0 never came back (its recover
                                   hooks never reported): late 600 s after the completion, then abandoned a day past
                                   the bound. No restart measured: its return-to-service rows are its only Impact rows
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.rows import HistoryRow

SUBSCRIPTION = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/rg"


def vm_columns(name: str) -> dict[str, Any]:
    scale_set, index = name.rsplit("_", 1)
    return {
        "VmName": name,
        "VmId": f"vmid-{name}",
        "VmResourceId": f"{SUBSCRIPTION}/providers/Microsoft.Compute/virtualMachineScaleSets/{scale_set}"
        f"/virtualMachines/{index}",
        "ScaleSetName": scale_set,
        "PlacementGroupId": f"pg-{scale_set}",
    }


class Step(NamedTuple):
    """An escalation step a decision took: its place in its rule's ladder, what it did, its lead (seconds before
    NotBefore) and whom it told."""

    step: int
    of: int
    do: str
    lead: int
    owners: tuple[str, ...] = ()


class Watch(NamedTuple):
    """A completed event's return-to-service watch (coordinator/domain/side_records.py ReturnWatch): the rule that
    asked for it, the completion, the seconds its VMs have to be back (its bound) and the gates they must pass."""

    rule: str
    completed: datetime
    within: int
    gates: tuple[str, ...] = ("ready",)


class Event:
    """Builds the rows of one event as the coordinator's builders do (coordinator/domain/history_rows.py): the
    event's columns on every row about it."""

    def __init__(
        self,
        event_id: str,
        event_type: str,
        resources: list[str],
        not_before: datetime,
        *,
        source: str = "Platform",
        duration: int = -1,
    ) -> None:
        self.columns: dict[str, Any] = {
            "EventId": event_id,
            "EventType": event_type,
            "EventSource": source,
            "NotBefore": not_before,
            "DurationInSeconds": duration,
            "Resources": resources,
        }
        self.state = "Scheduled"
        self.rows: list[HistoryRow] = []

    def _row(self, at: datetime, record_type: str, **values: Any) -> None:
        # The record keeps the NotBefore of its first sighting after the event started (IMDS then shows "").
        columns = {**self.columns, "State": self.state, "TimeGenerated": at, "RecordType": record_type}
        self.rows.append(HistoryRow.model_validate(columns | values))

    def observed(
        self, at: datetime, vm: str, status: str = "Scheduled", *, incarnation: int = 1, outcome: str = ""
    ) -> None:
        # outcome "conflict": a sighting whose facts contradict the record's (kept, not merged).
        self._row(
            at,
            "Observation",
            EventStatus=status,
            DocumentIncarnation=incarnation,
            ObservedAt=at - timedelta(milliseconds=200),
            Sequence=incarnation,
            Actor="platform",
            Outcome=outcome,
            **vm_columns(vm),
        )

    def decided(
        self, at: datetime, rule: str, action: str, verdict: str, reason: str, *, steps: Sequence[Step] = ()
    ) -> None:
        # steps: the escalation steps this decision took, in its Details as the coordinator writes them.
        self._row(
            at,
            "Decision",
            Rule=rule,
            Action=action,
            DecisionId=f"d-{self.columns['EventId']}",
            Actor=f"rule:{rule}",
            Outcome=verdict,
            Reason=reason,
            DryRun=False,
            Details=self._escalation(steps),
        )

    def _escalation(self, steps: Sequence[Step]) -> dict[str, Any] | None:
        # A step's time is NotBefore minus its lead (coordinator/domain/escalation.py).
        if not steps:
            return None
        not_before: datetime = self.columns["NotBefore"]
        return {
            "escalation": [
                {
                    "step": step.step,
                    "of": step.of,
                    "do": step.do,
                    "beforeNotBeforeSeconds": step.lead,
                    "at": (not_before - timedelta(seconds=step.lead)).isoformat(),
                    "owners": list(step.owners),
                }
                for step in steps
            ]
        }

    def moved(self, at: datetime, state: str, reason: str, *, rule: str = "") -> None:
        # An approval's transition names its rule.
        previous, self.state = self.state, state
        self._row(at, "Transition", PreviousState=previous, Reason=reason, Rule=rule)

    def shadow(self, at: datetime, rule: str, action: str, verdict: str, reason: str) -> None:
        # The shadow policy's verdict, written when its rule, verdict or reason changes; never sent.
        approve_at = at.isoformat() if verdict == "approve" else None
        self._row(
            at,
            "Shadow",
            Rule=rule,
            Action=action,
            Actor=f"shadow:{rule}",
            Outcome=verdict,
            Reason=reason,
            DryRun=True,
            Details={"policyVersion": "candidate-2", "approveAt": approve_at},
        )

    def approval(self, at: datetime, vm: str, outcome: str, reason: str, rule: str, *, actor: str = "") -> None:
        # VmName is the executor.
        self._row(
            at,
            "Approval",
            VmName=vm,
            Rule=rule,
            DecisionId=f"d-{self.columns['EventId']}",
            Actor=actor or f"rule:{rule}",
            Outcome=outcome,
            Reason=reason,
        )

    def hook(self, at: datetime, vm: str, *, phase: str, outcome: str, hook: str, reason: str) -> None:
        self._row(
            at, "Hook", HookPhase=phase, Outcome=outcome, ObservedAt=at, Actor=hook, Reason=reason, **vm_columns(vm)
        )

    def impact(self, at: datetime, vm: str, measure: str, seconds: float, *, start: datetime, end: datetime) -> None:
        self._row(
            at,
            "Impact",
            ObservedAt=at,
            Actor="coordinator" if measure == "removed" else "forwarder",
            Outcome=measure,
            ImpactMeasure=measure,
            MeasuredSeconds=seconds,
            ImpactStart=start,
            ImpactEnd=end,
            **vm_columns(vm),
        )

    def returned(
        self, at: datetime, vm: str, outcome: str, watch: Watch, *, waiting: str = "", was_late: bool = False
    ) -> None:
        """A VM's return to service after the event completed, as coordinator/domain/returns.py writes it: back (the
        seconds since the completion; ``was_late``: it went late first), late (its rule's bound passed first: what it
        waits for) or abandoned (a day past the bound). The coordinator's row: no MeasuredSeconds, ImpactStart the
        completion, ImpactEnd the time back."""
        bound = watch.completed + timedelta(seconds=watch.within)
        seconds = (at - watch.completed).total_seconds() if outcome == "back" else None
        what = self.columns["EventType"]
        if outcome == "back":
            past = f", {(at - bound).total_seconds():.0f} s past its bound" if was_late else ""
            reason = f"{vm} back in service {seconds:.0f} s after the {what} completed{past}"
        elif outcome == "late":
            reason = f"{vm} not back in service {watch.within} s after the {what} completed: {waiting}"
        else:
            reason = f"{vm} no longer watched, 86400 s past its bound: {waiting}"
        self._row(
            at,
            "Impact",
            ObservedAt=at,
            Sequence=-1,
            Actor="coordinator",
            Rule=watch.rule,
            Outcome=outcome,
            Reason=reason,
            ImpactMeasure="return-to-service",
            ImpactStart=watch.completed,
            ImpactEnd=at if outcome == "back" else None,
            ReturnToServiceSeconds=seconds,
            Details={"bound": bound.isoformat(), "gates": list(watch.gates)},
            **vm_columns(vm),
        )

    def alert(self, at: datetime, kind: str, outcome: str = "sent", reason: str = "") -> None:
        # Carries State (e.g. Expired) but is no Transition: the queries must not count it.
        self._row(at, "Alert", Action=kind, Actor="teams", Outcome=outcome, Reason=reason)


def heartbeat(at: datetime, vm: str, outcome: str, last_seen: datetime, reason: str) -> HistoryRow:
    return HistoryRow(
        TimeGenerated=at,
        RecordType="Heartbeat",
        ObservedAt=last_seen,
        Sequence=42,
        DocumentIncarnation=3,
        Outcome=outcome,
        Reason=reason,
        **vm_columns(vm),
    )


def repairs(at: datetime, scale_set: str, action: str, outcome: str, events: list[str], *, reason: str) -> HistoryRow:
    # As coordinator/domain/history_rows.py repairs_row: no event columns, the events in flight in Details.
    scale_set_id = f"{SUBSCRIPTION}/providers/Microsoft.Compute/virtualMachineScaleSets/{scale_set}"
    return HistoryRow(
        TimeGenerated=at,
        RecordType="Repairs",
        ScaleSetName=scale_set,
        Action=action,
        Actor="coordinator",
        Outcome=outcome,
        Reason=reason,
        Details={"scaleSetId": scale_set_id, "events": events},
    )


def known_rows(now: datetime) -> list[HistoryRow]:
    def ago(**delta: float) -> datetime:
        return now - timedelta(**delta)

    rows: list[HistoryRow] = []

    freeze = Event("freeze-web", "Freeze", ["web_0", "web_1"], ago(minutes=105), duration=5)
    freeze.observed(ago(minutes=120), "web_0")
    freeze.observed(ago(minutes=119), "web_1")
    freeze.decided(ago(minutes=119), "short-freeze", "approve-now", "approve", "rule 'short-freeze' approves at once")
    freeze.shadow(ago(minutes=119), "short-freeze", "approve-now", "approve", "rule 'short-freeze' approves at once")
    freeze.moved(ago(minutes=119), "Approved", "approved by rule short-freeze", rule="short-freeze")
    freeze.approval(ago(minutes=119), "web_0", "approved", "StartRequests accepted", "short-freeze")
    freeze.observed(ago(minutes=110), "web_0", "Started", incarnation=2)
    freeze.moved(ago(minutes=110), "Started", "seen Started by web_0")
    # web_0 paused twice (its longer pause reported last), web_1 longer than announced.
    freeze.impact(ago(minutes=109), "web_0", "pause", 1.2, start=ago(minutes=109, seconds=2), end=ago(minutes=109))
    freeze.impact(ago(minutes=108), "web_0", "pause", 4.8, start=ago(minutes=108, seconds=5), end=ago(minutes=108))
    freeze.impact(ago(minutes=108), "web_1", "pause", 6.25, start=ago(minutes=108, seconds=7), end=ago(minutes=108))
    freeze.observed(ago(minutes=100), "web_0", "Gone", incarnation=3)
    freeze.moved(ago(minutes=100), "Completed", "gone from every VM")
    # short-freeze's returnToService: back within 60 s, the ready gate passing. web_1 went late first (its card).
    completed, gate = ago(minutes=100), "gate ready failing (HTTP 503, expected [200])"
    watch = Watch("short-freeze", completed, 60)
    freeze.returned(completed + timedelta(seconds=3), "web_0", "back", watch)
    freeze.returned(completed + timedelta(seconds=60), "web_1", "late", watch, waiting=gate)
    freeze.alert(completed + timedelta(seconds=60), "return-late")
    freeze.returned(completed + timedelta(seconds=72), "web_1", "back", watch, was_late=True)
    rows += freeze.rows

    reboot = Event("reboot-web2", "Reboot", ["web_2"], ago(minutes=165))
    reboot.observed(ago(minutes=180), "web_2")
    # First seen with 15 minutes of notice: past both steps of its rule's ladder, its first decision takes both.
    ladder = [Step(1, 2, "notify", 1200, ("team-web",)), Step(2, 2, "notify", 900, ("sre-oncall",))]
    reboot.decided(
        ago(minutes=180), "everything-else-waits", "wait-for-person", "wait", "waits for a person", steps=ladder
    )
    reboot.shadow(ago(minutes=180), "everything-else-waits", "wait-for-person", "wait", "waits for a person")
    reboot.shadow(ago(minutes=172), "reboot-off-peak", "approve-now", "approve", "off-peak: approves at once")
    reboot.shadow(ago(minutes=168), "reboot-budget", "wait-for-budget", "wait", "reboot budget spent")
    reboot.moved(ago(minutes=165), "Expired", "NotBefore passed unapproved")
    reboot.alert(ago(minutes=165), "expired")
    rows += reboot.rows

    terminate = Event("terminate-web3", "Terminate", ["web_3"], ago(minutes=50))
    terminate.observed(ago(minutes=60), "web_3")
    terminate.hook(
        ago(minutes=59),
        "web_3",
        phase="prepare",
        outcome="failed",
        hook="10-check",
        reason="prepare phase failed: 10-check failed",
    )
    terminate.hook(
        ago(minutes=58),
        "web_3",
        phase="prepare",
        outcome="succeeded",
        hook="20-drain",
        reason="prepare phase succeeded",
    )
    terminate.decided(
        ago(minutes=58), "terminate-after-prepare-hooks", "approve-after-hooks", "approve", "prepare hooks succeeded"
    )
    terminate.moved(
        ago(minutes=58),
        "Approved",
        "approved by rule terminate-after-prepare-hooks",
        rule="terminate-after-prepare-hooks",
    )
    terminate.approval(ago(minutes=58), "web_3", "failed", "Relay: no listener", "terminate-after-prepare-hooks")
    terminate.approval(ago(minutes=57), "web_3", "approved", "StartRequests accepted", "terminate-after-prepare-hooks")
    terminate.alert(
        ago(minutes=58), "approval-failed", "failed", "Teams webhook refused card: HTTP 503 after 3 attempts"
    )
    terminate.alert(ago(minutes=57), "approval-failed")
    terminate.observed(ago(minutes=50), "web_3", "Started", incarnation=2)
    terminate.moved(ago(minutes=50), "Started", "seen Started by web_3")
    rows += terminate.rows
    rows.append(heartbeat(ago(minutes=40), "web_3", "lost", ago(minutes=50), "no envelope for 600 s"))
    terminate.impact(ago(minutes=39), "web_3", "removed", 420.0, start=ago(minutes=57), end=ago(minutes=50))
    rows += terminate.rows[-1:]

    redeploy = Event("redeploy-db0", "Redeploy", ["db_0"], ago(minutes=20))
    redeploy.observed(ago(minutes=30), "db_0")
    redeploy.decided(ago(minutes=30), "user-initiated", "approve-now", "approve", "rule 'user-initiated'")
    redeploy.approval(ago(minutes=29), "db_0", "rejected", "listener: facts differ", "user-initiated")
    for minutes in (29, 28):
        redeploy.alert(ago(minutes=minutes), "approval-refused", "failed", "Teams webhook refused card: HTTP 400")
    redeploy.hook(
        ago(minutes=25),
        "db_0",
        phase="recover",
        outcome="timed-out",
        hook="30-warm",
        reason="recover phase timed-out: 30-warm",
    )
    rows += redeploy.rows

    old = Event("reboot-old", "Reboot", ["web_0"], ago(days=10) + timedelta(minutes=15))
    old.observed(ago(days=10), "web_0")
    old.decided(ago(days=10), "everything-else-waits", "wait-for-person", "wait", "waits for a person", steps=ladder)
    old.moved(ago(days=10) + timedelta(minutes=15), "Expired", "NotBefore passed unapproved")
    rows += old.rows

    user = Event("reboot-user", "Reboot", ["web_1"], ago(days=3) + timedelta(minutes=15), source="User")
    user.observed(ago(days=3), "web_1")
    user.shadow(ago(days=3), "everything-else-waits", "wait-for-person", "wait", "waits for a person")
    user.decided(ago(days=3) + timedelta(minutes=1), "user-initiated", "approve-now", "approve", "user asked")
    user.shadow(ago(days=3) + timedelta(minutes=1), "user-after-drain", "wait-for-drain", "wait", "web_1 not drained")
    user.moved(ago(days=3) + timedelta(minutes=1), "Approved", "approved by rule user-initiated", rule="user-initiated")
    user.observed(ago(days=3) + timedelta(minutes=2), "web_1", "Started", incarnation=2)
    user.moved(ago(days=3) + timedelta(minutes=2), "Started", "seen Started by web_1")
    down = ago(days=3) + timedelta(minutes=2, seconds=5)
    user.impact(down + timedelta(seconds=95), "web_1", "restart", 93.5, start=down, end=down + timedelta(seconds=93.5))
    rows += user.rows

    # Approved after a minute, with 15 minutes of notice; api_0 saw the Reboot go, then its recover hooks never
    # reported (nor did its forwarder measure the restart): late, then abandoned.
    day2 = ago(days=2)
    api = Event("reboot-api0", "Reboot", ["api_0"], day2 + timedelta(minutes=15))
    api.observed(day2, "api_0")
    api.decided(day2 + timedelta(minutes=1), "api-reboots", "approve-now", "approve", "rule 'api-reboots'")
    api.moved(day2 + timedelta(minutes=1), "Approved", "approved by rule api-reboots", rule="api-reboots")
    api.approval(day2 + timedelta(minutes=1), "api_0", "approved", "StartRequests accepted", "api-reboots")
    api.observed(day2 + timedelta(minutes=2), "api_0", "Started", incarnation=2)
    api.moved(day2 + timedelta(minutes=2), "Started", "seen Started by api_0")
    completed, silent = day2 + timedelta(minutes=6), "recover hooks not reported yet"
    api.observed(completed, "api_0", "Gone", incarnation=3)
    api.moved(completed, "Completed", "gone from every reporting VM (1) after Started")
    watch = Watch("api-reboots", completed, 600)
    api.returned(completed + timedelta(seconds=600), "api_0", "late", watch, waiting=silent)
    api.alert(completed + timedelta(seconds=600), "return-late")
    api.returned(completed + timedelta(seconds=600, days=1), "api_0", "abandoned", watch, waiting=silent)
    rows += api.rows

    # Repairs held while a disruptive event was in flight on the scale set's VMs (approved or started, not over).
    in_flight, over = "1 event(s) in flight on its VMs", "every event that wanted them suspended is over"
    bound = "suspended 7200 s, the bound; its events are still in flight"  # reboot-user has no Completed row
    day3 = ago(days=3)
    rows += [
        repairs(ago(minutes=119), "web", "Suspend", "suspended", ["freeze-web"], reason=in_flight),
        repairs(ago(minutes=100), "web", "Resume", "resumed", ["freeze-web"], reason=over),
        repairs(day3 + timedelta(minutes=1), "web", "Suspend", "failed", ["reboot-user"], reason="ARM: HTTP 429"),
        repairs(day3 + timedelta(minutes=2), "web", "Suspend", "suspended", ["reboot-user"], reason=in_flight),
        repairs(day3 + timedelta(hours=2, minutes=2), "web", "Resume", "resumed", ["reboot-user"], reason=bound),
        repairs(ago(minutes=30), "db", "Suspend", "suspended", ["redeploy-db0"], reason=in_flight),
    ]

    rows += [
        heartbeat(ago(minutes=90), "web_4", "lost", ago(minutes=95), "no envelope for 300 s"),
        heartbeat(ago(minutes=80), "web_5", "lost", ago(minutes=85), "no envelope for 300 s"),
        heartbeat(ago(minutes=70), "web_5", "resumed", ago(minutes=70), "envelopes again"),
        heartbeat(ago(days=2), "db_1", "lost", ago(days=2, minutes=5), "no envelope for 300 s"),
    ]
    return sorted(rows, key=lambda row: row.TimeGenerated)


def write_known_history(path: Path, now: datetime) -> None:
    store = SqliteHistory(path)
    try:
        store.write(known_rows(now))
    finally:
        store.close()
