"""``python -m ops.drill`` against the IMDS emulator's ARM face (real HTTP, azure-identity's managed-identity
credential with the emulator's tokens): a dry run reads and sends nothing; ``--confirm`` makes the calls, follows
each operation to its end and the VMs' documents show the events the plan said."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from emulators.imds import ImdsEmulator, Scenario
from ops.drill.__main__ import main

SS = (
    "/subscriptions/00000000-0000-0000-0000-00000000e001/resourceGroups/rg-scheduled-events/providers/"
    "Microsoft.Compute/virtualMachineScaleSets/"
)
# 15 Azure minutes in 1 s: a Reboot nobody approves starts at its NotBefore within the test.
TIME_SCALE = 900.0


@pytest.fixture
def imds(monkeypatch: pytest.MonkeyPatch) -> Iterator[ImdsEmulator]:
    scenario = Scenario.model_validate(
        {
            "name": "drill-cli",
            "scaleSets": {"web": {"terminateNotBeforeSeconds": 600}},
            "vms": [
                {"name": "web_0", "vmScaleSetName": "web"},
                {"name": "web_1", "vmScaleSetName": "web"},
                {"name": "spot_0", "vmScaleSetName": "spot", "priority": "Spot"},
            ],
        }
    )
    with ImdsEmulator(scenario=scenario, time_scale=TIME_SCALE, throttle_rps=0) as emulator:
        # DefaultAzureCredential's managed-identity flow, against the emulator's token endpoint.
        for name, value in emulator.identity_environment("web_0").items():
            monkeypatch.setenv(name, value)
        yield emulator


def drill(imds: ImdsEmulator, *args: str) -> list[str]:
    return [*args, "--endpoint", imds.arm_url]


def test_a_dry_run_prints_the_plan_and_sends_nothing(imds: ImdsEmulator, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(drill(imds, "delete", "--scale-set", SS + "web", "--vm", "web_1")) == 0
    out = capsys.readouterr().out
    assert f"POST {imds.arm_url}{SS}web/delete?api-version=2025-04-01" in out
    assert 'body {"instanceIds": ["1"]}' in out
    assert "expect on web_1: Terminate (EventSource User), NotBefore 10 min after the call" in out
    assert "dry run: nothing sent" in out
    assert imds.events() == []
    assert imds.drills.log == []


def test_confirmed_drills_follow_the_operation_and_the_vms_see_the_events(
    imds: ImdsEmulator, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(drill(imds, "reboot", "--scale-set", SS + "web", "--vm", "0", "--confirm")) == 0
    out = capsys.readouterr().out
    assert "ARM 202, Succeeded after" in out  # started at its NotBefore (nobody approved it), 1 s here
    assert main(drill(imds, "evict", "--scale-set", SS + "spot", "--vm", "spot_0", "--confirm", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["confirmed"] is True
    assert report["plan"]["expected"][0]["eventType"] == "Preempt"
    assert [(o["status"], o["state"]) for o in report["outcomes"]] == [(204, "Accepted")]
    events = {e["EventType"]: e for e in imds.events()}
    assert events["Reboot"]["Resources"] == ["web_0"]
    assert events["Reboot"]["EventSource"] == "User"
    assert events["Preempt"]["Resources"] == ["spot_0"]
    assert [entry["action"] for entry in imds.drills.log] == ["restart", "simulateEviction"]


def test_a_refused_drill_and_an_unknown_vm_exit_2_and_send_nothing(
    imds: ImdsEmulator, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(drill(imds, "evict", "--scale-set", SS + "web", "--vm", "web_0", "--confirm")) == 2
    assert "refused: web_0: simulateEviction applies to Spot VMs only" in capsys.readouterr().out
    assert main(drill(imds, "reboot", "--scale-set", SS + "web", "--vm", "web_7", "--confirm")) == 2
    assert "['web_7'] are not VMs of the scale set" in capsys.readouterr().err
    assert main(drill(imds, "reboot", "--scale-set", SS + "nowhere", "--vm", "x")) == 2
    assert "ARM 404 ResourceNotFound" in capsys.readouterr().err
    assert imds.events() == []
