"""The stack's watch over its run, on a thread of its own: it plays the platform's part on the VMs' processes and
disks as the IMDS emulator removes VMs and starts events, and the scenario's local steps as they fall due."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from emulators.imds import ImdsEmulator
from emulators.imds.models import ScenarioStep
from local.health_pages import HealthPages
from local.platform import Platform

log = logging.getLogger("local.stack")

# How often the stack looks at the IMDS emulator for removed VMs and at the clock for wipe steps (real seconds).
PLATFORM_WATCH_INTERVAL = 0.1


class WatchedStack(Protocol):
    """What the watch reads and acts on."""

    imds: ImdsEmulator | None
    removed: dict[str, float]
    health_pages: HealthPages | None
    platform: Platform

    def remove_vm(self, name: str) -> None: ...


class PlatformWatch:
    """Plays ``steps`` (monotonic time due, index in the scenario, step) and the platform's part until ``stop``."""

    def __init__(self, stack: WatchedStack, steps: list[tuple[float, int, ScenarioStep]]) -> None:
        self._stack = stack
        self._steps = steps
        self._stop = threading.Event()
        # The events whose start the platform played on their VMs (by ref, else EventId: a started event may be
        # renamed).
        self._started: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="local-platform", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # interrupted before it started: nothing to wait for
            self._thread.join(timeout=5)

    def _run(self) -> None:
        """Plays the platform's part on the VMs' disks and processes: a VM the IMDS emulator removed (Terminate,
        Preempt) is deleted, so its forwarder dies with it (SIGKILL: nothing of it runs on); a wipeForwarderState
        step kills the forwarder, deletes its state folder and starts it again, as a reimaged disk would; the other
        local steps (faults, hostile senders) are played by the stack's ``platform``."""
        pending = sorted(self._steps, key=lambda item: (item[0], item[1]))
        stack = self._stack
        while not self._stop.wait(PLATFORM_WATCH_INTERVAL):
            imds = stack.imds
            if imds is None:
                return
            try:
                removed = imds.removed_vms()
            except Exception:  # the emulator is stopping
                log.debug("removed VMs not readable", exc_info=True)
                continue
            for name in sorted(set(removed) - set(stack.removed)):
                stack.remove_vm(name)
            self._started_events(imds)
            now = time.monotonic()
            while pending and pending[0][0] <= now:
                _, _, step = pending.pop(0)
                if step.healthPage is not None:
                    assert stack.health_pages is not None  # made before the steps are played
                    stack.health_pages.set(step.healthPage.name, step.healthPage.status)
                else:
                    stack.platform.play(step)

    def _started_events(self, imds: ImdsEmulator) -> None:
        """Each event IMDS started since the last look does to its VMs what the platform would (local/platform.py:
        a Freeze pauses their forwarders, a Reboot or Redeploy restarts them with a new boot time)."""
        try:
            events = imds.events()
        except Exception:  # the emulator is stopping
            log.debug("events not readable", exc_info=True)
            return
        for event in events:
            key = str(event.get("ref") or event["EventId"])
            if event.get("startedAt") and key not in self._started:
                self._started.add(key)
                self._stack.platform.event_started(event)
