"""What the approval callback costs: Relay listener-hours and dollars per VM per month, on demand and always on.

    python -m ops.cost [--history .local/history.sqlite] [--price 0.0134] [--grace-seconds 60]
        [--events-per-vm-month 4] [--scheduled-minutes 15] [--vms N] [--period-days D] [--round-up-hours]
        [--time-scale N]

Takes either the local history (``adapters/history.py``: its ``Observation`` rows say which VM saw which event
Scheduled, from when, until it saw it Started or gone) or assumed event rates; gives one JSON object with both modes.

A local run (``python -m local``) plays Azure's durations faster by its time scale (a 15-minute notice lasts 15 s at
60) and says so beside its history (``local-run.json``); its times are stretched back by that scale before anything
is measured, and the report names the scale. ``--time-scale`` gives it for a history without that record.

A VM's on-demand listener is connected while its document holds a Scheduled event it could approve (its own
Terminate, any other event of its group: ``forwarder/on_demand.py``) plus the grace period after the last one;
overlapping windows of one VM are one connection. Always on, it is connected every hour of the month.

Defaults and their sources:

- price: $0.0134 per listener-hour, the retail "Hybrid Connections Listener Unit" meter in East US as researched
  in November 2026 (``../shared/reference/azure-platform.md``); it varies by region and over time, so it is a
  parameter. Partial-hour rounding is not documented: ``--round-up-hours`` bills every connection as whole hours,
  the pessimistic reading.
- 730 hours a month: Azure's pricing calculator's month.
- 4 events per VM per month: an assumption, not a published rate. It counts the events in the VM's document,
  its group's included (any of them connects its listener). Platform maintenance reaches a VM about monthly (host
  updates, mostly Freeze, batched by update domain), and redeploys for predicted hardware failure, user-initiated
  reboots/redeploys and scale-in deletes add a few more; 4 is on the generous side. Measure yours with
  ``--history``.
- 15 minutes Scheduled per event: the longest minimum notice (Freeze and Reboot, 15 min; Redeploy 10, Terminate
  5-15, Preempt 30 s). An event approved at once is Scheduled for seconds, so this is the upper bound (an event
  that waits out its notice, e.g. for a person).
- 60 s grace: the forwarder's ``relay_listener_grace_seconds`` default.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel, ConfigDict

from coordinator import DEFAULT_SQLITE_PATH, history_schema
from ops import command
from ops.history import LOCAL_RUN_FILE, HistoryInputError, LocalRun, local_run_path, read_local_run

PRICE_USD_PER_LISTENER_HOUR = 0.0134
HOURS_PER_MONTH = 730.0
EVENTS_PER_VM_MONTH = 4.0
SCHEDULED_MINUTES = 15.0
GRACE_SECONDS = 60.0


class CostError(ValueError):
    """Arguments or a history the model cannot use; the message names the input and the reason."""


class ModeCost(BaseModel):
    model_config = ConfigDict(frozen=True)

    listener_hours_per_vm_month: float
    usd_per_vm_month: float


class CostReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str  # "history" | "assumed rates"
    # Azure seconds per second of the history's clock: 1 for real time, a local run's time scale for its history.
    time_scale: float
    price_usd_per_listener_hour: float
    grace_seconds: float
    round_up_hours: bool
    vms: int
    period_days: float
    events_per_vm_month: float
    on_demand: ModeCost
    always_on: ModeCost


Window = tuple[datetime, datetime]


def merged_hours(windows: Iterable[Window], *, grace: timedelta, round_up: bool) -> float:
    """One VM's connected hours: each window extended by the grace period, overlapping ones merged into one
    connection; with ``round_up`` each connection is billed as whole hours."""
    connections: list[list[datetime]] = []
    for start, end in sorted(windows):
        if connections and start <= connections[-1][1]:
            connections[-1][1] = max(connections[-1][1], end + grace)
        else:
            connections.append([start, end + grace])
    hours = [(end - start).total_seconds() / 3600 for start, end in connections]
    return sum(math.ceil(h) if round_up else h for h in hours)


def _report(
    *,
    source: str,
    on_demand_hours: float,
    vms: int,
    period_days: float,
    events: float,
    args: argparse.Namespace,
    time_scale: float = 1.0,
) -> CostReport:
    always = HOURS_PER_MONTH  # one connection the whole month: rounding changes nothing
    return CostReport(
        source=source,
        time_scale=time_scale,
        price_usd_per_listener_hour=args.price,
        grace_seconds=args.grace_seconds,
        round_up_hours=args.round_up_hours,
        vms=vms,
        period_days=round(period_days, 3),
        events_per_vm_month=round(events, 3),
        on_demand=ModeCost(
            listener_hours_per_vm_month=round(on_demand_hours, 4),
            usd_per_vm_month=round(on_demand_hours * args.price, 6),
        ),
        always_on=ModeCost(listener_hours_per_vm_month=always, usd_per_vm_month=round(always * args.price, 6)),
    )


def from_rates(args: argparse.Namespace) -> CostReport:
    """Each event its own connection of its Scheduled time plus the grace (overlaps ignored: an upper bound)."""
    per_event = (args.scheduled_minutes * 60 + args.grace_seconds) / 3600
    hours = args.events_per_vm_month * (math.ceil(per_event) if args.round_up_hours else per_event)
    return _report(
        source="assumed rates",
        on_demand_hours=hours,
        vms=args.vms or 1,
        period_days=HOURS_PER_MONTH / 24,
        events=args.events_per_vm_month,
        args=args,
    )


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


Row = Mapping[str, Any]
_TIMES = ("NotBefore", "ObservedAt", "TimeGenerated")


def stretched(rows: Iterable[Row], *, origin: datetime, scale: float) -> list[Row]:
    """The rows as Azure would have timed them: each time moved ``scale`` times as far from ``origin``."""
    if scale == 1:
        return list(rows)

    def stretch(value: str | None) -> str | None:
        moment = _time(value)
        return (origin + (moment - origin) * scale).isoformat() if moment is not None else None

    return [{**dict(row), **{name: stretch(row[name]) for name in _TIMES}} for row in rows]


def scheduled_windows(rows: Sequence[Row], *, period_end: datetime) -> dict[tuple[str, str], Window]:
    """(VM, EventId) -> when that VM's listener was needed: from its first sighting of the event Scheduled to its
    first sighting of it Started or gone (else NotBefore, when the platform starts it anyway, else its last
    Scheduled sighting). A Terminate counts only for the VMs it deletes (no peer may approve it)."""
    windows: dict[tuple[str, str], Window] = {}
    ended: set[tuple[str, str]] = set()
    for row in rows:  # in ObservedAt order
        key = (row["VmName"], row["EventId"])
        seen = _time(row["ObservedAt"]) or _time(row["TimeGenerated"])
        if seen is None or key in ended:
            continue
        if row["EventStatus"] == "Scheduled":
            if row["EventType"] == "Terminate" and row["VmName"] not in json.loads(row["Resources"] or "[]"):
                continue
            not_before = _time(row["NotBefore"])
            start = windows[key][0] if key in windows else seen
            end = max(seen, min(not_before, period_end)) if not_before else seen
            windows[key] = (start, max(end, windows[key][1]) if key in windows else end)
        elif key in windows:
            windows[key] = (windows[key][0], seen)
            ended.add(key)
    return windows


def from_history(path: Path, args: argparse.Namespace) -> CostReport:
    if not path.is_file():
        raise CostError(
            f"--history {path}: no such file (the coordinator's local history, see coordinator/adapters/history.py)"
        )
    table = history_schema()["table"]
    try:
        db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
        db.row_factory = sqlite3.Row
        try:
            span = db.execute(f'SELECT MIN(TimeGenerated), MAX(TimeGenerated) FROM "{table}"').fetchone()  # noqa: S608
            names = db.execute(f'SELECT DISTINCT VmName FROM "{table}" WHERE VmName IS NOT NULL').fetchall()  # noqa: S608
            rows = db.execute(
                "SELECT VmName, EventId, EventType, EventStatus, NotBefore, Resources, ObservedAt, TimeGenerated "  # noqa: S608
                f"FROM \"{table}\" WHERE RecordType = 'Observation' AND EventId IS NOT NULL AND VmName IS NOT NULL "
                "ORDER BY COALESCE(ObservedAt, TimeGenerated)"
            ).fetchall()
        finally:
            db.close()
    except sqlite3.Error as error:
        raise CostError(f"--history {path}: not a readable history database: {error}") from None
    first, last = _time(span[0]), _time(span[1])
    if first is None or last is None:
        raise CostError(f"--history {path}: the history is empty")
    scale, played = _time_scale(path, args)
    last = first + (last - first) * scale
    rows = stretched(rows, origin=first, scale=scale)
    period_days = args.period_days or (last - first).total_seconds() / 86400
    if period_days * 24 < 1:
        raise CostError(
            f"--history {path}: it covers {period_days * 24 * 60:.0f} minutes{played}, too little to scale to a "
            "month; give the period it stands for with --period-days"
        )
    vms = args.vms or len(names)
    if vms < len(names):
        raise CostError(f"--vms {vms}: the history names {len(names)} VMs")
    windows = scheduled_windows(rows, period_end=last)
    per_vm: dict[str, list[Window]] = defaultdict(list)
    for (vm, _), window in windows.items():
        per_vm[vm].append(window)
    grace = timedelta(seconds=args.grace_seconds)
    hours = sum(merged_hours(w, grace=grace, round_up=args.round_up_hours) for w in per_vm.values())
    per_vm_month = HOURS_PER_MONTH / (period_days * 24) / vms
    return _report(
        source="history",
        on_demand_hours=hours * per_vm_month,
        vms=vms,
        period_days=period_days,
        events=len(windows) * per_vm_month,
        args=args,
        time_scale=scale,
    )


def _time_scale(path: Path, args: argparse.Namespace) -> tuple[float, str]:
    """The history's time scale (--time-scale, else the local run's record beside it, else real time) and, for a
    played one, how to say so."""
    try:
        run: LocalRun | None = read_local_run(path)
    except HistoryInputError as error:
        raise CostError(f"--history {path}: {error}") from None
    if args.time_scale is not None:
        return float(args.time_scale), f" of Azure time (--time-scale {args.time_scale:g})"
    if run is not None:
        where = f"a local run of {run.scenario!r} at time scale {run.timeScale:g}, {local_run_path(path).name}"
        return run.timeScale, f" of Azure time ({where})"
    return 1.0, ""


def _positive(name: str, *, allow_zero: bool = False) -> type[float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
        return value

    parse.__name__ = name
    return parse  # type: ignore[return-value]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command.prog("ops.cost"), description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--history", type=Path, help=f"the local history (SQLite), e.g. {DEFAULT_SQLITE_PATH}")
    source.add_argument(
        "--events-per-vm-month", type=_positive("--events-per-vm-month", allow_zero=True), default=None,
        help=f"assumed event rate (default {EVENTS_PER_VM_MONTH:g}; used when --history is not given)",
    )  # fmt: skip
    parser.add_argument(
        "--scheduled-minutes",
        type=_positive("--scheduled-minutes", allow_zero=True),
        default=None,
        help=f"assumed minutes an event stays Scheduled (default {SCHEDULED_MINUTES:g}, the longest minimum notice)",
    )
    parser.add_argument(
        "--price",
        type=_positive("--price"),
        default=PRICE_USD_PER_LISTENER_HOUR,
        help="USD per listener-hour (default %(default)s: East US, November 2026; it varies by region)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=_positive("--grace-seconds", allow_zero=True),
        default=GRACE_SECONDS,
        help="the forwarder's relay_listener_grace_seconds (default %(default)s)",
    )
    parser.add_argument("--vms", type=int, default=None, help="fleet size (default: the VMs the history names)")
    parser.add_argument("--period-days", type=_positive("--period-days"), default=None,
                        help="the period the history stands for (default: its first to its last row)")  # fmt: skip
    parser.add_argument("--round-up-hours", action="store_true", help="bill each connection as whole hours")
    parser.add_argument(
        "--time-scale",
        type=_positive("--time-scale"),
        default=None,
        help="Azure seconds per second of the history's clock (default: the local run's record beside the history, "
        f"{LOCAL_RUN_FILE}, else 1: real time)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.vms is not None and args.vms < 1:
        parser.error(f"--vms must be >= 1, got {args.vms}")
    if args.history is not None and args.scheduled_minutes is not None:
        parser.error("--scheduled-minutes is an assumed rate; with --history the history says how long")
    if args.history is None and args.time_scale is not None:
        parser.error("--time-scale is the history's; it needs --history")
    try:
        if args.history is not None:
            report = from_history(args.history, args)
        else:
            if args.events_per_vm_month is None:
                args.events_per_vm_month = EVENTS_PER_VM_MONTH
            if args.scheduled_minutes is None:
                args.scheduled_minutes = SCHEDULED_MINUTES
            report = from_rates(args)
    except CostError as error:
        print(f"ops.cost: {error}", file=sys.stderr)
        return 2
    print(report.model_dump_json(indent=2))
    return 0


def cli() -> NoReturn:
    """The console command ``sefleet-cost``."""
    command.run(main)


if __name__ == "__main__":
    cli()
