"""A drill of each kind through the whole local pipeline (real processes and protocols): ``python -m ops.drill
--confirm`` calls the IMDS emulator's ARM face, which produces the scheduled event; the VMs' forwarders report it,
the coordinator decides it by the default policy and approves it through the VM's listener, and the drill's
long-running operation ends once the platform did what it was asked. One stack runs all four kinds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from emulators.imds import ImdsEmulator, Scenario
from local.stack import LocalStack
from local.stack_options import StackOptions
from tests.local.conftest import history_rows
from tests.polling import poll

SCALE_SETS = (
    "/subscriptions/00000000-0000-0000-0000-00000000e001/resourceGroups/rg-scheduled-events/providers/"
    "Microsoft.Compute/virtualMachineScaleSets/"
)
# 10x: Azure's 30 s Spot notice is 3 s here, a few of the forwarders' one-second polls (docs/local-mode.md).
TIME_SCALE = 10.0


def decisions(stack: LocalStack, event_id: str, outcome: str = "") -> list[dict[str, Any]]:
    """The event's Decision rows (those of ``outcome``, when one is named)."""
    rows = history_rows(stack, "RecordType = 'Decision' AND EventId = ?", event_id)
    return [row for row in rows if row["Outcome"] == outcome or not outcome]


def operator(command: list[str], imds: ImdsEmulator) -> subprocess.CompletedProcess[str]:
    """The operator's command in a process of its own, signed in as docs/drills.md shows it locally (a token endpoint
    of the IMDS emulator's, as `az login` would give one in Azure), not with the coordinator's identity, which the
    stack's process holds (App Service's endpoint: emulators/app_identity.py) and which has no drill rights."""
    env = {name: value for name, value in os.environ.items() if name not in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER")}
    env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = imds.url_for("web_0")
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_a_drill_of_each_kind_reaches_the_coordinator_and_is_decided_by_the_policy(tmp_path: Path) -> None:
    scenario = Scenario.from_mapping(
        {
            "name": "drills",
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web", "placementGroupId": "pg-web"},
                {"name": "web_1", "vmScaleSetName": "web", "placementGroupId": "pg-web"},
                {"name": "web_2", "vmScaleSetName": "web", "placementGroupId": "pg-web"},
                {"name": "spot_0", "vmScaleSetName": "spot", "priority": "Spot", "isolated": True},
            ],
        }
    )
    options = StackOptions(
        scenario=scenario, workdir=tmp_path / "run", time_scale=TIME_SCALE, timer_interval=1.0, heartbeat_interval=2.0
    )
    with LocalStack(options) as stack:
        imds = stack.imds
        assert imds is not None
        # The forwarders first read their (empty) documents, so that each drill's event is a change they report.
        assert poll(lambda: all(imds.requests_served[vm.name] for vm in scenario.vms), timeout=30, interval=0.2)
        drills = [
            ("reboot", "web", "web_0"),
            ("redeploy", "web", "web_1"),
            ("delete", "web", "web_2"),
            ("evict", "spot", "spot_0"),
        ]
        started = time.monotonic()
        for kind, scale_set, vm in drills:
            arguments = [kind, "--scale-set", SCALE_SETS + scale_set, "--vm", vm, "--confirm", "--timeout", "60"]
            done = operator(["-m", "ops.drill", *arguments, "--endpoint", imds.arm_url], imds)
            assert done.returncode == 0, f"{kind}: {done.stdout}"
        drilled = {entry["action"]: entry["eventIds"][0] for entry in imds.drills.log}
        expected = {
            "restart": ("user-initiated", "approve"),
            "redeploy": ("user-initiated", "approve"),
            "delete": ("terminate-after-prepare-hooks", "approve"),
            # A Spot eviction is the platform's: the default policy leaves it to a person; it starts at NotBefore.
            "simulateEviction": ("everything-else-waits", "wait"),
        }
        for action, (rule, verdict) in expected.items():
            event_id = drilled[action]
            rows = poll(partial(decisions, stack, event_id, verdict), timeout=30, interval=0.2)
            assert rows, f"{action}: no {verdict} decision for {event_id}: {decisions(stack, event_id)}"
            assert rows[-1]["Rule"] == rule, rows[-1]
        approved = {approval["EventId"]: approval for approval in imds.approvals()}
        for action in ("restart", "redeploy", "delete"):
            assert approved[drilled[action]]["via"] == "imds", action  # StartRequests from the VM's listener
        assert drilled["simulateEviction"] not in approved
        events = {event["EventId"]: event for event in imds.events()}
        assert events[drilled["restart"]]["startedBy"] == "approval"
        assert events[drilled["simulateEviction"]]["EventType"] == "Preempt"
        # The delete removes web_2 some seconds after it started, as in Azure (local/scenario.py, deletes_take_time).
        assert poll(lambda: "web_2" in imds.removed_vms(), timeout=10, interval=0.2)
        print(f"four drills confirmed and followed to their end in {time.monotonic() - started:.1f} s")
