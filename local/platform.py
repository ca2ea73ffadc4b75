"""The local runner's faults and hostile senders, played from a scenario's local steps (emulators/imds/models.py:
``signal``, ``outage``, ``listener``, ``gate``, ``forge``) while the stack runs, and logged with their wall-clock
times: the part of the truth an oracle needs besides IMDS's own record (which processes were down when, which
services were out, which listeners slow or dead, which gate answered what, who forged what).

Each fault that lasts ends on a timer, so the stack's watch loop never waits; ``finish`` ends every fault still on
(continues stopped processes, restarts killed forwarders, brings services back) before the run is settled, so a
forwarder's spool can still be sent.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from azure.eventhub import EventData

from contracts.envelope import VmIdentity
from emulators.azurite import Azurite
from emulators.eventhubs import EventHubsEmulator, producer_client
from emulators.imds import ImdsEmulator
from emulators.imds.local_steps import ForgeStep, ListenerStep, OutageStep, SignalStep
from emulators.imds.models import ScenarioStep
from emulators.relay import RelayEmulator
from forwarder.imds import identity_of
from local import forgeries
from local.forwarders import ForwarderProcess
from local.gates import GateServer
from local.stack_options import StackOptions

log = logging.getLogger("local.platform")


# A Freeze pauses its VMs for its DurationInSeconds on the run's time scale, as everything else in the run is, but
# at least FREEZE_MIN_SECONDS of real time: a pause compressed 60 times (5 s -> 83 ms) would be below what a VM can
# tell from its own scheduling. An unscaled pause (5 s at 120x is 10 Azure minutes) outlives a started event's stay
# in the documents and NotBefore, and makes timelines Azure never produces. At most FREEZE_MAX_SECONDS.
FREEZE_MIN_SECONDS = 1.0
# How long after a Freeze starts its VMs are paused (real seconds): a poll interval and a little, so that each VM's
# forwarder has seen the event listed (a peer may approve it at once) and measures the pause from its own clock
# readings. Azure does not document the onset; a VM paused before it ever saw its Freeze can only bound the pause
# from its late poll (forwarder/impact.py).
FREEZE_ONSET_SECONDS = 1.2
FREEZE_MAX_SECONDS = 30.0
# How long a Reboot or Redeploy keeps a VM down (real seconds), from its forwarder's stop to its start.
REBOOT_SECONDS = 2.0
RESTARTING_TYPES = ("Reboot", "Redeploy")


def now_utc() -> datetime:
    return datetime.now(UTC)


def freeze_seconds(duration: float, time_scale: float) -> float:
    """Real seconds a Freeze of ``duration`` Azure seconds pauses its VMs in a run at ``time_scale``."""
    if duration <= 0:
        return 0.0
    return min(duration, FREEZE_MAX_SECONDS, max(duration / time_scale, FREEZE_MIN_SECONDS))


def write_boot_time(path: Path, at: float) -> None:
    """A /proc/stat-shaped file whose ``btime`` is ``at`` (whole seconds, as the kernel writes it): the boot time
    the VM's forwarder reads (its ``boot_time_file``)."""
    path.write_text(f"btime {int(at)}\n", encoding="ascii")


class PlatformStack(Protocol):
    """What the platform plays on: the stack's emulators, gate pages and forwarders (``local.stack.LocalStack``)."""

    options: StackOptions
    hub: str
    azurite: Azurite | None
    eventhubs: EventHubsEmulator | None
    relay: RelayEmulator | None
    imds: ImdsEmulator | None
    gates: GateServer | None
    forwarders: dict[str, ForwarderProcess]
    removed: dict[str, float]

    def boot_time_file(self, name: str) -> Path: ...

    def wipe_forwarder_state(self, name: str) -> None: ...

    def restart_forwarder(self, name: str) -> None: ...


