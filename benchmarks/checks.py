"""What every benchmark's JSON carries to say whether its run is what it claims to measure.

Each benchmark collects ``problems`` (strings, each naming what is wrong with the run: approvals not made or not
the expected ones, decisions not the expected ones, envelopes refused, fewer samples than asked, a listener not in
the mode the benchmark claims) from what the run itself recorded (the IMDS emulator's StartRequests, the Relay
emulator's counters, the coordinator's history rows and dead letters, the function host's counts), and ends with
``emit``: the JSON always has ``problems`` and the process exits 1 when it is not empty, so that a run that is not
what it claims to measure fails, naming why (python -m benchmarks then lists it under ``errors``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import sys
import tempfile
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator import history_schema

if TYPE_CHECKING:
    from local.stack import LocalStack

TABLE = str(history_schema()["table"])

# At most this many problems of one kind are named one by one; the rest are counted.
NAMED = 5
# Where a run keeps its files (python -m benchmarks sets it per run, and deletes the folder when the run was valid).
KEEP = "BENCHMARKS_KEEP"


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A run's work folder: a temporary one, or ``$BENCHMARKS_KEEP`` when set, so that what an invalid run leaves
    (the stack's logs, its history, the forwarders' state) can be read after it: a run that fails once in hundreds
    of events is diagnosed from its own files, not rerun until it passes."""
    keep = os.environ.get(KEEP)
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def emit(result: dict[str, Any], problems: list[str]) -> int:
    """Prints the result with its ``problems`` as one JSON line; the exit code: 1 when there are problems."""
    result["problems"] = problems
    print(json.dumps(result))
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


def some(items: Iterable[str]) -> str:
    """The first few of ``items``, and how many more."""
    listed = sorted(items)
    shown = ", ".join(listed[:NAMED])
    return shown + (f" and {len(listed) - NAMED} more" if len(listed) > NAMED else "")


def too_few(what: str, got: int, asked: int) -> list[str]:
    return [f"{got} {what} measured, {asked} asked"] if got < asked else []


def approvals_problems(
    approvals: list[dict[str, Any]], expected: Mapping[str, Iterable[str]], *, unexpected_ok: bool = False
) -> list[str]:
    """What the IMDS emulator's recorded StartRequests (``ImdsEmulator.approvals()``) say against ``expected``
    (EventId -> the VMs that may have approved it): an expected event not approved, approved twice, approved by
    another VM or not through IMDS, and (unless ``unexpected_ok``) approvals of events not expected at all."""
    problems: list[str] = []
    by_event: dict[str, list[dict[str, Any]]] = {}
    for item in approvals:
        by_event.setdefault(str(item["EventId"]), []).append(item)
    missing = [event_id for event_id in expected if event_id not in by_event]
    if missing:
        problems.append(f"{len(missing)} of {len(expected)} events not approved in IMDS: {some(missing)}")
    twice = [event_id for event_id in expected if len(by_event.get(event_id, [])) > 1]
    if twice:
        problems.append(f"{len(twice)} events approved more than once in IMDS: {some(twice)}")
    wrong = [
        f"{event_id} by {item['vm']} via {item.get('via', 'imds')}"
        for event_id, vms in expected.items()
        for item in by_event.get(event_id, [])
        if item["vm"] not in set(vms) or item.get("via", "imds") != "imds"
    ]
    if wrong:
        problems.append(f"{len(wrong)} approvals not by the event's own VM through IMDS: {some(wrong)}")
    if not unexpected_ok:
        extra = [event_id for event_id in by_event if event_id not in expected]
        if extra:
            problems.append(f"{len(extra)} approvals of events the benchmark did not create: {some(extra)}")
    return problems


def history_rows(path: Path, record_type: str) -> list[dict[str, Any]]:
    """The rows of one RecordType in a local run's SQLite history."""
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        rows = db.execute(f'SELECT * FROM "{TABLE}" WHERE RecordType = ?', (record_type,)).fetchall()
    finally:
        db.close()
    return [dict(row) for row in rows]


def decisions_problems(history: Path, expected: Iterable[str], *, rule: str, action: str = "approve") -> list[str]:
    """The coordinator's Decision rows for ``expected`` events: each decided exactly once, by ``rule``, ``action``."""
    rows = [row for row in history_rows(history, "Decision") if not row.get("DryRun")]
    by_event: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_event.setdefault(str(row["EventId"]), []).append(row)
    wanted = list(expected)
    problems: list[str] = []
    missing = [event_id for event_id in wanted if event_id not in by_event]
    if missing:
        problems.append(f"{len(missing)} of {len(wanted)} events have no Decision row: {some(missing)}")
    other = [
        f"{event_id}: {row['Outcome']} by rule {row['Rule']!r}"
        for event_id in wanted
        for row in by_event.get(event_id, [])
        if row["Outcome"] != action or row["Rule"] != rule
    ]
    if other:
        problems.append(f"{len(other)} decisions not {action!r} by rule {rule!r}: {some(other)}")
    twice = [event_id for event_id in wanted if len(by_event.get(event_id, [])) > 1]
    if twice:
        problems.append(f"{len(twice)} events decided more than once: {some(twice)}")
    return problems


