"""Pure helpers on IMDS emulator scenarios for the local mode."""

from __future__ import annotations

from emulators.imds import Scenario


def delayed(scenario: Scenario, *, seconds: float) -> Scenario:
    """The same scenario with every step ``seconds`` (Azure seconds, i.e. scaled by the emulator) later."""
    if seconds < 0:
        raise ValueError(f"a scenario cannot start {seconds} s early")
    steps = [step.model_copy(update={"at": step.at + seconds}) for step in scenario.steps]
    return scenario.model_copy(update={"steps": steps})
