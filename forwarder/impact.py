"""Proof of impact: what an event did to this VM, measured by the forwarder and sent as an ``impact`` envelope.

- **A Freeze's pause.** While a Freeze of this VM is listed, a thread ticks every ``tick`` seconds and keeps the
  time of its last tick on both clocks; a gap longer than a tick is time in which the process did not run. The
  pause is the longest such gap, less half a tick (a tick lands anywhere in the tick before the stop, so the gap
  is the pause plus 0 to 1 tick); gaps within ``PAUSE_FLOOR`` of a tick are scheduling, not a pause. Both clocks are
  read because neither sees every pause: a stopped process (SIGSTOP, the local platform's Freeze) sees both run on
  alike, but in a paused VM the guest's CLOCK_MONOTONIC may stand still (KVM's kvmclock does, by design) while the
  wall clock is put right after the resume by the host's time sync (Hyper-V's TimeSync steps it), so the larger gap
  is the pause and ``clock`` names the clock that showed it (docs/forwarder.md, *Proof of impact*). A wall-clock
  step by NTP would also show; measuring only while a Freeze is listed keeps that to the event's window.
- **A Reboot's or Redeploy's downtime.** On every poll while one of this VM is listed, the time of that poll is
  kept in the durable state (``IMPACT_RESTART``); the forwarder that starts after the reboot finds it, reads the
  boot time (``btime`` of /proc/stat, or the file the settings name) and, when the VM booted after that last poll,
  reports the downtime: from the last poll before to its first poll after, on the wall clock (the monotonic clock
  starts again at boot).
- **A Reboot or Redeploy this VM never saw listed** (approved, by a peer or at once, and started between two polls):
  no watch was kept, but the last sign of life was (``IMPACT_ALIVE``: the last poll's time, written at each heartbeat
  and at a clean stop, so no disk write per poll). When the VM booted after it and the first document after the
  start lists a Reboot or Redeploy of this VM as Started (Azure keeps it listed about 10 minutes after it started),
  the downtime is reported from that last sign of life: exact after a clean shutdown, at most a heartbeat early
  after a hard reset.

Reports are spooled on the poll loop's thread, before its next poll (``before_poll``), so a pause is reported
before the change that shows the Freeze gone, and the coordinator has it when the event completes. A Preempt's or
Terminate's end is not measured here: the VM is gone; the coordinator takes its last heartbeat.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from contracts.checks import Invalid
from contracts.wire import (
    MAX_SECONDS,
    ImpactClock,
    ImpactReport,
    ScheduledEvent,
    ScheduledEventsDocument,
    VmIdentity,
)
from forwarder.durable_state import IMPACT_ALIVE, IMPACT_RESTART, StoreFull
from forwarder.envelopes import envelope_of
from forwarder.logs import fields
from forwarder.worker_parts import WorkerParts

log = logging.getLogger("forwarder.impact")

# A gap this much longer than a tick is a pause; less is the scheduler of a busy machine.
PAUSE_FLOOR = 0.2
# /proc/stat's btime is whole seconds: a boot within the second of the last poll still counts as after it.
BOOT_TIME_RESOLUTION = 1.0
RESTARTING_TYPES = frozenset({"Reboot", "Redeploy"})


def read_boot_time(path: Path) -> datetime | None:
    """The ``btime`` line of a /proc/stat-shaped file (seconds since the epoch), None when it cannot be read."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "btime" and value.strip().isdigit():
            return datetime.fromtimestamp(int(value.strip()), UTC)
    return None


def _report(**measured: Any) -> list[ImpactReport]:
    """The report, or none when the contract cannot carry what was measured: seconds beyond a week are a clock that
    stepped, not an event's impact (contracts.envelope.MAX_SECONDS), and a DurationInSeconds beyond it is sent as
    not announced (-1)."""
    announced = measured.get("announcedSeconds", -1)
    if not -1 <= announced <= MAX_SECONDS:
        measured["announcedSeconds"] = -1
    try:
        return [ImpactReport(**measured)]
    except Invalid as error:
        log.warning("an impact not reported: %s", error, extra=fields(event_id=measured.get("eventId")))
        return []