def dead_letter_problems(history: Path) -> list[str]:
    """Envelopes the coordinator refused at the door (its DeadLetter rows)."""
    rows = history_rows(history, "DeadLetter")
    if not rows:
        return []
    reasons = Counter(str(row.get("Reason") or "")[:120] for row in rows)
    return [f"{len(rows)} envelopes dead-lettered by the coordinator: {some(f'{n}x {r}' for r, n in reasons.items())}"]


def stack_problems(stack: LocalStack, decided: Iterable[str], *, rule: str) -> list[str]:
    """A whole local stack's run, once its batches' tails are done (``stack.drain()``): the ``decided`` events'
    Decision rows (approve, by ``rule``), the envelopes the coordinator dead-lettered, the function host's failed
    batches (given up after its retries) and ticks."""
    problems = decisions_problems(stack.history_path, decided, rule=rule)
    problems += dead_letter_problems(stack.history_path)
    if stack.host is not None:
        # A batch the host retried and the function then took is the shipped path (the host's retry policy); one it
        # gave up on, or a tick that failed, is not.
        stats = stack.host.stats
        if stats.failed_batches or stats.failed_ticks:
            problems.append(
                f"{stats.failed_batches} batches and {stats.failed_ticks} ticks failed; errors: {stats.errors[-3:]}"
            )
        if problems and stats.stalls:  # what may explain them: late batches, slow calls, partitions lost
            problems.append(f"the function host noted (the last {len(stats.stalls[-10:])}): {stats.stalls[-10:]}")
    return problems


def on_demand_problems(stack: LocalStack) -> list[str]:
    """Listeners connected while no event is listed: the stack's forwarders' listeners are not on demand."""
    if stack.relay is None or stack.imds is None:
        return ["the stack runs without the Relay: no listener at all"]
    relay = stack.relay
    connected = [vm.name for vm in stack.imds.vms() if relay.listener_count(f"vm-{vm.vmId.lower()}")]
    return [f"listeners connected before any event (not on demand): {some(connected)}"] if connected else []


class BatchReports(logging.Handler):
    """The coordinator's report of each Event Hubs batch, as function_app logs it ("batch {counts}"), summed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.totals: Counter[str] = Counter()
        self.batches = 0
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg != "batch %s" or not record.args:
            return
        try:
            counts = json.loads(str(record.args[0] if isinstance(record.args, tuple) else record.args))
        except ValueError:
            return
        with self._lock:
            self.batches += 1
            self.totals.update({k: v for k, v in counts.items() if isinstance(v, int)})

    def problems(self) -> list[str]:
        """Envelopes the coordinator's reports say it dead-lettered, and state entities it set aside."""
        totals = self.totals
        problems = []
        if not self.batches:
            problems.append("the coordinator reported no batch")
        if totals["dead_lettered"]:
            problems.append(
                f"the coordinator's reports: {totals['dead_lettered']} of {totals['received']} envelopes dead-lettered"
            )
        if totals["set_aside"]:
            problems.append(f"the coordinator's reports: {totals['set_aside']} state entities set aside")
        return problems

    def accepted(self) -> int:
        with self._lock:
            return self.totals["accepted"]

    def figures(self) -> dict[str, int]:
        return {"envelopes_received": self.totals["received"], "envelopes_accepted": self.totals["accepted"]}


@contextlib.contextmanager
def batch_reports() -> Iterator[BatchReports]:
    """Collects the coordinator's batch reports (function_app's log at INFO, kept from the console meanwhile)."""
    logger = logging.getLogger("function_app")
    reports = BatchReports()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(reports)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield reports
    finally:
        logger.removeHandler(reports)
        logger.setLevel(level)
        logger.propagate = propagate


def finish(run: Callable[[], dict[str, Any]]) -> int:
    """Runs a benchmark and ends it as ``emit`` does; one that raises still prints its JSON, the error its problem."""
    try:
        result = run()
    except Exception as error:
        traceback.print_exc()
        result = {"problems": [f"the run did not complete: {type(error).__name__}: {error}"]}
    return emit(result, list(result.pop("problems", ["the run said nothing of its validity"])))
