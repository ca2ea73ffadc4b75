"""Pure helpers on IMDS emulator scenarios for the local mode."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator import Policy
from emulators.imds import Scenario

# How long a VM that a Terminate or Preempt removes goes on running after its event turned Started, in a scenario that
# does not say (its vmGoneAfterStartedSeconds; the emulator's default is 0, the instant it starts). In Azure a delete or
# an eviction is an operation of seconds, not an instant: the platform stops the VM, then deletes it, and the guest runs
# until it is stopped, so a listener finishes what it was doing: the one that executed the delete's own approval sends
# its answer (milliseconds), one judging another event's approval reads IMDS and answers (its reads are limited to 2 a
# second, shared with the poll). Removed at the instant it started, the VM's forwarder was killed before its answer
# left in one fleet-demo run of three (the relay's 502, "the listener disconnected before responding").
# DELETE_SECONDS Azure seconds, and at least DELETE_REAL_SECONDS of real time: what a listener takes is real time, which
# the compressed clock does not shorten (at 60x, 10 Azure seconds are 0.17 s); with 0.5 s, a listener still judging a
# Freeze sent through it when its own delete started was killed with it (tests/local/test_faults.py, compact scenario),
# whose reroute then had to wait for the request to lapse (docs/liveness.md, *A lost answer*). A scenario that sets
# the field keeps it: 0 plays a VM that dies before its answer leaves, which the coordinator records as a lost answer.
DELETE_SECONDS = 10.0
DELETE_REAL_SECONDS = 2.0


def deletes_take_time(scenario: Scenario, *, time_scale: float) -> Scenario:
    """The scenario with its deleted and evicted VMs running on for a while after their event started (above), unless
    it says how long itself."""
    if "vmGoneAfterStartedSeconds" in scenario.model_fields_set:
        return scenario
    seconds = max(DELETE_SECONDS, DELETE_REAL_SECONDS * time_scale)
    return scenario.model_copy(update={"vmGoneAfterStartedSeconds": seconds})


def delayed(scenario: Scenario, *, seconds: float) -> Scenario:
    """The same scenario with every step ``seconds`` (Azure seconds, i.e. scaled by the emulator) later."""
    if seconds < 0:
        raise ValueError(f"a scenario cannot start {seconds} s early")
    steps = [step.model_copy(update={"at": step.at + seconds}) for step in scenario.steps]
    return scenario.model_copy(update={"steps": steps})


def pages_without_gate(scenario: Scenario, policy: Policy) -> list[str]:
    """The scenario's health pages whose URL no HTTP gate of the policy probes (they would stand for nothing)."""
    probed = {gate.http.url for gate in policy.gates.values() if gate.http is not None}
    return sorted(name for name, page in scenario.healthPages.items() if page.url not in probed)


def served_policy(text: str, served: Mapping[str, str]) -> str:
    """The policy's text with each health page's URL (as the policy names it) replaced by the URL the local stack
    serves that page on. Text, not the parsed policy: every other line stays as written, so are its numbers."""
    for url, where in served.items():
        text = text.replace(url, where)
    return text


def census_scopes(scenario: Scenario) -> list[str]:
    """The resource groups of the scenario's VMs, as the census' scopes (the deployment's one resource group)."""
    return sorted({f"/subscriptions/{vm.subscriptionId}/resourceGroups/{vm.resourceGroupName}" for vm in scenario.vms})
