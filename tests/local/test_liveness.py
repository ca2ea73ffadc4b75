"""Liveness over the whole local pipeline (issue 22 item 2): no listener or VM that is slow or dead delays another
VM's approval by more than a few seconds; an approval whose executor died goes through a peer; a VM whose clock runs
slow is judged by the service's clock. Each test prints its figures and asserts them."""

from __future__ import annotations

import time
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest

from emulators.imds import Scenario
from local.runner import wait_until
from local.stack import LocalStack
from tests.local.conftest import Outcome, Runner

# At time scale 10 a notice of 200 Azure seconds is 20 real seconds: the short notice of the missed event.
SCALE = 10.0
# A started event stays listed 60 Azure seconds (6 s here) rather than the docs' ~10 minutes: the runs end when
# every event is over, and nothing here is about how long a started event stays.
STARTED_MIN = 60.0


def imds_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def event(outcome: Outcome, ref: str) -> dict[str, Any]:
    assert outcome.stack.imds is not None
    (found,) = [e for e in outcome.stack.imds.events() if e.get("ref") == ref]
    return found


def hybrid_connection(stack: LocalStack, name: str) -> str:
    assert stack.imds is not None
    (vm,) = [vm for vm in stack.imds.vms() if vm.name == name]
    return f"vm-{vm.vmId.lower()}"


def group_and_other(*steps: dict[str, Any]) -> Scenario:
    """a_0 and a_1 in one placement group (either may approve its events), b_0 on its own."""
    return Scenario.from_mapping(
        {
            "name": "liveness",
            "vms": [
                {"name": "a_0", "placementGroupId": "pg-a"},
                {"name": "a_1", "placementGroupId": "pg-a"},
                {"name": "b_0", "placementGroupId": "pg-b"},
            ],
            "steps": list(steps),
        }
    )


# Freezes approved once the prepare hooks of the VMs they name succeeded: the decision waits for a_0's own hook
# report, so a_0 (first in Resources) has reported and is the executor, whichever VM of its group spoke first.
AFTER_HOOKS = """version: 1
rules:
  - name: freeze-after-hooks
    match: {eventType: [Freeze]}
    action: approve-after-hooks
    hooks: {deadlineSeconds: 600}
  - name: rest
    action: wait-for-person
"""


@pytest.mark.slow
def test_a_dead_listener_delays_no_other_vms_approval_and_its_own_goes_through_a_peer(
    run_pipeline: Runner, tmp_path: Path
) -> None:
    """a_0's listener is connected and never answers. Its Freeze held the whole batch (~28 s), so b_0's Freeze with
    20 s of notice, 2 s later, was approved too late or not at all: now a_0's approval is handed to the delivery queue
    after 3 s and goes through a_1; b_0's is approved a few seconds after it was seen, before its NotBefore."""
    policy = tmp_path / "after-hooks.yaml"
    policy.write_text(AFTER_HOOKS, encoding="utf-8")
    scenario = group_and_other(
        {
            "at": 0,
            "create": {"ref": "dead", "EventType": "Freeze", "Resources": ["a_0"], "DurationInSeconds": 5},
        },
        {
            "at": 20,
            "create": {
                "ref": "other",
                "EventType": "Freeze",
                "Resources": ["b_0"],
                "DurationInSeconds": 5,
                "NoticeSeconds": 200,
            },
        },
    )

    def hang_a_0s_listener(stack: LocalStack) -> None:
        assert stack.relay is not None
        stack.relay.set_listener_fault(hybrid_connection(stack, "a_0"), dead=True)

    outcome = run_pipeline(
        scenario,
        time_scale=SCALE,
        started_min_seconds=STARTED_MIN,
        during=hang_a_0s_listener,
        timeout=120.0,
        policy_path=policy,
    )
    other, dead = event(outcome, "other"), event(outcome, "dead")
    seen = {row["label"]: row for row in outcome.summary.events}
    assert outcome.stack.host is not None
    stats = outcome.stack.host.stats
    latency = seen["other"]["approvedAfterSeenMs"]
    print(
        f"figures: other VM's approval {latency} ms after seen; slowest batch {stats.slowest_batch:.2f} s, slowest "
        f"tick {stats.slowest_tick:.2f} s; dead listener's event approved by {dead['approvedBy']}"
    )
    assert other["approvedBy"] == ["b_0"]
    assert imds_time(other["approvedAt"]) < parsedate_to_datetime(other["NotBefore"])
    assert other["startedBy"] != "NotBefore"
    assert latency is not None
    assert latency < 6000, "another VM's approval waited for the dead listener"
    # No batch waited for a_0: the one that decided its Freeze returned once the approval was sent, and its tail
    # gave a_0 the 3 s after it (docs/liveness.md, *The tail after the batch*; before, that batch took 3-6 s,
    # now about 0.1 s; the bound leaves a busy machine's first batches their slack).
    assert stats.slowest_batch < 3.0
    assert stats.slowest_tick < 6.0
    # The dead listener's own approval: handed over, then through the peer of its placement group.
    assert dead["approvedBy"] == ["a_1"]
    assert outcome.summary.ok, outcome.summary.failures