class Platform:
    """Plays the local steps on ``stack``; ``log`` holds one dict per thing done: ``at`` (ISO, UTC), ``action``
    and what it was done to. Actions: ``forwarder-start``, ``forwarder-kill``, ``forwarder-stop``,
    ``forwarder-cont``, ``storage-stop``, ``storage-cont``, ``outage-begin``, ``outage-end``, ``listener``,
    ``gate``, ``forge``, ``wipe``."""

    def __init__(self, stack: PlatformStack) -> None:
        self.stack = stack
        self.log: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        # What is still to come, by what it ends (``forwarder:NAME``, ``storage``, ``outage:…``): several per key at
        # once (a Freeze's onset pending while a Reboot's boot is), each fired once (finish() ends what is left).
        self._timers: dict[str, list[threading.Timer]] = {}
        # Injected Relay listener behaviour per VM, kept to be applied again to a Relay started after an outage.
        self.listener_faults: dict[str, tuple[float, bool]] = {}
        self.liars: list[tuple[ForgeStep, forgeries.LyingListener]] = []

    def record(self, action: str, **details: Any) -> None:
        with self._lock:
            self.log.append({"at": now_utc().isoformat(), "action": action, **details})

    # ---- steps -----------------------------------------------------------------------------------------------
    def play(self, step: ScenarioStep) -> None:
        try:
            if step.wipeForwarderState is not None:
                self.record("wipe", vm=step.wipeForwarderState)
                self.stack.wipe_forwarder_state(step.wipeForwarderState)
            elif step.signal is not None:
                self._signal(step.signal)
            elif step.outage is not None:
                self._outage(step.outage)
            elif step.listener is not None:
                self._listener(step.listener)
            elif step.gate is not None:
                if self.stack.gates is None:
                    log.warning("gate step for %s: the policy serves no local gate", step.gate.name)
                    return
                self.stack.gates.set(step.gate.name, step.gate.state, step.gate.delaySeconds)
                self.record("gate", name=step.gate.name, state=step.gate.state, delaySeconds=step.gate.delaySeconds)
            elif step.forge is not None:
                threading.Thread(target=self._forge, args=(step.forge,), name="local-forger", daemon=True).start()
        except Exception:  # a step that cannot be played is logged; the run goes on
            log.exception("local step not played: %s", step.model_dump(exclude_none=True))

    def _later(self, key: str, seconds: float, action: Any) -> None:
        timer = threading.Timer(seconds, lambda: self._fire(key, timer, action))
        timer.daemon = True
        with self._lock:
            self._timers.setdefault(key, []).append(timer)
        timer.start()

    def _fire(self, key: str, timer: threading.Timer, action: Any) -> None:
        # One timer per action, not one per key: with one per key, a Freeze's onset that fired while a Reboot's
        # boot was pending took the boot's place, and the VM's forwarder never started again (oracle seeds 43, 79).
        with self._lock:
            pending = self._timers.get(key, [])
            if timer not in pending:
                return  # finish() ended it already
            pending.remove(timer)
            if not pending:
                del self._timers[key]
        action()

    def _signal(self, step: SignalStep) -> None:
        if step.target == "storage":
            azurite = self.stack.azurite
            pid = azurite.pid if azurite is not None else None
            if pid is None:
                return
            os.kill(pid, signal.SIGSTOP)
            self.record("storage-stop", seconds=step.seconds)
            self._later("storage", step.seconds, lambda: self._continue_storage(pid))
            return
        assert step.vm is not None  # validated: a forwarder's signal names its VM
        name = step.vm
        if name in self.stack.removed or name not in self.stack.forwarders:
            return
        forwarder = self.stack.forwarders[name]
        if step.signal == "KILL":
            forwarder.kill()
            self.record("forwarder-kill", vm=name, reason="signal")
            if step.seconds > 0:
                self._later(f"forwarder:{name}", step.seconds, lambda: self.stack.restart_forwarder(name))
            return
        forwarder.pause()
        self.record("forwarder-stop", vm=name)
        self._later(f"forwarder:{name}", step.seconds, lambda: self._continue(name))

    # ---- what an event does to its VMs --------------------------------------------------------------------------
    def event_started(self, event: dict[str, Any]) -> None:
        """An event the IMDS emulator started (its global summary): a Freeze pauses the forwarders of its VMs
        (SIGSTOP, SIGCONT after its duration); a Reboot or Redeploy stops them (SIGTERM, as a shutdown would) and
        starts them again ``REBOOT_SECONDS`` later with a new boot time. Logged as forwarder-stop and -cont or -start
        (the oracle's record of when a forwarder ran), with the event and, on the way back, the time it was out."""
        event_type, event_id = str(event["EventType"]), str(event["EventId"])
        names = [n for n in event["Resources"] if n in self.stack.forwarders and n not in self.stack.removed]
        if event_type == "Freeze":
            seconds = freeze_seconds(float(event.get("DurationInSeconds") or 0), self.stack.options.time_scale)
            if seconds <= 0:
                return
            for name in names:
                self._later(
                    f"forwarder:{name}",
                    FREEZE_ONSET_SECONDS,
                    lambda name=name, seconds=seconds: self._freeze(name, event_id, seconds),
                )
        elif event_type in RESTARTING_TYPES:
            for name in names:
                threading.Thread(
                    target=self._reboot, args=(name, event_id), name=f"local-reboot-{name}", daemon=True
                ).start()

    def _freeze(self, name: str, event_id: str, seconds: float) -> None:
        if name in self.stack.removed or not self.stack.forwarders[name].running:
            return  # removed, or down for a Reboot meanwhile: nothing runs to pause
        self.stack.forwarders[name].pause()
        stopped = time.monotonic()
        self.record("forwarder-stop", vm=name, reason="freeze", eventId=event_id)
        self._later(f"forwarder:{name}", seconds, lambda: self._thaw(name, event_id, stopped))

    def _thaw(self, name: str, event_id: str, stopped: float) -> None:
        self.stack.forwarders[name].resume()
        self.record(
            "forwarder-cont", vm=name, reason="freeze", eventId=event_id, paused=round(time.monotonic() - stopped, 3)
        )

    def _reboot(self, name: str, event_id: str) -> None:
        self.stack.forwarders[name].stop()
        stopped = time.monotonic()
        # The boot is pending before the stop is logged: whoever sees the log entry (finish, a test) finds it.
        self._later(f"forwarder:{name}", REBOOT_SECONDS, lambda: self._boot(name, event_id, stopped))
        self.record("forwarder-stop", vm=name, reason="reboot", eventId=event_id)

    def _boot(self, name: str, event_id: str, stopped: float) -> None:
        write_boot_time(self.stack.boot_time_file(name), time.time())
        self.stack.restart_forwarder(name)
        self.record(
            "forwarder-start", vm=name, reason="reboot", eventId=event_id, down=round(time.monotonic() - stopped, 3)
        )

    def _continue(self, name: str) -> None:
        self.stack.forwarders[name].resume()
        self.record("forwarder-cont", vm=name)

    def _continue_storage(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        self.record("storage-cont")

    def _outage(self, step: OutageStep) -> None:
        if step.service == "eventhubs":
            eventhubs = self.stack.eventhubs
            if eventhubs is None:
                return
            eventhubs.stop()  # every connection drops; the port stays reserved for the restart
            self.record("outage-begin", service="eventhubs")
            self._later("outage:eventhubs", step.seconds, self._eventhubs_back)
            return
        relay = self.stack.relay
        if relay is None:
            return
        port = relay.port
        relay.stop()
        self.record("outage-begin", service="relay")
        self._later("outage:relay", step.seconds, lambda: self._relay_back(port))

    def _eventhubs_back(self) -> None:
        if self.stack.eventhubs is not None:
            self.stack.eventhubs.start()
            self.record("outage-end", service="eventhubs")

    def _relay_back(self, port: int) -> None:
        relay = RelayEmulator(port=port)
        relay.start()
        self.stack.relay = relay
        for hybrid_connection, (delay, dead) in self.listener_faults.items():
            relay.set_listener_fault(hybrid_connection, delay_seconds=delay, dead=dead)
        self.record("outage-end", service="relay")

    def _listener(self, step: ListenerStep) -> None:
        imds = self.stack.imds
        if imds is None:
            return
        vm = next(spec for spec in imds.vms() if spec.name == step.vm)
        hybrid_connection = f"vm-{vm.vmId.lower()}"
        self._set_listener(step.vm, hybrid_connection, step.delaySeconds, step.dead)
        if step.seconds > 0 and (step.delaySeconds > 0 or step.dead):
            self._later(
                f"listener:{step.vm}", step.seconds, lambda: self._set_listener(step.vm, hybrid_connection, 0.0, False)
            )

    def _set_listener(self, vm: str, hybrid_connection: str, delay: float, dead: bool) -> None:
        if delay > 0 or dead:
            self.listener_faults[hybrid_connection] = (delay, dead)
        else:
            self.listener_faults.pop(hybrid_connection, None)
        relay = self.stack.relay
        if relay is not None:
            try:
                relay.set_listener_fault(hybrid_connection, delay_seconds=delay, dead=dead)
            except RuntimeError:  # the relay is out; applied again when it is back
                log.debug("relay out: listener fault of %s kept for later", vm)
        self.record("listener", vm=vm, delaySeconds=delay, dead=dead)

    # ---- forged envelopes and a lying listener (local/forgeries.py) -------------------------------------------
    def _forge(self, step: ForgeStep) -> None:
        imds, eventhubs = self.stack.imds, self.stack.eventhubs
        if imds is None or eventhubs is None or step.by in self.stack.removed:
            return
        specs = {spec.name: spec for spec in imds.vms()}
        victim = VmIdentity.of(identity_of(specs[step.about].compute()))
        forger = VmIdentity.of(identity_of(specs[step.by].compute()))
        if step.kind == "liar":
            self._lie(step, victim)
            return
        try:
            seen = imds.document(step.by)
            events = [e for e in seen["Events"] if step.about in e.get("Resources", [])]
            messages = forgeries.forged(
                step,
                victim=victim,
                forger=forger,
                incarnation=seen["DocumentIncarnation"],
                events=events,
                attest=lambda state: forgeries.attestation_of(imds.url_for(step.by), state),
            )
        except Exception:  # the forger's VM is gone: it sends nothing
            log.warning("forgery of %s not made", step.by, exc_info=True)
            return
        producer = producer_client(eventhubs.connection_string(self.stack.hub))
        try:
            with producer:
                for body, key in messages:
                    batch = producer.create_batch(partition_key=key)
                    batch.add(EventData(body))
                    producer.send_batch(batch)
        except Exception:  # an outage: the forger gives up, as the real forwarder would not
            log.warning("forged envelope of %s not sent", step.by, exc_info=True)
            return
        self.record(
            "forge",
            by=step.by,
            about=step.about,
            kind=step.kind,
            events=[str(e["EventId"]) for e in events],
            sent=len(messages),
            digests=[forgeries.digest(body) for body, _ in messages],
        )

    def _lie(self, step: ForgeStep, victim: VmIdentity) -> None:
        relay, imds = self.stack.relay, self.stack.imds
        if relay is None or imds is None:
            return
        liar = forgeries.LyingListener(
            relay_endpoint=relay.ws_url,
            hybrid_connection=victim.hybrid_connection_name,
            vm_url=imds.url_for(step.by),
        ).start()
        self.liars.append((step, liar))
        self.record("forge", by=step.by, about=step.about, kind=step.kind, events=[], sent=0)

    # ---- the end ---------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Ends every fault still on, now (the run is being settled)."""
        for step, liar in self.liars:
            liar.stop()
            self.record("liar", by=step.by, about=step.about, answered=[list(a) for a in liar.answered])
        self.liars.clear()
        with self._lock:
            pending = dict(self._timers)
            self._timers.clear()
        for timers in pending.values():
            for timer in timers:
                timer.cancel()
        for key in pending:
            try:
                self._end(key)
            except Exception:
                log.exception("fault %s not ended", key)

    def _end(self, key: str) -> None:
        kind, _, name = key.partition(":")
        if kind == "storage":
            azurite = self.stack.azurite
            if azurite is not None and azurite.pid is not None:
                self._continue_storage(azurite.pid)
        elif kind == "forwarder":
            forwarder = self.stack.forwarders[name]
            if forwarder.paused:
                self._continue(name)
            elif not forwarder.running and name not in self.stack.removed:
                self.stack.restart_forwarder(name)
        elif kind == "outage" and name == "eventhubs":
            self._eventhubs_back()
        elif kind == "outage":
            relay = self.stack.relay
            self._relay_back(relay.port if relay is not None else 0)
        elif kind == "listener":
            imds = self.stack.imds
            vm = next(spec for spec in imds.vms() if spec.name == name) if imds is not None else None
            if vm is not None:
                self._set_listener(name, f"vm-{vm.vmId.lower()}", 0.0, False)
