"""No VM speaks for another by name (issue 34), over the whole local stack: attested forwarders, ARM's census from the
IMDS emulator's ARM face. A process with root on web_1 keeps web_1's own vmId, its own resource id as partition key
and its own IMDS's attested document, and writes web_0's name: it lists web_0's 5 s Freeze while web_0's forwarder is
stopped (its approval would go to web_1's hybrid connection under web_0's name), lists web_0's Reboot at sequence
2^62 and drops it (web_0 would be silenced, its Reboot Canceled), reports web_0's prepare hooks succeeded for a
delete whose real hook failed, and an hour's impact of the Freeze.

Measured before the fix, this run: the Freeze recorded approved through web_0 while web_1 executed it, the Reboot
Canceled and web_0's later sightings of it dropped, the delete decided ``approve`` on the forged report (web_0's
listener refused it), and an Impact row of 3600 s for web_0. Now each forged envelope is dead-lettered as not its
resource id's name, the history names the VM that executed the Freeze, the Reboot stays web_0's, nothing is decided
on the forged report, and the run's own judge, from the truthful scenario, finds nothing amiss."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.document import ScheduledEventsDocument
from contracts.envelope import HookReport, HookStep, ImpactReport
from emulators.imds import Scenario
from local.runner import wait_until
from local.stack import LocalStack
from tests.local.conftest import Runner, history_rows
from tests.local.forging import Forger, hooks_wait_policy, victim_and_attacker


def _scenario() -> Scenario:
    return victim_and_attacker(
        "e2e-forged-names",
        [
            # web_0's forwarder stopped for 6 s: the forged listing of its Freeze comes first.
            {"at": 0, "signal": {"vm": "web_0", "signal": "STOP", "seconds": 6}},
            {
                "at": 0,
                "create": {
                    "ref": "freeze",
                    "EventType": "Freeze",
                    "Resources": ["web_0"],
                    "DurationInSeconds": 5,
                    "NoticeSeconds": 1800,
                },
            },
            {
                "at": 0,
                "create": {"ref": "reboot", "EventType": "Reboot", "Resources": ["web_0"], "NoticeSeconds": 1800},
            },
            {"at": 1200, "create": {"ref": "scale-in", "EventType": "Terminate", "Resources": ["web_0"]}},
        ],
    )


class Spoofer(Forger):
    """web_1 with root: its own identity under web_0's name, a state of its own attested by its own IMDS."""

    def __init__(self, stack: LocalStack) -> None:
        super().__init__(stack, on="web_1")
        self.web_0, self.web_1 = self.vms["web_0"], self.vms["web_1"]
        self.as_web_0 = self.web_1.model_copy(update={"name": "web_0"})

    def say(self, **fields: Any) -> None:
        """Sent as web_0 by name, partitioned by its own resource id."""
        self.send(self.envelope(self.as_web_0, **fields))


@pytest.mark.slow
def test_a_vm_writing_another_vms_name_with_its_own_identity_is_refused_and_moves_nothing(
    run_pipeline: Runner, tmp_path: Path
) -> None:
    ids: dict[str, str] = {}

    def attack(stack: LocalStack) -> None:
        assert stack.imds is not None
        imds = stack.imds
        assert wait_until(lambda: {"freeze", "reboot"} <= {e.get("ref") for e in imds.events()}, timeout=30)
        ids.update({str(e["ref"]): str(e["EventId"]) for e in imds.events() if e.get("ref")})
        spoofer = Spoofer(stack)
        with spoofer.producer:
            # While web_0's forwarder is stopped: its Freeze and Reboot under its name, at 2^62, then dropped.
            spoofer.say(kind="incarnation", document=spoofer.listing({ids["freeze"], ids["reboot"]}, incarnation=7))
            spoofer.say(kind="incarnation", document=ScheduledEventsDocument(DocumentIncarnation=8, Events=[]))
            started = datetime.now(UTC)
            spoofer.say(
                kind="impact",
                impact=ImpactReport(
                    eventId=ids["freeze"],
                    eventType="Freeze",
                    measure="pause",
                    measuredSeconds=3600,
                    start=started,
                    end=started + timedelta(hours=1),
                ),
            )
            # web_0's delete, once its real prepare hook has failed: a forged success in its name.
            assert wait_until(lambda: any(e.get("ref") == "scale-in" for e in imds.events()), timeout=60)
            ids["scale-in"] = next(str(e["EventId"]) for e in imds.events() if e.get("ref") == "scale-in")
            failed = "EventId = ? AND RecordType = 'Hook' AND Outcome = 'failed'"
            assert wait_until(lambda: bool(history_rows(stack, failed, ids["scale-in"])), timeout=30)
            done = HookStep(hook="10-drain", outcome="succeeded", durationSeconds=1.0, exitCode=0)
            spoofer.say(
                kind="hook",
                hook=HookReport(
                    eventId=ids["scale-in"], phase="prepare", outcome="succeeded", durationSeconds=1.0, steps=[done]
                ),
            )
        assert spoofer.sent == 4

    outcome = run_pipeline(
        _scenario(), during=attack, expected_dead_letters=4, timeout=150.0, policy_path=hooks_wait_policy(tmp_path)
    )
    outcome.judged_ok()
    summary, stack = outcome.summary, outcome.stack
    assert stack.imds is not None
    # Each forged envelope refused at the door: web_1's resource id is ARM's web_1.
    reasons = [str(row) for row in history_rows(stack, "RecordType = 'DeadLetter'")]
    assert len(reasons) == 4, reasons
    assert all("is not its resource id's name" in r for r in reasons), reasons
    # The Freeze approved once, and the history names the VM that executed it (web_1, a peer that sees it, while
    # web_0 was stopped): before, it said "approved through web_0" for the spoofer's hybrid connection.
    approvals = [(str(a["EventId"]), str(a["vm"])) for a in stack.imds.approvals()]
    assert [event for event, _ in approvals] == [ids["freeze"]], approvals
    approved = history_rows(stack, "RecordType = 'Approval' AND Outcome = 'approved'")
    recorded = [(row["EventId"], row["VmName"]) for row in approved]
    assert recorded == approvals, recorded
    # web_0 was not silenced: its Reboot ran its course as web_0 saw it, and its later sightings were heard.
    reboot = history_rows(stack, "EventId = ? AND RecordType = 'Transition'", ids["reboot"])
    assert not [row for row in reboot if "Canceled" in str(row)], reboot
    observed = "RecordType = 'Observation' AND VmName = 'web_0'"
    heard = {row["VmId"] for row in history_rows(stack, f"EventId = ? AND {observed}", ids["reboot"])}
    assert heard == {stack_vm_id(stack, "web_0")}, heard
    # Nothing decided on the forged hook report, no Impact written for web_0 from the forged one.
    decided = history_rows(stack, "EventId = ? AND RecordType = 'Decision' AND Outcome = 'approve'", ids["scale-in"])
    assert decided == []
    assert history_rows(stack, "RecordType = 'Impact' AND MeasuredSeconds >= 3600") == []
    print(f"figures: forged 4, dead letters {summary.dead_letters}, approvals {approvals}")


def stack_vm_id(stack: LocalStack, name: str) -> str:
    assert stack.imds is not None
    return next(spec.vmId for spec in stack.imds.vms() if spec.name == name)