@dataclass
class _Gap:
    start: datetime
    end: datetime
    monotonic: float
    wall: float

    def pause(self, tick: float) -> float:
        return max(0.0, max(self.monotonic, self.wall) - tick / 2)

    @property
    def clock(self) -> ImpactClock:
        return "wall" if self.wall > self.monotonic else "monotonic"


@dataclass
class _FreezeWatch:
    event_type: str
    announced: int
    started: bool = False
    largest: _Gap | None = None
    reported: float = -1.0  # the pause last reported (-1: none yet)


@dataclass
class _Restart:
    event_id: str
    event_type: str
    announced: int
    last_poll: datetime

    def dump(self) -> str:
        return json.dumps(
            {
                "eventId": self.event_id,
                "eventType": self.event_type,
                "announced": self.announced,
                "lastPollAt": self.last_poll.isoformat(),
            }
        )

    @classmethod
    def load(cls, text: str | None) -> _Restart | None:
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                str(data["eventId"]),
                str(data["eventType"]),
                int(data["announced"]),
                datetime.fromisoformat(str(data["lastPollAt"])),
            )
        except (ValueError, KeyError, TypeError):
            log.warning("the remembered restart watch is unreadable; this restart is not measured")
            return None


@dataclass(frozen=True)
class _Alive:
    """The last sign of life kept across a reboot: the last poll's time and the boot it was in (a boot time names
    a boot: another one is a reboot, whatever the clocks say)."""

    last_poll: datetime
    boot: datetime | None

    def dump(self) -> str:
        return json.dumps(
            {"lastPollAt": self.last_poll.isoformat(), "bootTime": self.boot.isoformat() if self.boot else None}
        )

    @classmethod
    def load(cls, text: str | None) -> _Alive | None:
        if not text:
            return None
        try:
            data = json.loads(text)
            boot = data.get("bootTime")
            return cls(datetime.fromisoformat(str(data["lastPollAt"])), datetime.fromisoformat(boot) if boot else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("the remembered last sign of life is unreadable; an unseen restart is not measured")
            return None

    def rebooted_by(self, booted: datetime) -> bool:
        if self.boot is not None:
            return booted != self.boot
        return booted > self.last_poll - timedelta(seconds=BOOT_TIME_RESOLUTION)


class ImpactMeter:
    """One VM's meter. ``run`` is the tick thread; the poll loop calls ``before_poll`` and ``polled(document)``."""

    def __init__(
        self,
        parts: WorkerParts,
        *,
        tick: float,
        boot_time_file: Path,
        stop: threading.Event,
    ) -> None:
        self._parts = parts
        self.tick = tick
        self._boot_time_file = boot_time_file
        self._stop = stop
        self._lock = threading.Lock()
        self._armed = threading.Event()
        self._last: tuple[float, datetime] | None = None
        self._late: _Gap | None = None  # how late the current poll started (before_poll), when a pause
        self._freezes: dict[str, _FreezeWatch] = {}
        self._pending: list[ImpactReport] = []
        self._restart = _Restart.load(parts.store.get_state(IMPACT_RESTART))
        self._alive = _Alive.load(parts.store.get_state(IMPACT_ALIVE))  # the last sign of life before this start
        self._booted: datetime | None = None  # this boot's time, read at the first poll
        self._last_poll: datetime | None = None
        self._unseen_boot: datetime | None = None  # booted after it with no watch: the first document tells
        self._reported: set[str] = set()  # restarts reported since this start: not watched again
        self._after_start = True

    # --- the tick thread ----------------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            if not self._armed.is_set():
                self._armed.wait()  # no Freeze listed: no ticks (stop() sets it too)
                continue
            self._tick()
            self._stop.wait(self.tick)

    def wake(self) -> None:
        """The daemon is stopping: the thread looks at the stop event now."""
        self._armed.set()

    def _tick(self) -> None:
        now = (time.monotonic(), datetime.now(UTC))
        with self._lock:
            if not self._freezes:
                self._last = None
                return
            last, self._last = self._last, now
            if last is None:
                return
            gap = _Gap(last[1], now[1], now[0] - last[0], (now[1] - last[1]).total_seconds())
            if max(gap.monotonic, gap.wall) < self.tick + PAUSE_FLOOR:
                return
            for event_id, watch in self._freezes.items():
                if watch.largest is None or gap.pause(self.tick) > watch.largest.pause(self.tick):
                    watch.largest = gap
                    self._pending.extend(self._pause_report(event_id, watch, gap))
                    watch.reported = gap.pause(self.tick)

    def _pause_report(self, event_id: str, watch: _FreezeWatch, gap: _Gap | None) -> list[ImpactReport]:
        now = datetime.now(UTC)
        return _report(
            eventId=event_id,
            eventType=watch.event_type,
            measure="pause",
            announcedSeconds=watch.announced,
            measuredSeconds=round(gap.pause(self.tick), 3) if gap else 0.0,
            start=gap.start if gap else now,
            end=gap.end if gap else now,
            clock=gap.clock if gap else "monotonic",
            monotonicGapSeconds=round(max(gap.monotonic, 0.0), 3) if gap else None,
            wallGapSeconds=round(gap.wall, 3) if gap else None,
        )

    # --- the poll loop ------------------------------------------------------------------------------------
    def before_poll(self, identity: VmIdentity, *, due: float | None = None) -> None:
        """Looks at the clocks once more (the poll loop may run before the tick thread after a stop) and spools
        what was measured, before the poll that may show the event gone. The first call after a start reports
        the restart that a watch from before it and a later boot time show. ``due`` (monotonic): when this poll
        was due; how late it starts is how long the loop did not run while it slept, a pause that ``polled``
        gives a Freeze first seen Started (the VM paused before its forwarder ever saw the Freeze listed: a peer
        approved it at once)."""
        late = time.monotonic() - due if due is not None else 0.0
        wall = datetime.now(UTC)
        with self._lock:
            self._late = (
                _Gap(wall - timedelta(seconds=late), wall, late, late) if late >= self.tick + PAUSE_FLOOR else None
            )
        self._tick()
        if self._after_start:
            self._after_start = False
            self._restarted()
        with self._lock:
            pending, self._pending = self._pending, []
        for report in pending:
            self._spool(identity, report)

    def polled(self, document: ScheduledEventsDocument, identity: VmIdentity) -> None:
        """After a good poll: watch the Freezes of this VM that ``document`` lists, report the end of those it no
        longer lists, and keep the time of this poll while a Reboot or Redeploy of this VM is listed."""
        mine = [e for e in document.Events if identity.name in e.Resources]
        now = datetime.now(UTC)
        with self._lock:
            freezes = {e.EventId: e for e in mine if e.EventType == "Freeze"}
            for event_id, event in freezes.items():
                first = event_id not in self._freezes
                watch = self._freezes.setdefault(event_id, _FreezeWatch(event.EventType, event.DurationInSeconds))
                watch.started |= event.EventStatus == "Started"
                if first and watch.started and self._late is not None:
                    watch.largest = self._late
                    self._pending.extend(self._pause_report(event_id, watch, self._late))
                    watch.reported = self._late.pause(self.tick)
            for event_id in [k for k in self._freezes if k not in freezes]:
                watch = self._freezes.pop(event_id)
                # Over without a pause seen: "it did not hurt" is worth saying too (a canceled one is not).
                if watch.started and watch.largest is None:
                    self._pending.extend(self._pause_report(event_id, watch, None))
            if self._freezes:
                if self._last is None:
                    # This poll is the first sign of life to measure from: a pause right after it (a Freeze
                    # approved at once) would otherwise come before the tick thread's first reading, unseen.
                    self._last = (time.monotonic(), datetime.now(UTC))
                self._armed.set()
            else:
                self._armed.clear()
                self._last = None
        self._last_poll = now
        if self._unseen_boot is not None:
            self._unseen_restart(mine, now)
        restarting = next(
            (e for e in mine if e.EventType in RESTARTING_TYPES and e.EventId not in self._reported), None
        )
        try:
            if restarting is not None:
                self._restart = _Restart(restarting.EventId, restarting.EventType, restarting.DurationInSeconds, now)
                self._parts.store.put_state(IMPACT_RESTART, self._restart.dump())
            elif self._restart is not None:
                # Gone without a reboot of this VM (canceled, or done elsewhere): nothing to measure.
                log.info("restart watch ended without a reboot", extra=fields(event_id=self._restart.event_id))
                self._restart = None
                self._parts.store.put_state(IMPACT_RESTART, "")
        except StoreFull:
            log.warning("the restart watch could not be kept (state disk full)")

    def mark_alive(self) -> None:
        """Keeps the last poll's time across a reboot (at each heartbeat and at a clean stop): the lower bound of a
        downtime this VM had no watch for."""
        if self._last_poll is None:
            return
        try:
            self._parts.store.put_state(IMPACT_ALIVE, _Alive(self._last_poll, self._booted).dump())
        except StoreFull:
            log.warning("the last sign of life could not be kept (state disk full)")

    def _restarted(self) -> None:
        watch = self._restart
        booted = self._booted = read_boot_time(self._boot_time_file)
        if watch is None:
            if booted is not None and self._alive is not None and self._alive.rebooted_by(booted):
                self._unseen_boot = booted
            return
        if booted is None or not self._booted_after(booted, watch.last_poll):
            return  # the forwarder restarted, the VM did not: the watch goes on
        self._report_restart(watch, booted, datetime.now(UTC))

    @staticmethod
    def _booted_after(booted: datetime, alive: datetime) -> bool:
        return booted > alive - timedelta(seconds=BOOT_TIME_RESOLUTION)

    def _unseen_restart(self, mine: list[ScheduledEvent], now: datetime) -> None:
        """The first document after a boot no watch expected: a Reboot or Redeploy of this VM listed as Started is
        what took it down, from the last sign of life before it (none listed: a reboot of the guest's own)."""
        booted, self._unseen_boot = self._unseen_boot, None
        started = next((e for e in mine if e.EventType in RESTARTING_TYPES and e.EventStatus == "Started"), None)
        if started is None or booted is None or self._alive is None:
            return
        watch = _Restart(started.EventId, started.EventType, started.DurationInSeconds, self._alive.last_poll)
        log.info("a restart this VM never saw listed", extra=fields(event_id=started.EventId))
        self._report_restart(watch, booted, now)

    def _report_restart(self, watch: _Restart, booted: datetime, now: datetime) -> None:
        self._restart = None
        self._reported.add(watch.event_id)
        reports = _report(
            eventId=watch.event_id,
            eventType=watch.event_type,
            measure="restart",
            announcedSeconds=watch.announced,
            measuredSeconds=round(max(0.0, (now - watch.last_poll).total_seconds()), 3),
            start=watch.last_poll,
            end=now,
            clock="wall",
            wallGapSeconds=round((now - watch.last_poll).total_seconds(), 3),
            bootTime=booted,
        )
        if not reports:
            # Nothing to spool, so nothing clears the watch with it: cleared here, or every start tries again.
            try:
                self._parts.store.put_state(IMPACT_RESTART, "")
            except StoreFull:
                log.warning("the restart watch could not be cleared (state disk full)")
        with self._lock:
            self._pending.extend(reports)

    def _spool(self, identity: VmIdentity, report: ImpactReport) -> None:
        observed = datetime.now(UTC)
        build = envelope_of("impact", identity, self._parts.store.state_id, observed, impact=report)
        # A restart's report clears its watch and moves the last sign of life past the boot in the same transaction:
        # it is reported once, whichever way it was found.
        alive = _Alive(observed, report.bootTime).dump()
        state = {IMPACT_RESTART: "", IMPACT_ALIVE: alive} if report.measure == "restart" else None
        try:
            self._parts.store.enqueue("impact", build, state=state)
        except StoreFull:
            log.error("an impact report was lost: the state disk is full", extra=fields(event_id=report.eventId))
            return
        log.info(
            "impact measured",
            extra=fields(
                event_id=report.eventId,
                event_type=report.eventType,
                measure=report.measure,
                measured_s=report.measuredSeconds,
                announced_s=report.announcedSeconds,
                clock=report.clock,
            ),
        )
        self._parts.spooled()
