"""The local platform's own scheduling (local/platform.py): what an event does to its VMs' forwarders, in time.

The stack it acts on is a stand-in here (``_Stack``: forwarder processes that only say whether they run), the narrowest
seam: the whole-stack runs (tests/local/test_fleet_demo.py, the oracle's) play the same code on real processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from local import platform as local_platform
from local.platform import Platform
from tests.polling import poll


@dataclass
class _Forwarder:
    running: bool = True
    paused: bool = False
    starts: int = 0

    def pause(self) -> None:
        if self.running:
            self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stop(self) -> None:
        self.running = self.paused = False


@dataclass
class _Options:
    time_scale: float = 60.0


@dataclass
class _Stack:
    workdir: Path
    forwarders: dict[str, _Forwarder] = field(default_factory=lambda: {"web_0": _Forwarder()})
    removed: dict[str, float] = field(default_factory=dict)
    options: _Options = field(default_factory=_Options)

    def restart_forwarder(self, name: str) -> None:
        forwarder = self.forwarders[name]
        forwarder.running, forwarder.starts = True, forwarder.starts + 1

    def boot_time_file(self, name: str) -> Path:
        return self.workdir / f"{name}-boot-stat"


def _event(event_type: str, **fields: Any) -> dict[str, Any]:
    return {"EventType": event_type, "EventId": f"E-{event_type}", "Resources": ["web_0"], **fields}


def test_a_reboot_started_while_a_freezes_pause_is_pending_still_boots_the_vm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Freeze's pause comes FREEZE_ONSET_SECONDS after it starts; a Reboot that starts meanwhile stops the VM and
    boots it REBOOT_SECONDS later. With one pending action per VM, the Freeze's onset took the boot's place and the
    forwarder never started again (oracle seeds 43, 79, 93: runs that never finished)."""
    monkeypatch.setattr(local_platform, "FREEZE_ONSET_SECONDS", 0.1)
    monkeypatch.setattr(local_platform, "REBOOT_SECONDS", 0.3)
    stack = _Stack(tmp_path)
    platform = Platform(stack)  # type: ignore[arg-type]  # the stand-in has what the platform uses of a LocalStack
    forwarder = stack.forwarders["web_0"]

    platform.event_started(_event("Freeze", DurationInSeconds=30))
    platform.event_started(_event("Reboot"))
    assert poll(lambda: forwarder.starts == 1, timeout=3.0), "the rebooted VM's forwarder did not start again"
    assert forwarder.running
    assert not forwarder.paused  # the Freeze came while the VM was down: nothing was paused
    actions = [(entry["action"], entry.get("reason")) for entry in platform.log]
    assert ("forwarder-stop", "freeze") not in actions
    assert actions[-1] == ("forwarder-start", "reboot")


def test_finish_ends_every_pending_fault_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_platform, "REBOOT_SECONDS", 60.0)
    stack = _Stack(tmp_path)
    platform = Platform(stack)  # type: ignore[arg-type]
    platform.event_started(_event("Reboot"))
    # Stopped and its boot pending (logged after it is): finish boots it.
    assert poll(lambda: any(entry["action"] == "forwarder-stop" for entry in platform.log), timeout=3.0)
    assert not stack.forwarders["web_0"].running
    platform.finish()
    assert stack.forwarders["web_0"].starts == 1
