"""A person approves from the Teams card in a real browser, and sees what is pending.

The whole local stack (a forwarder process per VM, the Event Hubs, Relay and IMDS emulators, the coordinator in
function_app) with the people's routes served as the Functions host would (local/http_host.py) behind the stand-in
of App Service Authentication (local/easy_auth.py), driven in headless Chromium (tests/local/browser.py) as people
would: the card is rendered by Microsoft's Adaptive Cards renderer and its "Approve now" followed; the people's
pages are used with JavaScript off (they need none); only the card (Teams renders it with JavaScript) and the
hostile page run scripts. Screenshots of every page are saved in .local/screenshots/people/ (printed).

The events, one per check so that the tests do not depend on each other: Reboots that wait for a person (approve,
double click, no role, cross site), and events held by a gate, a window, a failing prepare hook, and a delete
coupled to it, for the open-events page.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from coordinator.adapters.history import SqliteHistory
from coordinator.http import APPROVE_ROLE, READ_ROLE
from emulators.imds import Scenario
from local.easy_auth import LocalPerson
from local.http_host import ROUTES
from local.stack import LocalStack
from local.stack_options import StackOptions
from tests.coordinator.test_card_rendering import render
from tests.local.browser import Browser, Profile, Tab

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / ".local" / "screenshots" / "people"
APPROVER = LocalPerson("alice@contoso.test", "Alice Approver", (APPROVE_ROLE,))
READER = LocalPerson("rita@contoso.test", "Rita Reader", (READ_ROLE,))
NO_ROLE = LocalPerson("nick@contoso.test", "Nick Norole")
# From a VM: shown on the pages as text, never as markup.
HOSTILE_DESCRIPTION = "Host maintenance <script>document.title='pwned'</script><img src=x onerror=alert(1)> & \"more\""
REBOOTS = ("approve", "double-click", "no-role", "cross-site")


def scenario() -> Scenario:
    vms: list[dict[str, Any]] = [
        {"name": "web_0"},
        {"name": "web_1"},
        {"name": "app_0", "placementGroupId": "app"},
        {"name": "batch_0", "placementGroupId": "batch"},
        # Two instances a scale-in deletes: api_0's drain fails, so api_1's delete, drained, waits for it (its
        # drain takes long enough for the coordinator to know both deletes by then: else it approves api_1's
        # alone, and the platform holds it instead).
        {"name": "api_0", "vmScaleSetName": "api", "hooks": {"prepare": [{"name": "10-drain", "exitCode": 1}]}},
        {
            "name": "api_1",
            "vmScaleSetName": "api",
            "hooks": {"prepare": [{"name": "10-drain", "exitCode": 0, "seconds": 5}]},
        },
    ]
    reboots = [
        {"ref": "approve", "Resources": ["web_0"], "Description": HOSTILE_DESCRIPTION},
        {"ref": "double-click", "Resources": ["web_1"]},
        {"ref": "no-role", "Resources": ["app_0"]},
        {"ref": "cross-site", "Resources": ["batch_0"]},
    ]
    steps = [{"at": 0, "create": {"EventType": "Reboot", "NoticeSeconds": 900, **r}} for r in reboots]
    steps += [
        {"at": 0, "create": {"ref": "gated", "EventType": "Redeploy", "Resources": ["app_0"], "NoticeSeconds": 900}},
        {"at": 0, "create": {"ref": "windowed", "EventType": "Freeze", "Resources": ["batch_0"], "NoticeSeconds": 900}},
        {"at": 0, "create": {"ref": "hooks", "EventType": "Terminate", "Resources": ["api_0"]}},
        {"at": 0, "create": {"ref": "delete", "EventType": "Terminate", "Resources": ["api_1"]}},
    ]
    return Scenario.from_mapping(
        {
            "name": "people-in-a-browser",
            "scaleSets": {"api": {"terminateNotification": True, "terminateNotBeforeSeconds": 900}},
            "vms": vms,
            "steps": steps,
        }
    )


def policy(closed_port: int) -> str:
    return f"""version: 1
gates:
  app-health:
    http: {{url: "http://127.0.0.1:{closed_port}/health", expectStatus: [200], timeoutSeconds: 1}}