@pytest.mark.slow
def test_an_approval_whose_executor_died_goes_through_a_peer_of_its_placement_group(run_pipeline: Runner) -> None:
    """a_0 reported its Reboot, then died (SIGKILL: its listener gone, its heartbeats stopped) before a person
    approved it. The approval went to a_0 again and again until a_0 had been silent for the 5-minute heartbeat
    timeout, past the notice; now the attempt after the first unanswered one goes through a_1."""
    scenario = group_and_other(
        {
            "at": 0,
            "create": {"ref": "reboot", "EventType": "Reboot", "Resources": ["a_0"], "NoticeSeconds": 600},
        },
    )
    figures: dict[str, float] = {}

    def kill_a_0_then_approve(stack: LocalStack) -> None:
        import function_app

        assert stack.imds is not None
        imds = stack.imds
        assert wait_until(lambda: bool(imds.events()), timeout=30)
        event_id = str(imds.events()[0]["EventId"])
        coordinator = function_app.coordinator()
        assert wait_until(lambda: _reported_by(coordinator, event_id) >= {"a_0", "a_1"}, timeout=30)
        stack.forwarders["a_0"].kill()
        started = time.monotonic()
        result = coordinator.approve_manually(event_id, person="ops@example.com")
        figures["person_run_s"] = time.monotonic() - started
        assert result.status in ("approved", "sent"), result.message
        assert wait_until(lambda: bool(imds.events()[0]["approvedBy"]), timeout=40)
        figures["approved_after_s"] = time.monotonic() - started
        stack.forwarders["a_0"].start()  # the VM comes back and sees its event over: the event concludes

    outcome = run_pipeline(
        scenario, time_scale=SCALE, started_min_seconds=STARTED_MIN, during=kill_a_0_then_approve, timeout=120.0
    )
    reboot = event(outcome, "reboot")
    print(
        f"figures: the person's run took {figures['person_run_s']:.2f} s; approved through {reboot['approvedBy']} "
        f"{figures['approved_after_s']:.2f} s after the person's approval"
    )
    assert reboot["approvedBy"] == ["a_1"]
    assert imds_time(reboot["approvedAt"]) < parsedate_to_datetime(reboot["NotBefore"])
    assert figures["person_run_s"] < 6.0
    assert figures["approved_after_s"] < 12.0
    assert outcome.stack.imds is not None
    assert [a["EventId"] for a in outcome.stack.imds.approvals()].count(reboot["EventId"]) == 1


def _reported_by(coordinator: Any, event_id: str) -> set[str]:
    stored = coordinator.event(event_id)
    return set(stored.record.vms) if stored is not None else set()


@pytest.mark.slow
def test_a_vm_whose_clock_runs_six_minutes_slow_is_judged_by_the_services_clock(run_pipeline: Runner) -> None:
    """a_0's clock runs 6 minutes slow, more than the 5-minute heartbeat timeout: it was judged silent, its Freeze
    had no executor and expired. Now its freshness is its envelopes' Event Hubs enqueued time: approved at once."""
    scenario = Scenario.from_mapping(
        {
            "name": "slow-clock",
            # a_0 alone in its placement group: no peer can execute its approval in its place.
            "vms": [
                {"name": "a_0", "placementGroupId": "pg-a", "clockSkewSeconds": -360},
                {"name": "b_0", "placementGroupId": "pg-b"},
            ],
            "steps": [
                {
                    "at": 0,
                    "create": {"ref": "slow", "EventType": "Freeze", "Resources": ["a_0"], "DurationInSeconds": 5},
                }
            ],
        }
    )
    outcome = run_pipeline(scenario, time_scale=SCALE, started_min_seconds=STARTED_MIN, timeout=120.0)
    slow = event(outcome, "slow")
    seen = {row["label"]: row for row in outcome.summary.events}
    print(f"figures: approved through {slow['approvedBy']}, {seen['slow']['approvedAfterSeenMs']} ms after seen")
    assert slow["approvedBy"] == ["a_0"]
    assert slow["startedBy"] != "NotBefore"
    assert outcome.summary.ok, outcome.summary.failures
