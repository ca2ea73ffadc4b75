"""The shipped scenario files (played deterministically by the pure state machine) and the command line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import requests

from emulators.imds.models import Scenario, ScenarioError, StartRequestsBody
from emulators.imds.records import VmRemovedError
from emulators.imds.state import EmulatorState
from tests.commands import ROOT, python_m

SCENARIOS = ROOT / "emulators" / "scenarios"
T0 = datetime(2026, 3, 2, 10, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_scenario_validates_and_plays_without_step_errors(path):
    scenario = Scenario.from_file(path)
    state = EmulatorState(scenario, start=T0)
    # Past the last step and the longest notice a step gives (a notice beyond the emulator's default hour).
    notices = [step.create.NoticeSeconds or 0 for step in scenario.steps if step.create is not None]
    end = max((step.at for step in scenario.steps), default=0) + max([3600.0, *notices]) + 3600
    summaries = state.event_summaries(at(end))
    assert state.step_errors == []
    assert len(summaries) == sum(1 for step in scenario.steps if step.create is not None)
    assert all(summary["state"] in ("Completed", "Canceled") for summary in summaries)


def test_documented_example_two_vms_one_freeze():
    state = EmulatorState(Scenario.from_file(SCENARIOS / "documented-example.yaml"), start=T0)
    first = state.document("WestNO_0", "2020-07-01", at(5))
    second = state.document("WestNO_1", "2020-07-01", at(5))
    assert first == second
    [event] = first["Events"]
    assert (event["EventType"], event["Resources"], event["DurationInSeconds"]) == (
        "Freeze",
        ["WestNO_0", "WestNO_1"],
        5,
    )


def test_documented_example_goes_through_the_docs_sequence_of_documents():
    state = EmulatorState(Scenario.from_file(SCENARIOS / "documented-example.yaml"), start=T0, started_min_seconds=600)

    def observe(seconds: float) -> tuple[int, list[str]]:
        document = state.document("WestNO_1", "2020-07-01", at(seconds))
        return document["DocumentIncarnation"], [e["EventStatus"] for e in document["Events"]]

    assert observe(0) == (1, [])
    assert observe(5) == (2, ["Scheduled"])
    assert observe(905) == (3, ["Started"])  # nobody approved: NotBefore (15 min) passed
    assert observe(1504) == (3, ["Started"])
    assert observe(1505) == (4, [])  # removed after the Started minimum (10 min)


def test_fleet_demo_plays_every_kind_of_event():
    scenario = Scenario.from_file(SCENARIOS / "fleet-demo.yaml")
    state = EmulatorState(scenario, start=T0)

    def types(vm: str, seconds: float) -> dict[str, str]:
        return {
            e["EventType"] + ":" + ",".join(e["Resources"]): e["EventStatus"]
            for e in state.document(vm, "2020-07-01", at(seconds))["Events"]
        }

    assert types("web_3", 1) == {"Freeze:web_0,web_1": "Scheduled"}  # whole placement group sees it
    assert types("db-1", 61) == {"Reboot:db-0": "Scheduled"}  # the availability set sees the user reboot
    assert types("batch-spot-0", 61) == {}  # isolated Spot VM: nothing of the others
    reboot = state.document("db-0", "2020-07-01", at(61))["Events"][0]
    assert reboot["EventSource"] == "User"
    web = types("web_0", 151)
    assert web == {
        "Freeze:web_0,web_1": "Scheduled",
        "Terminate:web_2": "Scheduled",
        "Terminate:web_3": "Scheduled",
        "Terminate:web_1": "Scheduled",
    }
    assert types("batch-spot-0", 181) == {"Preempt:batch-spot-0": "Scheduled"}
    # The scenario's 120 s notice (Azure's 30 s is shorter than a local poll at 60x): the eviction starts at
    # NotBefore and the Spot VM is gone from then on.
    with pytest.raises(VmRemovedError, match="batch-spot-0 was removed by Preempt"):
        state.document("batch-spot-0", "2020-07-01", at(300))
    assert state.removed["batch-spot-0"].at == at(300)
    assert "Redeploy:db-1" in types("db-0", 241)
    assert "Redeploy:db-1" not in types("db-0", 421)  # canceled
    assert types("db-1", 481)["Reboot:db-1"] == "Started"  # hardware failure: straight to Started
    # An approved delete of web_1 waits for web_2/web_3's pending deletes (approve all pending deletes) …
    terminate_1 = next(e for e in state.events.values() if e.resources == ("web_1",))
    body = StartRequestsBody.model_validate({"StartRequests": [{"EventId": terminate_1.event_id}]})
    state.approve("web_1", body, at(500))
    assert types("web_0", 719)["Terminate:web_1"] == "Scheduled"
    # … which time out together at their shared NotBefore (120 + 600 s); then all three go.
    assert {k: v for k, v in types("web_0", 720).items() if k.startswith("Terminate")} == {
        "Terminate:web_2": "Started",
        "Terminate:web_3": "Started",
        "Terminate:web_1": "Started",
    }
    assert sorted(name for name, removal in state.removed.items() if removal.event_type == "Terminate") == [
        "web_1",
        "web_2",
        "web_3",
    ]
    history = {summary["ref"]: summary for summary in state.event_summaries(at(720))}
    assert history["maintenance"]["state"] == "Canceled"
    assert history["scale-in-1"]["startedBy"] == "approval"
    assert history["scale-in-2"]["startedBy"] == "notBefore"
    assert history["hardware-failure"]["startedBy"] == "hardware-failure"


def test_bad_scenario_file_names_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("vms:\n  - name: a\n    priority: Cheap\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match=r"bad\.yaml is invalid: vms\.0\.priority"):
        Scenario.from_file(path)
    path.write_text("vms: [\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        Scenario.from_file(path)
    json_path = tmp_path / "s.json"
    json_path.write_text(json.dumps({"vms": [{"name": "a"}], "steps": [{"at": 1}]}), encoding="utf-8")
    with pytest.raises(ScenarioError, match=r"steps\.0 \(line 1\): .*exactly one of create, cancel, fault"):
        Scenario.from_file(json_path)


def test_command_line_prints_its_url_serves_and_stops_on_sigterm():
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "emulators.imds",
            "--port",
            "0",
            "--scenario",
            str(SCENARIOS / "fleet-demo.yaml"),
            "--time-scale",
            "60",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = json.loads(process.stdout.readline())
        assert banner["url"].startswith("http://127.0.0.1:")
        assert banner["timeScale"] == 60
        assert banner["vms"]["web_1"] == banner["url"] + "/vm/web_1"
        assert banner["arm"].startswith("https://127.0.0.1:")  # the ARM face, over TLS
        assert requests.get(banner["arm"] + "/_emulator/arm", timeout=5).json()["requests"] == 0
        response = requests.get(
            banner["vms"]["web_1"] + "/metadata/scheduledevents?api-version=2020-07-01",
            headers={"Metadata": "true"},
            timeout=5,
        )
        assert response.status_code == 200
        assert [e["EventType"] for e in response.json()["Events"]] == ["Freeze"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_command_line_refuses_a_bad_scenario(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("vms: []\n", encoding="utf-8")
    result = python_m("emulators.imds", "--scenario", str(path), timeout=30)
    assert result.returncode == 2
    assert "vms" in json.loads(result.stderr)["error"]