rules:
  - name: deletes-after-drain
    match: {{eventType: [Terminate]}}
    action: approve-after-hooks
    hooks: {{deadlineSeconds: 900, onDeadline: wait}}
  - name: redeploy-while-healthy
    match: {{eventType: [Redeploy]}}
    action: approve-now
    gates: [app-health]
  - name: freeze-in-the-night
    match: {{eventType: [Freeze]}}
    action: approve-now
    window: {{schedule: "0 1 1 1 *", duration: 1m, timeZone: Europe/Oslo}}
  - name: reboots-wait-for-a-person
    match: {{eventType: [Reboot]}}
    action: wait-for-person
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Fleet:
    stack: LocalStack
    ids: dict[str, str]  # scenario ref -> EventId

    @property
    def url(self) -> str:
        return self.stack.people_url

    def approve_url(self, ref: str) -> str:
        return f"{self.url}/api/events/{self.ids[ref]}/approve"

    def summary(self, ref: str) -> dict[str, Any]:
        import function_app

        event_id = self.ids[ref]
        pending: list[dict[str, Any]] = function_app.coordinator().pending()
        return next(e for e in pending if e["eventId"] == event_id)

    def start_requests(self, ref: str) -> list[dict[str, Any]]:
        """StartRequests the IMDS emulator recorded for the event (each VM's POST)."""
        assert self.stack.imds is not None
        return [a for a in self.stack.imds.approvals() if a["EventId"] == self.ids[ref]]

    def person_decisions(self, ref: str) -> list[dict[str, Any]]:
        history = SqliteHistory(self.stack.history_path)
        try:
            return history.query(
                "SELECT Actor FROM ScheduledEventsHistory_CL "
                "WHERE RecordType = 'Decision' AND EventId = ? AND Rule = 'manual'",
                (self.ids[ref],),
            )
        finally:
            history.close()

    def card(self, ref: str) -> dict[str, Any]:
        message = json.loads((self.stack.cards_dir / f"{self.ids[ref]}-new-event.json").read_text())
        card: dict[str, Any] = message["attachments"][0]["content"]
        return card


# What each event waits for once the coordinator has decided on it: (the decision's action, what holds it).
EXPECTED_HOLDS = {
    **{ref: ("wait-for-person", "") for ref in REBOOTS},
    "gated": ("approve-now", "gate"),
    "windowed": ("approve-now", "window"),
    "hooks": ("approve-after-hooks", "hooks"),
    "delete": ("approve-after-hooks", "delete"),
}


def holds(fleet: Fleet) -> dict[str, tuple[str, str]]:
    """Each event's decision as (action, what holds it), ("", "") while undecided or not listed yet."""
    listed = {}
    for ref in fleet.ids:
        try:
            decision = fleet.summary(ref)["decision"] or {}
        except StopIteration:
            decision = {}
        listed[ref] = (str(decision.get("action", "")), str(decision.get("holdKind", "")))
    return listed


def ready(fleet: Fleet) -> bool:
    cards = all((fleet.stack.cards_dir / f"{fleet.ids[ref]}-new-event.json").exists() for ref in REBOOTS)
    return cards and holds(fleet) == EXPECTED_HOLDS


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("people")
    policy_path = workdir / "policy.yaml"
    policy_path.write_text(policy(free_port()), encoding="utf-8")
    options = StackOptions(
        scenario=scenario(),
        workdir=workdir / "run",
        time_scale=1.0,  # real time: the events stay Scheduled (900 s notices) while people click
        lead_in=1.0,
        heartbeat_interval=2.0,
        timer_interval=1.0,
        policy_path=policy_path,
        people=(APPROVER, READER, NO_ROLE),
    )
    with LocalStack(options) as stack:
        assert stack.imds is not None
        deadline = time.monotonic() + 60
        ids: dict[str, str] = {}
        while time.monotonic() < deadline and len(ids) < 8:
            ids = {str(e["ref"]): str(e["EventId"]) for e in stack.imds.events() if e.get("ref")}
            time.sleep(0.2)
        fleet = Fleet(stack, ids)
        while time.monotonic() < deadline and not ready(fleet):
            time.sleep(0.3)
        assert holds(fleet) == EXPECTED_HOLDS
        assert ready(fleet), "the Reboots' cards were not written"
        yield fleet


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with Browser(SCREENSHOTS) as chromium:
        print(f"\nscreenshots of the people's pages: {SCREENSHOTS}")
        yield chromium


