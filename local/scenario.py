"""Pure helpers on IMDS emulator scenarios for the local mode."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.domain.policy import Policy
from emulators.imds import Scenario


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
