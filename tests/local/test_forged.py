"""One fleet VM lies (issues 11 and 21): over the whole local stack, with attested forwarders, a process on web_1
holds the fleet's shared Event Hubs identity and root on web_1 (so its own IMDS: it attests a state of its own as
web_1, the most it can get signed). It sends schema-valid forgeries: web_0's Reboot relabelled as a 5 s Freeze under
web_0's name (with web_1's vmId and document; with web_0's vmId and web_1's document; with no document), a forged
"prepare hooks succeeded" for web_0's delete whose real hook failed, a forged "gone" of web_0's Reboot under web_0's
name, web_0's Redeploy claimed user-initiated under its own attested name, its own "gone" of web_0's Reboot (a peer
that sees it), and an envelope without a partition key. The judge's expectations come from the truthful scenario
and policy: the run passes only with zero approvals the truthful inputs would not have produced, every truthful one
made without delay (web_0's user Reboot after the attack, approved within a second of being seen), every envelope
web_0's forwarder sent applied, and each forgery in another VM's name set aside at the door with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.document import ScheduledEventsDocument
from contracts.envelope import HookReport, HookStep
from emulators.imds import Scenario
from local.runner import wait_until
from local.stack import LocalStack
from tests.local.conftest import Runner, history_rows
from tests.local.forging import Forger, hooks_wait_policy, victim_and_attacker


def _scenario() -> Scenario:
    return victim_and_attacker(
        "e2e-forged",
        [
            {
                "at": 0,
                "create": {"ref": "reboot", "EventType": "Reboot", "Resources": ["web_0"], "NoticeSeconds": 1800},
            },
            {
                "at": 0,
                "create": {
                    "ref": "redeploy",
                    "EventType": "Redeploy",
                    "Resources": ["web_0"],
                    "NoticeSeconds": 1800,
                },
            },
            # After the hijack: web_0's own forwarder must still be heard for this to be approved.
            {
                "at": 600,
                "create": {
                    "ref": "user-reboot",
                    "EventType": "Reboot",
                    "EventSource": "User",
                    "Resources": ["web_0"],
                    "NoticeSeconds": 900,
                },
            },
            {"at": 1200, "create": {"ref": "scale-in", "EventType": "Terminate", "Resources": ["web_0"]}},
        ],
    )


def _event_id(stack: LocalStack, ref: str) -> str:
    assert stack.imds is not None
    imds = stack.imds
    assert wait_until(lambda: any(e.get("ref") == ref for e in imds.events()), timeout=30)
    event_id = next(str(e["EventId"]) for e in imds.events() if e.get("ref") == ref)
    # The coordinator has heard the truth first: its record's facts come from web_0's own forwarder. From web_0's:
    # web_1, a peer of its placement group, often reports it first, and while no VM the event names has reported it
    # a peer's "gone" concludes it (domain/lifecycle.py; docs/limits.md), which is not what the attack below tests.
    observed = "EventId = ? AND RecordType = 'Observation' AND VmName = 'web_0'"
    assert wait_until(lambda: bool(history_rows(stack, observed, event_id)), timeout=30)
    return event_id


@pytest.mark.slow
def test_one_vms_forgeries_in_another_vms_name_approve_nothing_and_delay_no_one(
    run_pipeline: Runner, tmp_path: Path
) -> None:
    ids: dict[str, str] = {}

    def attack(stack: LocalStack) -> None:
        attacker = Forger(stack, on="web_1")
        web_0, web_1 = attacker.vms["web_0"], attacker.vms["web_1"]
        as_web_0 = web_0.model_copy(update={"vmId": web_1.vmId})
        with attacker.producer:
            ids["reboot"] = _event_id(stack, "reboot")
            ids["redeploy"] = _event_id(stack, "redeploy")
            flipped = attacker.listing({ids["reboot"]}, EventType="Freeze", DurationInSeconds=5)
            # web_0's name, web_0's resource id as partition key, a sequence no forwarder reaches: with its own
            # vmId and document, with web_0's vmId and its own document, and with no document at all.
            attacker.send(attacker.envelope(as_web_0, kind="incarnation", document=flipped))
            attacker.send(attacker.envelope(web_0, kind="incarnation", document=flipped))
            attacker.send(attacker.envelope(web_0, attested=False, kind="incarnation", document=flipped))
            # A "gone" of web_0's Reboot in web_0's name.
            empty = ScheduledEventsDocument(DocumentIncarnation=99, Events=[])
            attacker.send(attacker.envelope(as_web_0, kind="incarnation", document=empty))
            # Under its own attested name: the Redeploy claimed user-initiated (approve-now if believed), then the
            # Reboot "gone" as a peer that sees it.
            user = attacker.listing({ids["redeploy"]}, EventSource="User")
            attacker.send(attacker.envelope(web_1, kind="incarnation", document=user))
            attacker.send(attacker.envelope(web_1, kind="incarnation", document=empty))
            # Without a partition key: set aside whatever it says.
            attacker.send(attacker.envelope(web_0, kind="incarnation", document=user), keyed=False)
            # A forged phase report for web_0's delete, once its real prepare hook has failed.
            ids["scale-in"] = _event_id(stack, "scale-in")
            assert wait_until(
                lambda: bool(
                    history_rows(stack, "EventId = ? AND RecordType = 'Hook' AND Outcome = 'failed'", ids["scale-in"])
                ),
                timeout=30,
            )
            step = HookStep(hook="10-drain", outcome="succeeded", durationSeconds=1.0, exitCode=0)
            hook = HookReport(
                eventId=ids["scale-in"], phase="prepare", outcome="succeeded", durationSeconds=1.0, steps=[step]
            )
            attacker.send(attacker.envelope(as_web_0, kind="hook", hook=hook))
            assert web_0.vmId != web_1.vmId
        assert attacker.sent == 8

    # Set aside at the door: the five in web_0's name and the keyless one (the two in its own name are heard).
    outcome = run_pipeline(
        _scenario(), during=attack, expected_dead_letters=6, timeout=150.0, policy_path=hooks_wait_policy(tmp_path)
    )
    # The judge's expectations come from the truthful scenario: no approval the truth would not make, every one it
    # makes, every envelope web_0 sent applied, and the forgeries set aside.
    outcome.judged_ok()
    summary, stack = outcome.summary, outcome.stack
    assert summary.approvals_expected == summary.approvals_expected_made == 1
    assert stack.imds is not None
    approved = {str(a["EventId"]) for a in stack.imds.approvals()}
    assert ids["reboot"] not in approved
    assert ids["redeploy"] not in approved
    assert ids["scale-in"] not in approved
    # No delay: web_0's user Reboot, created after the attack, is approved as soon as it is seen.
    (user_reboot,) = [e for e in outcome.facts.imds_events if e.get("ref") == "user-reboot"]
    assert outcome.facts.event_details[str(user_reboot["EventId"])]["approvedAfterSeenMs"] < 2000
    # Each forgery in web_0's name, and the keyless one, set aside with its reason.
    reasons = " | ".join(str(row) for row in history_rows(stack, "RecordType = 'DeadLetter'"))
    assert reasons.count("speaks under") == 3, reasons  # the Freeze, the "gone" and the hook in web_0's name
    assert "not of VM" in reasons
    assert "unattested" in reasons
    assert "no partition key" in reasons
    # web_0's Reboot was never concluded by the forged or the peer's "gone": it ran its course as web_0 saw it.
    reboot = [row for row in history_rows(stack, "EventId = ? AND RecordType = 'Transition'", ids["reboot"])]
    assert not [row for row in reboot if "Canceled" in str(row)], reboot
    # What it may still do under its own attested name: its lie about a peer's event is kept as a conflict, never
    # merged, and its "gone" as a peer concludes nothing.
    conflicts = history_rows(stack, "RecordType = 'Observation' AND Outcome = 'conflict'")
    assert ids["redeploy"] in {row["EventId"] for row in conflicts}, "the relabelled sighting is a conflict"
    assert not history_rows(stack, "RecordType = 'Heartbeat' AND Outcome = 'conflict' AND VmName = 'web_0'"), (
        "no second writer"
    )
    assert not history_rows(stack, "RecordType = 'Approval' AND Outcome = 'rejected' AND EventId = ?", ids["scale-in"])
    kinds = {(card["kind"], card["eventId"] or card["vm"]) for card in summary.cards}
    assert ("facts-conflict", ids["redeploy"]) in kinds
    assert ("forwarder-conflict", "web_0") not in kinds
    print(f"figures: forged 8, dead letters {summary.dead_letters}, conflicts {len(conflicts)}")