def signed_in(browser: Browser, fleet: Fleet, person: LocalPerson, *, javascript: bool = False) -> Profile:
    """A browser profile in which ``person`` signed in at the stand-in (the sign-in page, then back to the app)."""
    profile = browser.profile(javascript=javascript)
    tab = profile.tab()
    page = tab.goto(f"{fleet.url}/api/events")
    assert "/.auth/login/aad" in page.url, page.url  # no session: the platform sends a person to sign in
    assert f"Sign in as {person.upn}" in page.text
    back = tab.click(f"Sign in as {person.upn}")
    assert back.url == f"{fleet.url}/api/events"
    assert f"signed in as {person.upn}" in back.text
    return profile


def follow_card(fleet: Fleet, ref: str, name: str, work: Path) -> str:
    """The event's Teams card rendered by the Adaptive Cards renderer in Chromium; its "Approve now" button
    clicked: the URL the card hands to the browser."""
    rendered = render({name: fleet.card(ref)}, work)[name]
    shutil.copy(rendered["screenshot"], SCREENSHOTS / f"{name}.png")
    assert rendered["events"] == []
    assert rendered["text"].splitlines()[0] == "New scheduled event needs a person's approval: Reboot"
    (button,) = rendered["actions"]
    assert button["title"] == "Approve now"
    url: str = button["url"]
    return url


def test_the_local_host_serves_function_apps_http_routes() -> None:
    from tests.coordinator.test_function_app import indexed

    declared = {
        (binding["route"], name, frozenset(m.upper() for m in binding["methods"]))
        for name, function in indexed().items()
        for binding in function["bindings"]
        if binding["type"] == "httpTrigger"
    }
    assert set(ROUTES) == declared


@pytest.mark.slow
def test_a_person_approves_from_the_card(fleet: Fleet, browser: Browser, tmp_path: Path) -> None:
    url = follow_card(fleet, "approve", "00-card", tmp_path)
    assert url == fleet.approve_url("approve")
    tab = browser.profile(javascript=False).tab()
    signin = tab.goto(url)
    tab.screenshot("01-sign-in")
    assert "Local stand-in for Entra ID sign-in" in signin.text
    page = tab.click(f"Sign in as {APPROVER.upn}")
    assert (page.status, page.url) == (200, url)  # back where the card's link pointed
    tab.screenshot("02-approval-page")
    words = page.words()
    summary = fleet.summary("approve")
    for fact in (
        "Approve Reboot of web_0?",
        f"EventId {fleet.ids['approve']}",
        "Type Reboot (Platform)",
        "State Scheduled",
        "VMs web_0",
        "Decision wait by rule 'reboots-wait-for-a-person' (wait-for-person)",
        "Held by a person's approval",
        f"Until {summary['notBefore'][:19].replace('T', ' ')} UTC",  # NotBefore: then the platform starts it
        f"Description {' '.join(HOSTILE_DESCRIPTION.split())}",  # the VM's markup shown as text
    ):
        assert fact in words, f"{fact!r} not on the page: {words}"
    assert "min" in words.split("NotBefore", 1)[1].split("Duration", 1)[0]  # the time left
    assert fleet.start_requests("approve") == []  # opening the page approves nothing

    result = tab.click(f"Approve now as {APPROVER.upn}")
    tab.screenshot("03-approved")
    assert result.posts == 1
    assert result.status == 200, result.text
    assert result.words().startswith(f"Scheduled events · signed in as {APPROVER.upn}")
    assert f"Approved event {fleet.ids['approve']} approved by {APPROVER.upn}" in result.words()
    assert "Held by nothing (approved)" in result.words()
    (start,) = fleet.start_requests("approve")  # StartRequests reached the VM's IMDS, once
    assert (start["vm"], start["statusBefore"]) == ("web_0", "Scheduled")
    assert fleet.person_decisions("approve") == [{"Actor": f"person:{APPROVER.upn}"}]


