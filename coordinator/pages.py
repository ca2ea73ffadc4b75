"""The people's pages as HTML: an event's approval page, the answer to an approval, a refusal, and the open events.

Rendered from the event summaries that ``GET /api/events`` gives scripts as JSON (``summarize`` in
``coordinator/pipeline/people.py``), so a person and a script see the same facts. Pure: summaries, the person and
the time in, a page out; ``coordinator/http.py`` decides who may see what and sends it.

Every value shown is escaped, attribute quotes included: an event's facts (description, resources, even the type
as recorded) come from VMs, and one VM may lie. The pages need no JavaScript (links and one form) and their
Content-Security-Policy allows none, so an escaping mistake still could not run a script; they cannot be framed.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from coordinator.domain.model import ApprovalRecord, DecisionRecord

CONTENT_TYPE = "text/html; charset=utf-8"
# No scripts, no foreign resources, forms only to this origin, no framing (a framed button can be clicked by a
# trick), and no copy kept by a cache (the approval form carries a person's token).
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
PENDING_PATH = "/api/events"
_STYLE = """
body{font-family:system-ui,'Segoe UI',sans-serif;margin:1.5rem;color:#1b1b1b;max-width:78rem}
header{color:#555;font-size:.9rem;margin-bottom:1rem}
h1{font-size:1.35rem;margin:.2rem 0 1rem}
table{border-collapse:collapse;margin:.5rem 0 1rem}
th,td{border:1px solid #ccc;padding:.35rem .6rem;text-align:left;vertical-align:top}
thead th{background:#f0f0f0}
table.facts th{background:#f7f7f7;width:11rem}
.notice{padding:.6rem .8rem;border-left:4px solid #888;background:#f5f5f5;max-width:60rem}
.good{border-color:#2e7d32;background:#edf7ee}
.bad{border-color:#c62828;background:#fdeeee}
.warn{border-color:#b26a00;background:#fff6e5}
button{font-size:1rem;padding:.5rem 1.2rem;background:#0f6cbd;color:#fff;border:0;border-radius:4px;cursor:pointer}
small{color:#555}
.when{white-space:nowrap}
"""


def e(value: object) -> str:
    """Any value as HTML text or attribute value."""
    return html.escape(str(value), quote=True)


class HeldByView(BaseModel):
    model_config = ConfigDict(extra="ignore")
    by: str
    eventId: str
    vm: str = ""
    until: datetime | None = None
    reason: str = ""


class EventView(BaseModel):
    """What a page shows of one event: the fields of its JSON summary."""

    model_config = ConfigDict(extra="ignore")
    eventId: str
    eventType: str
    eventSource: str = ""
    description: str = ""
    state: str
    notBefore: datetime | None = None
    durationInSeconds: int = -1
    resources: list[str] = Field(default_factory=list)
    reportingVms: list[str] = Field(default_factory=list)
    decision: DecisionRecord | None = None
    approval: ApprovalRecord | None = None
    heldBy: HeldByView | None = None
    failedHooks: dict[str, dict[str, str]] = Field(default_factory=dict)
    removed: list[str] = Field(default_factory=list)

    @classmethod
    def of(cls, summary: dict[str, Any]) -> EventView:
        return cls.model_validate(summary)

    @property
    def approve_path(self) -> str:
        """The approval page, on whichever origin the person is (the app's own)."""
        return f"{PENDING_PATH}/{quote(self.eventId, safe='')}/approve"


@dataclass(frozen=True)
class Hold:
    """What holds an event back, in words: what, since when, until when (None: not known, or nothing), and why."""

    what: str
    since: datetime | None
    until: datetime | None
    why: str


def hold_of(event: EventView) -> Hold:  # noqa: PLR0911 -- one answer per kind of hold
    """The window, blackout, gate, budget, hooks or delete that holds the event, or the person it waits for, or the
    approval on its way; the same facts the history's Decision row and the card name."""
    decision, approval, held = event.decision, event.approval, event.heldBy
    if held is not None and held.by == "platform":
        return Hold(f"the platform: delete of {held.vm or held.eventId}", None, held.until, held.reason)
    if held is not None:
        # The platform starts a scale set's pending deletes together: this one waits for that one to be ready.
        return Hold(f"delete of {held.vm or held.eventId} (not ready)", None, held.until, held.reason)
    if approval is not None and approval.delivered:
        return Hold("nothing (approved)", None, None, f"approved by {approval.actor}; StartRequests accepted")
    if approval is not None:
        last = (
            f"; attempt {approval.attempts}: {approval.outcome} {approval.reason}".rstrip() if approval.attempts else ""
        )
        return Hold(
            "its delivery to the VM", approval.decidedAt, event.notBefore, f"approved by {approval.actor}{last}"
        )
    if decision is None:
        return Hold("no decision yet", None, event.notBefore, "the coordinator has not decided on it yet")
    if decision.holdKind:
        what = f"{decision.holdKind} {decision.holdName!r}" if decision.holdName else decision.holdKind
        return Hold(what, decision.holdSince, decision.heldUntil, decision.reason)
    if decision.action == "wait-for-person":
        return Hold("a person's approval", decision.decidedAt, event.notBefore, decision.reason)
    if decision.verdict == "never":
        return Hold(f"rule {decision.rule!r} (never approves)", decision.decidedAt, event.notBefore, decision.reason)
    if decision.dryRun:
        return Hold("dry run (nothing is sent)", decision.decidedAt, event.notBefore, decision.reason)
    return Hold(f"rule {decision.rule!r}", decision.decidedAt, event.notBefore, decision.reason)


def not_approvable(event: EventView) -> str | None:
    """Why no one can approve this event now (None: a person with the role can)."""
    if event.approval is not None:
        approval = event.approval
        return (
            f"Already approved by {approval.actor} at {when(approval.decidedAt)} (now {event.state}): "
            "a second approval sends nothing."
        )
    if event.state != "Scheduled":
        return f"Only a Scheduled event can be approved; this one is {event.state}."
    return None


def when(moment: datetime | None) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC" if moment is not None else "—"


def time_left(not_before: datetime | None, now: datetime) -> str:
    if not_before is None:
        return "no NotBefore"
    seconds = int((not_before - now).total_seconds())
    if seconds <= 0:
        return f"passed {_span(-seconds)} ago"
    return _span(seconds)


def _span(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _time(moment: datetime | None) -> str:
    if moment is None:
        return "—"
    return f'<time datetime="{e(moment.isoformat())}">{e(when(moment))}</time>'


def _until(hold: Hold) -> str:
    if hold.until is not None:
        return _time(hold.until)
    return "—" if hold.what.startswith("nothing") else "not known"


def _page(title: str, body: str, *, person: str | None) -> str:
    who = f" · signed in as {e(person)}" if person else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>"
        f'<header>Scheduled events{who} · <a href="{PENDING_PATH}">open events</a></header>'
        f"<h1>{e(title)}</h1>{body}</body></html>"
    )


def _notice(text: str, tone: str = "") -> str:
    return f'<p class="notice {tone}">{e(text)}</p>'


def _facts(event: EventView, now: datetime) -> str:
    hold = hold_of(event)
    decision = event.decision
    rows: list[tuple[str, str]] = [
        ("EventId", e(event.eventId)),
        ("Type", e(f"{event.eventType} ({event.eventSource})")),
        ("State", e(event.state)),
        ("VMs", e(", ".join(event.resources) or "—")),
        ("NotBefore", f"{_time(event.notBefore)} <small>({e(time_left(event.notBefore, now))})</small>"),
        ("Duration", e("unknown" if event.durationInSeconds < 0 else f"{event.durationInSeconds} s")),
        ("Description", e(event.description or "—")),
        ("Decision", e(f"{decision.verdict} by rule {decision.rule!r} ({decision.action})") if decision else "—"),
        ("Held by", e(hold.what) + (f" <small>since {_time(hold.since)}</small>" if hold.since else "")),
        ("Until", _until(hold)),
        ("Why", e(hold.why or "—")),
        ("Reported by", e(", ".join(event.reportingVms) or "—")),
    ]
    failed = [
        f"{vm}: {phase} hook {hook!r}" for vm, hooks in event.failedHooks.items() for phase, hook in hooks.items()
    ]
    if failed:
        rows.append(("Failed hooks", e("; ".join(failed))))
    if event.removed:
        rows.append(("Removed", e(", ".join(event.removed))))
    cells = "".join(f"<tr><th>{e(name)}</th><td>{value}</td></tr>" for name, value in rows)
    return f'<table class="facts">{cells}</table>'


def approval_page(event: EventView, *, now: datetime, person: str, token: str | None, notice: str) -> str:
    """The page behind a card's "Approve now": the facts, what holds the event and until when, and, with ``token``,
    the one form that approves it (a GET never approves: a link preview must not)."""
    if token is not None:
        action = (
            '<form method="post"><input type="hidden" name="token" value="' + e(token) + '">'
            f'<button type="submit">Approve now as {e(person)}</button></form>'
            "<p><small>Approving lets the platform start the event before its NotBefore; the VM checks the facts "
            "against its own IMDS document first.</small></p>"
        )
    else:
        action = _notice(notice, "warn")
    title = f"Approve {event.eventType} of {', '.join(event.resources[:5]) or event.eventId}?"
    return _page(title, _facts(event, now) + action, person=person)


_RESULTS = {
    "approved": ("Approved", "good"),
    "sent": ("Approval decided, delivery retried", "warn"),
    "dry-run": ("Dry run: recorded, nothing sent", "warn"),
    "already-approved": ("Already approved", "warn"),
    "conflict": ("Not approved", "bad"),
    "not-found": ("No such event", "bad"),
}


def result_page(status: str, message: str, event: EventView | None, *, now: datetime, person: str) -> str:
    """The answer to an approval, with the event as it now stands."""
    title, tone = _RESULTS.get(status, (status, ""))
    body = _notice(message, tone) + (_facts(event, now) if event is not None else "")
    return _page(title, body, person=person)


def refusal_page(status: int, reason: str, *, person: str | None) -> str:
    title = {401: "Sign in first", 403: "Not allowed", 503: "Sign-in is not available"}.get(
        status, f"Refused ({status})"
    )
    return _page(title, _notice(reason, "bad"), person=person)


def pending_page(events: Iterable[EventView], *, now: datetime, person: str, may_approve: bool) -> str:
    """The open events, oldest NotBefore first: type, VMs, NotBefore and time left, rule, what holds each and until
    when, and where the person may approve, a link to its approval page."""
    rows = []
    for event in events:
        hold = hold_of(event)
        decision = event.decision
        rule = e(f"{decision.rule} ({decision.verdict})") if decision else "—"
        if not_approvable(event) is not None:
            act = "—" if event.approval is None else "approved"
        elif may_approve:
            act = f'<a href="{e(event.approve_path)}">Approve…</a>'
        else:
            act = "<small>look only (no approve role)</small>"
        since = f"<br><small>since {_time(hold.since)}</small>" if hold.since else ""
        rows.append(
            f'<tr data-event-id="{e(event.eventId)}">'
            f'<td><a href="{e(event.approve_path)}">{e(event.eventType)}</a> <small>{e(event.eventSource)}</small>'
            f'<br><small title="{e(event.eventId)}">{e(event.eventId[:8])}</small></td>'
            f"<td>{e(event.state)}</td><td>{e(', '.join(event.resources) or '—')}</td>"
            f'<td class="when">{_time(event.notBefore)}</td><td class="when">{e(time_left(event.notBefore, now))}</td>'
            f"<td>{rule}</td>"
            f'<td>{e(hold.what)}{since}<br><small>{e(hold.why)}</small></td><td class="when">{_until(hold)}</td>'
            f"<td>{act}</td></tr>"
        )
    head = "".join(
        f"<th>{name}</th>"
        for name in ("Event", "State", "VMs", "NotBefore", "Time left", "Rule", "Held by", "Until", "Approve")
    )
    count = len(rows)
    table = (
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        if rows
        else _notice("No open events.", "good")
    )
    body = f"<p><small>{count} open event(s) as of {e(when(now))}.</small></p>{table}"
    return _page("Open scheduled events", body, person=person)
