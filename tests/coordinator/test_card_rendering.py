"""Every card the coordinator sends (each AlertKind, built by build_card / build_vm_card) and the Logic App's alert
card, rendered by Microsoft's Adaptive Cards renderer (npm `adaptivecards`) in headless Chromium
(tools/node/render-cards.js): the renderer reports nothing newer than the card version Teams Workflows render (1.4)
and nothing unknown, a person reads the title, the facts and the explanation, the "Approve now" button opens the
approval link, and a screenshot of each card is saved (its folder is printed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, get_args

import pytest

from contracts.envelope import VmIdentity
from coordinator.domain.cards import CARD_VERSION, build_card, build_vm_card
from coordinator.domain.model import (
    AlertKind,
    EventRecord,
    FactConflict,
    ImdsFailure,
    VmRecord,
)
from tests.coordinator.helpers import approval_record, decision_record
from tests.infra import bicep_model as bm

ROOT = Path(__file__).resolve().parents[2]
RENDERER = ROOT / "tools" / "node" / "render-cards.js"
CHROMIUM = Path("/usr/bin/chromium")
NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
APPROVE_URL = "https://se-coordinator.azurewebsites.net/api/events/3F2A9C1E-0B7D-4E55-9A21-6C0D2B8E4F10/approve"
VM_KINDS = ("heartbeat-lost", "forwarder-conflict", "imds-failing")
# What a person reads first on each card.
TITLES = {
    "new-event": "New scheduled event: Reboot",
    "approved": "Event approved: Reboot",
    "started-without-notice": "Event started without notice: Reboot",
    "canceled": "Event canceled: Reboot",
    "expired": "Event expired unapproved: Reboot",
    "approval-failed": "Approval failed: Reboot",
    "approval-refused": "Approval refused by the VM: Reboot",
    "not-started": "Approved, but not started: Reboot",
    "facts-conflict": "Conflicting reports of an event: Reboot",
    "heartbeat-lost": "VM heartbeat lost: web_3",
    "forwarder-conflict": "Two forwarders report as one VM: web_3",
    "imds-failing": "Forwarder alive, IMDS failing: web_3",
}


def record() -> EventRecord:
    decided = {"decisionId": "d-1", "rule": "everything-else-waits", "decidedAt": NOW}
    return EventRecord(
        eventId="3F2A9C1E-0B7D-4E55-9A21-6C0D2B8E4F10",
        eventType="Reboot",
        eventSource="Platform",
        resources=["web_0", "web_1"],
        description="Host server is undergoing maintenance.",
        durationInSeconds=-1,
        notBefore=NOW + timedelta(minutes=15),
        stateSince=NOW,
        createdAt=NOW,
        decision=decision_record(
            action="wait-for-person", verdict="approve", reason="approved by alice@contoso.com", **decided
        ),
        approval=approval_record(
            actor="person:alice@contoso.com",
            outcome="approved",
            executor="web_0",
            confirmBy=NOW + timedelta(minutes=5),
            **decided,
        ),
        conflicts=[FactConflict(vm="web_1", observedAt=NOW, sequence=7, facts={"EventType": ("Reboot", "Redeploy")})],
        conflictCount=1,
    )


# A log search alert as the action group hands it to the Logic App (the common alert schema), for the card's fields.
ALERT_PAYLOAD = {
    "schemaId": "azureMonitorCommonAlertSchema",
    "data": {
        "essentials": {
            "alertRule": "se-alert-cards-failing",
            "severity": "Sev1",
            "monitorCondition": "Fired",
            "firedDateTime": "2026-11-20T12:05:00.0000000Z",
            "description": "The coordinator could not deliver Teams cards.",
        },
        "alertContext": {
            "condition": {"allOf": [{"linkToFilteredSearchResultsUI": "https://portal.azure.com/#blade/results"}]}
        },
    },
}
_PATH = r"triggerBody\(\)((?:\?\['[^']+'\])+)"


def _follow(value: Any, path: str) -> Any:
    for key in re.findall(r"\['([^']+)'\]", path):
        value = value[key]
    return value


def fill_logic_app_expressions(text: str) -> str:
    """The Logic App's @{...} expressions the card uses (a triggerBody() path, or first() of one then a key), filled
    from ALERT_PAYLOAD as the Logic App would; any other expression is left as is (and fails the test below)."""
    text = re.sub(
        r"@\{first\(" + _PATH + r"\)((?:\?\['[^']+'\])+)\}",
        lambda m: str(_follow(_follow(ALERT_PAYLOAD, m.group(1))[0], m.group(2))),
        text,
    )
    return re.sub(r"@\{" + _PATH + r"\}", lambda m: str(_follow(ALERT_PAYLOAD, m.group(1))), text)


def cards() -> dict[str, dict[str, Any]]:
    """Every kind's card as the Teams message carries it, plus the Logic App's card from alerts.bicep."""
    vm = VmRecord(
        identity=VmIdentity(
            name="web_3",
            vmId="0a1b2c3d-0000-4000-8000-000000000003",
            resourceId="/subscriptions/0/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/3",
            vmScaleSetName="web",
            placementGroupId="pg-1",
        ),
        lastSeen=NOW - timedelta(minutes=6),
        imdsFailing=ImdsFailure(since=NOW - timedelta(minutes=7), reason="no good IMDS poll for 95 s (limit 60 s)"),
    )
    built: dict[str, dict[str, Any]] = {}
    for kind in get_args(AlertKind):
        if kind in VM_KINDS:
            message = build_vm_card(kind, vm, now=NOW, timeout_seconds=300)
        else:
            message = build_card(kind, record(), now=NOW, approve_url=APPROVE_URL)
        (attachment,) = message["attachments"]
        assert attachment["contentType"] == "application/vnd.microsoft.card.adaptive"
        built[kind] = attachment["content"]
    poster = bm.resource_body(bm.parse(bm.INFRA / "modules" / "alerts.bicep")["resources"]["teamsPoster"])
    body = poster["properties"]["definition"]["actions"]["Post_card"]["inputs"]["body"]
    filled = fill_logic_app_expressions(json.dumps(body["attachments"][0]["content"]))
    assert "@{" not in filled, f"the Logic App card uses an expression this test does not fill: {filled}"
    built["logic-app-alert"] = json.loads(filled)
    return built


def render(to_render: dict[str, dict[str, Any]], out_dir: Path) -> dict[str, dict[str, Any]]:
    # Chromium is installed by scripts/bootstrap.sh (Debian's package); without it this test fails, never skips.
    assert CHROMIUM.is_file(), (
        f"{CHROMIUM} is missing: the card rendering test needs Debian's chromium; run bash scripts/bootstrap.sh "
        "(as root with apt access it installs it)"
    )
    node = shutil.which("node")
    assert node, "node is not on PATH (Node 20+ is a prerequisite, see README)"
    request = {
        "outDir": str(out_dir),
        "targetVersion": CARD_VERSION,
        "cards": [{"name": name, "card": card} for name, card in to_render.items()],
    }
    done = subprocess.run(
        [node, str(RENDERER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CHROMIUM": str(CHROMIUM), "HOME": str(out_dir)},
    )
    assert done.returncode == 0, f"render-cards.js failed ({done.returncode}): {done.stderr}"
    return {item["name"]: item for item in json.loads(done.stdout)}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("cards")
    results = render(cards(), out_dir)
    print(f"\nrendered cards (screenshots): {out_dir}")
    return results


def words(text: str) -> str:
    """The rendered text with its layout whitespace (fact tables use tabs and line breaks) as single spaces."""
    return " ".join(text.split())


def test_card_version_is_what_teams_workflows_render() -> None:
    assert CARD_VERSION == "1.4"
    assert {card["version"] for card in cards().values()} == {CARD_VERSION}


def test_every_card_renders_within_its_version_with_nothing_unknown(rendered: dict[str, dict[str, Any]]) -> None:
    assert set(rendered) == {*get_args(AlertKind), "logic-app-alert"}
    for name, result in rendered.items():
        assert result["events"] == [], f"{name}: the renderer reported {result['events']}"
        assert result["cardVersion"] == CARD_VERSION


def test_a_person_reads_the_title_facts_and_explanation(rendered: dict[str, dict[str, Any]]) -> None:
    for kind, title in TITLES.items():
        text = rendered[kind]["text"]
        assert text.splitlines()[0] == title, kind
        assert f"Coordinator time {NOW.isoformat()}" in text
    for kind in set(TITLES) - set(VM_KINDS):
        text = words(rendered[kind]["text"])
        for fact in (
            "EventId 3F2A9C1E-0B7D-4E55-9A21-6C0D2B8E4F10",
            "Type Reboot (Platform)",
            f"NotBefore {(NOW + timedelta(minutes=15)).isoformat()}",
            "Duration unknown",
            "Resources web_0, web_1",
            "Decision approve by rule 'everything-else-waits'",
            "Approved by person:alice@contoso.com",
            "Host server is undergoing maintenance.",
        ):
            assert fact in text, f"{kind}: {fact!r} not in the rendered card"
    assert "web_0's listener answered 'approved', but no VM saw the event Started or gone" in words(
        rendered["not-started"]["text"]
    )
    assert "the latest, from web_1, claims EventType 'Redeploy' (recorded 'Reboot')" in words(
        rendered["facts-conflict"]["text"]
    )
    heartbeat = words(rendered["heartbeat-lost"]["text"])
    assert "Its forwarder stopped reporting" in heartbeat
    assert f"Last seen {(NOW - timedelta(minutes=6)).isoformat()}" in heartbeat
    assert "Timeout 300 s" in heartbeat
    assert "Find the second sender." in words(rendered["forwarder-conflict"]["text"])
    imds = words(rendered["imds-failing"]["text"])
    assert "still sends heartbeats but has not read IMDS" in imds
    assert f"Failing since {(NOW - timedelta(minutes=7)).isoformat()}" in imds
    assert "Health no good IMDS poll for 95 s (limit 60 s)" in imds
    assert words(rendered["logic-app-alert"]["text"]) == (
        "Fired: se-alert-cards-failing The coordinator could not deliver Teams cards. "
        "Severity Sev1 Fired 2026-11-20T12:05:00.0000000Z Open the results"
    )


def test_approve_now_opens_the_approval_link(rendered: dict[str, dict[str, Any]]) -> None:
    # The record is Scheduled: only the cards that ask a person to act carry the button.
    buttons = {kind: result["actions"] for kind, result in rendered.items() if result["actions"]}
    assert buttons.keys() == {"new-event", "approval-failed", "logic-app-alert"}
    assert buttons["new-event"] == buttons["approval-failed"] == [{"title": "Approve now", "url": APPROVE_URL}]
    assert buttons["logic-app-alert"] == [
        {"title": "Open the results", "url": "https://portal.azure.com/#blade/results"}
    ]


def test_screenshots_are_saved(rendered: dict[str, dict[str, Any]]) -> None:
    for name, result in rendered.items():
        shot = Path(result["screenshot"])
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert result["width"] == 540
        # A card with a title, facts and a footer is well over one line tall.
        assert result["height"] > 100, f"{name}: rendered only {result['height']} px tall"


def test_the_renderer_reports_what_teams_would_not_render(tmp_path: Path) -> None:
    """Not vacuous: an element newer than 1.4 (Table, 1.5) and an unknown element are reported, not silently
    dropped."""
    newer = {
        "type": "AdaptiveCard",
        "version": CARD_VERSION,
        "body": [
            {"type": "TextBlock", "text": "still shown"},
            {"type": "Table", "columns": [{"width": 1}], "rows": []},
            {"type": "FactList", "facts": []},
        ],
    }
    result = render({"newer": newer}, tmp_path)["newer"]
    assert [event["event"] for event in result["events"]] == ["UnknownElementType", "UnknownElementType"]
    assert 'Unknown element type "Table"' in result["events"][0]["message"]
    assert words(result["text"]) == "still shown"