@pytest.mark.slow
def test_clicks_in_two_tabs_at_once_and_a_double_click_approve_once(fleet: Fleet, browser: Browser) -> None:
    profile = signed_in(browser, fleet, APPROVER)
    tabs = [profile.tab() for _ in range(3)]
    url = fleet.approve_url("double-click")
    for tab in tabs:  # the card's link opened three times
        assert f"Approve now as {APPROVER.upn}" in tab.goto(url).text
    # Two tabs' Approve at the same moment: the requests race; one decides, the other is told.
    racing = browser.click_together(tabs[:2], f"Approve now as {APPROVER.upn}")
    tabs[1].screenshot("04-second-of-two-at-once")
    assert [answer.posts for answer in racing] == [1, 1]
    assert sorted(answer.status for answer in racing) == [200, 409], [answer.text for answer in racing]
    told = next(answer for answer in racing if answer.status == 409).words()
    assert f"Already approved event {fleet.ids['double-click']} is already approved by person:{APPROVER.upn}" in told
    assert "nothing more is sent" in told
    # The third tab's form is stale: a double click on it is answered the same, and sends nothing. Each submit it
    # sent is answered 409, or its answer never reached the page (None: the second submit replaced the first while
    # it was on its way); when the first answer loads before the second click, that click lands on the answer page
    # (a fresh-clone run showed the event's page, 200, after one POST answered 409). When the harness saw no answer
    # (a fresh-clone run at 7a4dc14: one POST, aborted, the server's 409 written to a closed connection), Chromium
    # shows the answer or leaves the stale form: the pages have no script (their CSP allows none) to hold a second
    # submit back. Either way, below: nothing more was sent.
    clicked = tabs[2].double_click(f"Approve now as {APPROVER.upn}")
    tabs[2].screenshot("05-double-click-on-a-stale-page")
    assert clicked.posts >= 1
    assert len(clicked.answers) == clicked.posts, clicked.answers
    assert set(clicked.answers) <= {409, None}, clicked.answers
    words = clicked.words()
    answered = "nothing more is sent" in words or "Already approved by person:" in words
    assert answered or (set(clicked.answers) == {None} and f"Approve now as {APPROVER.upn}" in clicked.text), words
    # Opened again, the page says it is approved, without a form.
    reopened = tabs[2].goto(url)
    assert "Already approved by person:" in reopened.words()
    assert "Approve now as" not in reopened.text
    time.sleep(1.0)  # anything a second decision would have sent has arrived by now
    assert len(fleet.start_requests("double-click")) == 1
    assert fleet.person_decisions("double-click") == [{"Actor": f"person:{APPROVER.upn}"}]


@pytest.mark.slow
def test_without_the_approve_role_a_person_sees_why_and_cannot_approve(fleet: Fleet, browser: Browser) -> None:
    url = fleet.approve_url("no-role")
    reader = signed_in(browser, fleet, READER).tab()
    page = reader.goto(url)
    reader.screenshot("06-reader-approval-page")
    assert page.status == 200
    assert "Approve Reboot of app_0?" in page.words()
    assert f"You ({READER.upn}) may look, not approve: that needs the {APPROVE_ROLE} app role." in page.words()
    assert "Approve now" not in page.text
    listed = reader.goto(f"{fleet.url}/api/events")
    assert "look only (no approve role)" in listed.text
    assert "Approve…" not in listed.text

    nobody = signed_in(browser, fleet, NO_ROLE).tab()
    refused = nobody.goto(url)
    nobody.screenshot("07-no-role")
    assert refused.status == 403
    assert "Not allowed" in refused.words()
    assert f"{NO_ROLE.upn} has neither the {READ_ROLE} nor the {APPROVE_ROLE} app role" in refused.words()
    assert "Approve now" not in refused.text
    assert nobody.goto(f"{fleet.url}/api/events").status == 403
    assert fleet.start_requests("no-role") == []
    assert fleet.person_decisions("no-role") == []


