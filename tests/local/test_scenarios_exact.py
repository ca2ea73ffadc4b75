"""Every shipped scenario names its own policy and says exactly what becomes of each event under it: "either" only
where the platform's own timing makes both outcomes correct, and then the file says why (pure: the scenario is
played by the emulator's state machine on a hand-driven clock, at the time scales the docs and tests use)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from coordinator.domain.policy_file import load_policy
from emulators.imds import Scenario
from emulators.imds.state import EmulatorState
from local.expectations import expect_all, with_declared
from local.scenario import pages_without_gate

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "emulators" / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("time_scale", [60.0, 120.0])
@pytest.mark.parametrize("path", SCENARIOS, ids=[path.stem for path in SCENARIOS])
def test_a_shipped_scenario_names_its_policy_and_expects_exactly(path: Path, time_scale: float) -> None:
    scenario = Scenario.from_file(path)
    assert scenario.policy is not None, f"{path.name} names no policy: it would run with whatever is the default"
    policy = load_policy(scenario.policy)
    assert pages_without_gate(scenario, policy) == []
    start = datetime(2026, 11, 25, 12, tzinfo=UTC)
    state = EmulatorState(scenario, start=start, time_scale=time_scale)
    end = start + timedelta(seconds=max((step.at for step in scenario.steps), default=0) / time_scale + 0.001)
    events = state.event_summaries(end)
    declared = scenario.expectations()
    expected = with_declared(
        expect_all(events, policy, prepare_hooks=True, vms=list(state.vms.values()), time_scale=time_scale),
        {ref: approval for ref, (approval, _) in declared.items()},
    )
    assert {item.label for item in expected} >= set(declared), "an expect names no event of the scenario"
    for item in expected:
        if item.approval == "either":
            because = declared.get(item.label, (None, None))[1]
            assert because, f"{path.name}: {item.label} may end either way ({item.rule}), and the file says not why"
        assert item.computed in (None, "either", item.approval), (
            f"{path.name}: {item.label}: the scenario expects {item.approval}, rule {item.rule} says {item.computed}"
        )


def test_an_either_needs_its_reason_and_an_expect_its_event() -> None:
    vms = [{"name": "a"}]
    create = {"ref": "x", "EventType": "Reboot", "Resources": ["a"]}
    with pytest.raises(ValueError, match="because: an 'either' expectation says why"):
        Scenario.from_mapping({"vms": vms, "steps": [{"at": 0, "create": create, "expect": "either"}]})
    with pytest.raises(ValueError, match="expect: only a create step with a ref"):
        Scenario.from_mapping({"vms": vms, "steps": [{"at": 0, "cancel": "x", "expect": "approve"}]})
    with pytest.raises(ValueError, match=r"healthPage\.name: no health page 'app'"):
        Scenario.from_mapping({"vms": vms, "steps": [{"at": 0, "healthPage": {"name": "app", "status": 200}}]})
