"""What the latency benchmarks on the whole local stack share: the policy they run under (every event approved at once,
by one rule), the stack's options, its warm start, and the times the IMDS emulator gives."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from emulators.imds import Scenario
from local.runner import wait_until
from local.stack_options import StackOptions

RULE = "approve-everything"
POLICY = f"""version: 1
rules:
  - name: {RULE}
    description: benchmark policy - every event is approved at once
    match: {{}}
    action: approve-now
"""


def write_policy(folder: Path, name: str = "approve-all.yaml") -> Path:
    """The policy's file in ``folder`` (a stack's ``policy_path``)."""
    path = folder / name
    path.write_text(POLICY, encoding="utf-8")
    return path


def stack_options(folder: Path, scenario: Scenario, **settings: Any) -> StackOptions:
    """The stack of a latency run, its files in ``folder``: at 60x (a Freeze's 15-minute notice lasts 15 s; Started
    events leave after 10 s), a poll a second, a heartbeat a minute, the approve-everything policy, no prepare hooks;
    ``settings`` add to these or replace them."""
    chosen: dict[str, Any] = {
        "workdir": folder / "local",
        "time_scale": 60.0,
        "poll_interval": 1.0,
        "heartbeat_interval": 60.0,
        "policy_path": write_policy(folder),
        "prepare_hooks": False,
    }
    return StackOptions(scenario=scenario, **(chosen | settings))


def wait_warm(ready: Callable[[], bool]) -> None:
    """Waits until ``ready``: the coordinator has taken every forwarder's first envelope (its first batch builds it
    and its clients), then past the first documents' processing, so that the events measure the pipeline warm."""
    if not wait_until(ready, timeout=60):
        raise RuntimeError("the coordinator took no envelope of some VMs within 60 s; see the work folder")
    time.sleep(1.0)


def utc(value: str) -> datetime:
    """A time the IMDS emulator gives (ISO 8601, ``Z`` for UTC)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00"))
