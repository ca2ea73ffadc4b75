"""The people's pages (coordinator/pages.py), pure: what holds an event and until when, the time left, who gets an
approve link, and that nothing an event carries (its facts come from VMs) is ever markup on a page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from typing import Any

import pytest

from coordinator import pages
from coordinator.pages import EventView, hold_of, time_left

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
NOT_BEFORE = NOW + timedelta(minutes=15)
HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>\"'&amp;"
# Every element the pages themselves write; anything else on a page came from a value.
PAGE_TAGS = {
    "html", "head", "meta", "title", "style", "body", "header", "a", "h1", "p", "small", "table", "thead", "tbody",
    "tr", "th", "td", "time", "br", "form", "input", "button",
}  # fmt: skip


def decision(**fields: Any) -> dict[str, Any]:
    return {
        "decisionId": "d-1",
        "rule": "everything-else-waits",
        "action": "wait-for-person",
        "verdict": "wait",
        "reason": "rule 'everything-else-waits' waits for a person",
        "decidedAt": NOW.isoformat(),
    } | fields


def summary(**fields: Any) -> dict[str, Any]:
    """An event as GET /api/events summarizes it (coordinator/pipeline/people.py, summarize)."""
    return {
        "eventId": "3F2A9C1E-0B7D-4E55-9A21-6C0D2B8E4F10",
        "eventType": "Reboot",
        "eventSource": "Platform",
        "description": "Host server is undergoing maintenance.",
        "state": "Scheduled",
        "stateSince": NOW.isoformat(),
        "notBefore": NOT_BEFORE.isoformat(),
        "durationInSeconds": -1,
        "resources": ["web_0", "web_1"],
        "reportingVms": ["web_0"],
        "goneFrom": [],
        "decision": decision(),
        "approval": None,
        "heldBy": None,
        "failedHooks": {},
        "removed": [],
        "approveUrl": "https://app.example/api/events/3F2A9C1E-0B7D-4E55-9A21-6C0D2B8E4F10/approve",
    } | fields


class _Page(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attributes: list[tuple[str, str | None]] = []
        self.texts: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attributes.extend(attrs)

    def handle_data(self, data: str) -> None:
        self.texts.append(data)

    @property
    def text(self) -> str:
        return "".join(self.texts)


HOLDS = [
    pytest.param(
        decision(
            action="approve-now",
            holdKind="blackout",
            holdName="year-end",
            holdSince=NOW.isoformat(),
            heldUntil=(NOW + timedelta(days=2)).isoformat(),
        ),
        None,
        None,
        ("blackout 'year-end'", NOW, NOW + timedelta(days=2)),
        id="blackout",
    ),
    pytest.param(
        decision(action="approve-now", holdKind="window", holdName="nights", heldUntil="2026-11-20T22:00:00+00:00"),
        None,
        None,
        ("window 'nights'", None, datetime(2026, 11, 20, 22, 0, tzinfo=UTC)),
        id="window",
    ),
    pytest.param(
        decision(action="approve-now", holdKind="gate", holdName="app-health", holdSince=NOW.isoformat()),
        None,
        None,
        ("gate 'app-health'", NOW, None),  # a failing gate's end is not known
        id="gate",
    ),
    pytest.param(
        decision(action="approve-within-budget", holdKind="budget", holdName="scaleSet web: 1 of 1 impacted"),
        None,
        None,
        ("budget 'scaleSet web: 1 of 1 impacted'", None, None),
        id="budget",
    ),
    pytest.param(
        decision(action="approve-after-hooks", holdKind="hooks", holdName="web_1", heldUntil=NOT_BEFORE.isoformat()),
        None,
        None,
        ("hooks 'web_1'", None, NOT_BEFORE),
        id="hooks",
    ),
    pytest.param(
        decision(action="approve-after-hooks", holdKind="delete", heldBy="E-2", heldByVm="web_2"),
        None,
        {"by": "coordinator", "eventId": "E-2", "vm": "web_2", "until": NOT_BEFORE.isoformat(), "reason": "not ready"},
        ("delete of web_2 (not ready)", None, NOT_BEFORE),
        id="delete",
    ),
    pytest.param(
        decision(verdict="approve", action="approve-now"),
        {"decisionId": "d-1", "rule": "r", "actor": "rule:r", "decidedAt": NOW.isoformat(), "delivered": True},
        {"by": "platform", "eventId": "E-2", "vm": "web_2", "until": NOT_BEFORE.isoformat(), "reason": "held"},
        ("the platform: delete of web_2", None, NOT_BEFORE),
        id="platform",
    ),
    pytest.param(decision(), None, None, ("a person's approval", NOW, NOT_BEFORE), id="person"),
    pytest.param(
        decision(action="never-approve", verdict="never"),
        None,
        None,
        ("rule 'everything-else-waits' (never approves)", NOW, NOT_BEFORE),
        id="never",
    ),
    pytest.param(
        decision(verdict="approve", action="manual-approval"),
        {"decisionId": "d-1", "rule": "manual", "actor": "person:ada", "decidedAt": NOW.isoformat(), "attempts": 2},
        None,
        ("its delivery to the VM", NOW, NOT_BEFORE),
        id="approval-on-its-way",
    ),
    pytest.param(
        decision(verdict="approve", action="manual-approval"),
        {"decisionId": "d-1", "rule": "manual", "actor": "person:ada", "decidedAt": NOW.isoformat(), "delivered": True},
        None,
        ("nothing (approved)", None, None),
        id="approved",
    ),
    pytest.param(None, None, None, ("no decision yet", None, NOT_BEFORE), id="undecided"),
]


@pytest.mark.parametrize(("decided", "approval", "held_by", "expected"), HOLDS)
def test_what_holds_an_event_and_until_when(
    decided: dict[str, Any] | None,
    approval: dict[str, Any] | None,
    held_by: dict[str, Any] | None,
    expected: tuple[str, datetime | None, datetime | None],
) -> None:
    event = EventView.of(summary(decision=decided, approval=approval, heldBy=held_by))
    hold = hold_of(event)
    assert (hold.what, hold.since, hold.until) == expected
    page = pages.pending_page([event], now=NOW, person="ada", may_approve=True)
    shown = _Page(page).text
    assert expected[0] in shown
    if expected[2] is not None:
        assert pages.when(expected[2]) in shown
    elif hold.what != "nothing (approved)":
        assert "not known" in shown


def test_time_left() -> None:
    assert time_left(NOW + timedelta(minutes=14, seconds=5), NOW) == "14 min 5 s"
    assert time_left(NOW + timedelta(seconds=42), NOW) == "42 s"
    assert time_left(NOW + timedelta(hours=2, minutes=3, seconds=9), NOW) == "2 h 3 min"
    assert time_left(NOW - timedelta(seconds=75), NOW) == "passed 1 min 15 s ago"
    assert time_left(None, NOW) == "no NotBefore"


def test_only_a_person_with_the_role_gets_approve_links() -> None:
    waiting = EventView.of(summary())
    approved = EventView.of(
        summary(
            eventId="E-2",
            approval={
                "decisionId": "d",
                "rule": "r",
                "actor": "rule:r",
                "decidedAt": NOW.isoformat(),
                "delivered": True,
            },
        )
    )
    started = EventView.of(summary(eventId="E-3", state="Started", decision=None))
    link = f'href="/api/events/{waiting.eventId}/approve">Approve…</a>'
    for_approver = pages.pending_page([waiting, approved, started], now=NOW, person="ada", may_approve=True)
    assert for_approver.count("Approve…") == 1
    assert link in for_approver
    for_reader = pages.pending_page([waiting, approved, started], now=NOW, person="rita", may_approve=False)
    assert "Approve…" not in for_reader
    assert "look only (no approve role)" in for_reader
    assert pages.not_approvable(started) == "Only a Scheduled event can be approved; this one is Started."
    assert pages.not_approvable(approved) == (
        "Already approved by rule:r at 2026-11-20 12:00:00 UTC (now Scheduled): a second approval sends nothing."
    )


def test_nothing_an_event_carries_becomes_markup() -> None:
    hostile = summary(
        eventId=f"E{HOSTILE}",
        eventType=f"Reboot{HOSTILE}",
        eventSource=HOSTILE,
        description=HOSTILE,
        state=f"Scheduled{HOSTILE}",
        resources=[f"web_0{HOSTILE}"],
        reportingVms=[HOSTILE],
        decision=decision(rule=HOSTILE, reason=HOSTILE, holdKind="hooks", holdName=HOSTILE),
        failedHooks={HOSTILE: {"prepare": HOSTILE}},
        removed=[HOSTILE],
    )
    event = EventView.of(hostile)
    person = f"ada{HOSTILE}"
    rendered = [
        pages.approval_page(event, now=NOW, person=person, token=f"1.{HOSTILE}", notice=""),
        pages.approval_page(event, now=NOW, person=person, token=None, notice=HOSTILE),
        pages.result_page("approved", HOSTILE, event, now=NOW, person=person),
        pages.refusal_page(403, HOSTILE, person=person),
        pages.pending_page([event], now=NOW, person=person, may_approve=True),
    ]
    for page in rendered:
        parsed = _Page(page)
        assert parsed.tags <= PAGE_TAGS, parsed.tags - PAGE_TAGS
        assert {name for name, _ in parsed.attributes} <= {
            "lang", "charset", "name", "content", "href", "class", "datetime", "method", "type", "value", "title",
            "data-event-id",
        }  # fmt: skip
        assert HOSTILE in parsed.text or any(HOSTILE in (value or "") for _, value in parsed.attributes)
    # The event's own values are text where they are shown, and stay inside their attribute where they are not.
    assert f"Description{HOSTILE}" in _Page(rendered[0]).text
    assert ("value", f"1.{HOSTILE}") in _Page(rendered[0]).attributes
    assert ("data-event-id", f"E{HOSTILE}") in _Page(rendered[4]).attributes


def test_pages_allow_no_script_and_no_framing() -> None:
    policy = pages.HEADERS["Content-Security-Policy"]
    assert "default-src 'none'" in policy
    assert "script-src" not in policy  # so no script runs, whatever a page holds
    assert "frame-ancestors 'none'" in policy
    assert "form-action 'self'" in policy
    assert pages.HEADERS["X-Frame-Options"] == "DENY"
    assert pages.HEADERS["Cache-Control"] == "no-store"  # the approval form carries a person's token