class _HostilePage(BaseHTTPRequestHandler):
    """Another site's page that makes the visitor's browser post the approval form at once."""

    target = ""

    def do_GET(self) -> None:
        page = (
            "<!doctype html><title>You won!</title>"
            f'<form id="f" method="post" action="{self.target}"><input type="hidden" name="token" value="1.x"></form>'
            "<script>window.onload = () => document.getElementById('f').submit()</script>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.slow
def test_a_cross_site_page_cannot_approve(fleet: Fleet, browser: Browser) -> None:
    handler = type("Hostile", (_HostilePage,), {"target": fleet.approve_url("cross-site")})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        # A signed-in approver with scripts on visits another site (localhost is another site than 127.0.0.1),
        # and a page of another origin on the app's host.
        tab = signed_in(browser, fleet, APPROVER, javascript=True).tab()
        for n, origin in enumerate((f"http://localhost:{port}", f"http://127.0.0.1:{port}")):
            tab.goto(f"{origin}/prize")
            landed = tab.arrive(fleet.approve_url("cross-site"))
            tab.screenshot(f"08-cross-site-{n}")
            assert landed.url == fleet.approve_url("cross-site")
            assert landed.status == 403, landed.text  # refused by the app itself: the session cookie came along
            assert f"the request comes from '{origin}', not from this app" in landed.words()
    finally:
        server.shutdown()
        server.server_close()
    assert fleet.start_requests("cross-site") == []
    assert fleet.person_decisions("cross-site") == []


@pytest.mark.slow
def test_the_open_events_page_shows_what_holds_each(fleet: Fleet, browser: Browser) -> None:
    profile = signed_in(browser, fleet, APPROVER)
    tab: Tab = profile.tab()
    page = tab.goto(f"{fleet.url}/api/events")
    tab.screenshot("09-open-events")
    assert page.status == 200
    assert "Open scheduled events" in page.text
    header = "Event State VMs NotBefore Time left Rule Held by Until Approve"
    assert header in page.words()
    ids = fleet.ids

    def row(ref: str) -> str:
        return tab.text_of(f'tr[data-event-id="{ids[ref]}"]')

    summaries = {ref: fleet.summary(ref) for ref in ids}

    def shown(moment: str | None) -> str:
        return f"{moment[:19].replace('T', ' ')} UTC" if moment else "not known"

    def decided_until(ref: str) -> str:
        return shown(summaries[ref]["decision"]["heldUntil"])

    # Per event: its VMs, rule (verdict), what holds it, and until when.
    expectations = {
        "gated": ("Redeploy", "app_0", "redeploy-while-healthy (wait)", "gate 'app-health'", decided_until("gated")),
        "windowed": (
            "Freeze",
            "batch_0",
            "freeze-in-the-night (wait)",
            "window 'freeze-in-the-night'",
            decided_until("windowed"),  # the window's next opening
        ),
        "hooks": ("Terminate", "api_0", "deletes-after-drain (wait)", "hooks 'api_0'", decided_until("hooks")),
        "delete": (
            "Terminate",
            "api_1",
            "deletes-after-drain (wait)",
            "delete of api_0 (not ready)",
            shown(summaries["delete"]["heldBy"]["until"]),  # the NotBefore of api_0's delete
        ),
        "cross-site": (
            "Reboot",
            "batch_0",
            "reboots-wait-for-a-person (wait)",
            "a person's approval",
            shown(summaries["cross-site"]["notBefore"]),  # then the platform starts it regardless
        ),
    }
    for ref, (kind, vm, rule, hold, until) in expectations.items():
        text = row(ref)
        expected = (kind, "Scheduled", vm, shown(summaries[ref]["notBefore"]), "min", rule, hold, until, "Approve…")
        for part in expected:
            assert part in text, f"{ref}: {part!r} not in {text!r}"
    assert "not known" not in row("windowed")
    # A person with the role may approve what waits: a link to its approval page, which opens it.
    opened = tab.click("Approve…")
    assert opened.url in {fleet.approve_url(ref) for ref in ids}
    assert f"Approve now as {APPROVER.upn}" in opened.text

    # The same list stays JSON for scripts.
    scripted = profile.fetch(f"{fleet.url}/api/events", accept="application/json")
    assert scripted["status"] == 200
    assert scripted["contentType"].startswith("application/json")
    listed = json.loads(scripted["body"])
    assert {ids[ref] for ref in expectations} <= {event["eventId"] for event in listed["events"]}
    browsers = profile.fetch(f"{fleet.url}/api/events", accept="text/html,application/xhtml+xml,*/*;q=0.8")
    assert browsers["contentType"].startswith("text/html")
