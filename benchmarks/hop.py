"""The coordinator's hop in the whole local stack as shipped: from an Event Hubs batch reaching the coordinator to
its approval leaving, beside one conditional (If-Match) write on the same Azurite table in the same run.

    .venv/bin/python -m benchmarks.hop [--n 300] [--vms 10] [--spacing 0.2 0.4]

What runs is ``local.stack.LocalStack``, as ``python -m local`` runs it: one ``python -m forwarder run`` process per
VM polling the IMDS emulator once a second and sending attested envelopes (IMDS's attested document of its VM, for
its forwarder state, plus its hook report) through the Event Hubs emulator's REST API; the local function host
consuming them (``EventHubConsumerClient``, checkpoints in Azurite, a thread per partition) and calling
``function_app.ingest_envelopes``; the coordinator wired from its settings by ``coordinator.wiring`` as the stack
configures it (state in Azurite, attestation required and each envelope's attested document verified against the
IMDS emulator's root, approvals through ``RelayApprovalSender`` to the Relay emulator and the forwarders' own
listeners, connected on demand, the delivery queue in Azurite, history in SQLite, cards in a folder, the census from
the IMDS emulator's ARM face) and tracing as ``python -m local`` configures it (``local.telemetry.Collector``: the
OpenTelemetry SDK, every span recorded in memory). The policy approves every event at once. Events (Freezes of one
VM each, round-robin over ``--vms`` VMs, each in its own placement group) are created ``--spacing`` seconds apart, at
random moments of the forwarders' 1 s polls; a started event leaves its document 6 s later, so a VM's document lists
its new event beside one or two others (``events_listed_p50``).

The hop of an event: from the call of ``ingest_envelopes`` with the first batch that lists it Scheduled (noted by a
wrapper around the trigger function: the moment the batch reaches the coordinator) to the start of the Relay
sender's call for its approval (noted by a wrapper around the sender's ``send``/``send_within``, which then calls
the real one: the moment the approval leaves). It holds what the coordinator does for that batch before the approval
leaves: reading the envelopes (often two or more: a detection's incarnation and its hook report arrive together,
``multi_envelope_batches``), verifying their attested documents, folding them into the event's record and the VM's
position, deciding, the deciding ETag-checked write, its spans, handing the request to the approval pool and the
pool starting it. The listener's answer, the VM positions written after the send and the batch's tail are not in
it. The Event Hubs, IMDS and Relay emulators run in the coordinator's process (as in ``python -m local``), and the
forwarders and Azurite on the same two cores: ``hop_cpu_ms_p50``, the batch thread's own CPU time over the hop,
says how much of the hop is the coordinator's work and how much is waiting (Azurite, the GIL, the pool).

The conditional write: before each event is created, once no batch is being processed, an If-Match update of a
small entity whose ETag is known (what the deciding write is) on the coordinator's own table, through the
coordinator's own ``TableClient``; timed in the same process, under the same load (forwarders, consumer, emulators).

``hop_over_conditional_write`` = hop_ms_p50 ÷ conditional_write_ms_p50: how many conditional writes' worth of time
the coordinator takes from a batch's arrival to its approval leaving, on events that went through the whole stack as
shipped, both measured in the same run on the same table (target ≤ 2.5: coordinator_hop_over_conditional_write in
python -m benchmarks).

Prints one JSON object: hop_ms_p50/p99, conditional_write_ms_p50/p99, hop_over_conditional_write,
hop_table_requests (median Table requests the batch's own thread made before its approval left), hop_cpu_ms_p50,
events_listed_p50, n, samples, vms, multi_envelope_batches, and ``problems`` (exit 1 when not empty): fewer hops than
asked, events not approved in IMDS (or twice, or by another VM), decisions not "approve" by the policy's rule,
envelopes dead-lettered, failed batches or ticks, an approval not sent by the run of the batch that brought its event
or sent to another VM, attestation not required or the callback not the Relay sender, approvals without a trace.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import azure.functions as func
from azure.core import MatchConditions
from azure.data.tables import TableClient, UpdateMode

from benchmarks.approval_latency import percentile
from benchmarks.checks import (
    approvals_problems,
    batch_reports,
    finish,
    history_rows,
    scratch,
    some,
    stack_problems,
    too_few,
)
from benchmarks.stack_runs import RULE, stack_options, utc, wait_warm
from coordinator import RelayApprovalSender, TableStateStore
from emulators.imds import Scenario, VmSpec
from local.runner import IngestFunction, wait_until
from local.stack import LocalStack
from local.stack_options import StackOptions
from local.telemetry import Collector

# Real seconds the last events' approvals are waited for once every event was created.
APPROVALS_WAIT = 20.0
PROBE = {"PartitionKey": "benchmark-probe", "RowKey": "conditional-write"}
# The table operations a hop's batch makes, counted per calling thread (a batch runs on its partition's thread).
TABLE_CALLS = frozenset(
    {"create_entity", "update_entity", "upsert_entity", "delete_entity", "get_entity", "submit_transaction",
     "query_entities", "list_entities"}
)  # fmt: skip


@dataclass
class Batch:
    arrived: float  # perf_counter
    returned: float
    arrived_at: datetime  # wall clock, as the history's rows are dated
    returned_at: datetime
    envelopes: int
    thread: int
    listed: dict[str, int]  # EventId listed Scheduled -> how many events its envelope's document listed
    cpu_arrived: float  # the batch thread's CPU seconds at its arrival, and at its return
    cpu_returned: float
    retried: bool = False  # the host called the function again with it (an attempt raised)


@dataclass
class Send:
    at: float
    vm: str
    sender: str
    cpu: dict[int, float]  # the CPU seconds of each batch thread in flight when the send started


class ThreadCountingTable:
    """The coordinator's ``TableClient``, noting when each thread starts a request (for hop_table_requests)."""

    def __init__(self, table: TableClient, calls: dict[int, list[float]]) -> None:
        self._table = table
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._table, name)
        if name not in TABLE_CALLS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls.setdefault(threading.get_ident(), []).append(time.perf_counter())
            return attribute(*args, **kwargs)

        return counted


@dataclass
class HopClock:
    """Wraps the trigger function and, at its first call, the coordinator's approval callback and Table client."""

    batches: dict[str, Batch] = field(default_factory=dict)  # EventId -> the first batch listing it Scheduled
    sends: dict[str, Send] = field(default_factory=dict)  # EventId -> the first send of its approval
    attempts: dict[tuple[Any, ...], Batch] = field(default_factory=dict)  # each batch, by its events
    table_calls: dict[int, list[float]] = field(default_factory=dict)
    in_flight: dict[int, int] = field(default_factory=dict)  # batch thread -> its CPU clock's id
    coordinator: Any = None
    table: TableClient | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, ingest: IngestFunction) -> IngestFunction:
        def timed(events: list[func.EventHubEvent]) -> None:
            self._instrument()
            thread = threading.get_ident()
            cpu = time.pthread_getcpuclockid(thread)
            with self.lock:
                self.in_flight[thread] = cpu
            arrived_at, arrived, cpu_arrived = datetime.now(UTC), time.perf_counter(), time.clock_gettime(cpu)
            try:
                ingest(events)
            finally:
                returned, returned_at, cpu_returned = time.perf_counter(), datetime.now(UTC), time.clock_gettime(cpu)
                with self.lock:
                    self.in_flight.pop(thread, None)
                    self._record(events, Batch(arrived, returned, arrived_at, returned_at, len(events), thread, {},
                                               cpu_arrived, cpu_returned))  # fmt: skip

        return timed

    def _record(self, events: list[func.EventHubEvent], attempt: Batch) -> None:
        """A batch's invocation; the host's retry of a batch that raised is the same batch (its events' partition
        and sequence numbers), arrived at its first attempt and returned at its last."""
        key = tuple((event.partition_key, event.sequence_number) for event in events)
        first = self.attempts.get(key)
        if first is not None:
            first.returned, first.returned_at, first.cpu_returned = (
                attempt.returned, attempt.returned_at, attempt.cpu_returned
            )  # fmt: skip
            first.retried = True
            return
        attempt.listed = {event_id: count for event in events for event_id, count in _scheduled(event.get_body())}
        self.attempts[key] = attempt
        for event_id in attempt.listed:
            self.batches.setdefault(event_id, attempt)

    def idle(self) -> bool:
        with self.lock:
            return not self.in_flight

    def _instrument(self) -> None:
        """The coordinator is built at the first call of a trigger (function_app.coordinator, cached); its approval
        callback and its Table client are wrapped then, once."""
        with self.lock:
            if self.coordinator is not None:
                return
            import function_app

            coordinator = function_app.coordinator()
            callback = coordinator.parts.callback
            for name in ("send", "send_within"):
                if hasattr(callback, name):
                    setattr(callback, name, self._noting(getattr(callback, name), type(callback).__name__))
            store = coordinator.parts.store
            if not isinstance(store, TableStateStore):
                raise TypeError(f"the coordinator's state is {type(store).__name__}, not Table Storage")
            self.table = store._table
            store._table = ThreadCountingTable(store._table, self.table_calls)  # type: ignore[assignment]
            self.coordinator = coordinator

    def _noting(self, send: Callable[..., Any], sender: str) -> Callable[..., Any]:
        def noted(request: Any, *args: Any, **kwargs: Any) -> Any:
            at = time.perf_counter()
            vm = kwargs.get("vm")
            with self.lock:
                cpu = {thread: time.clock_gettime(clock) for thread, clock in self.in_flight.items()}
                self.sends.setdefault(request.eventId, Send(at, getattr(vm, "name", ""), sender, cpu))
            return send(request, *args, **kwargs)

        return noted

    def requests_before(self, batch: Batch, until: float) -> int:
        with self.lock:
            calls = list(self.table_calls.get(batch.thread, []))
        return sum(1 for at in calls if batch.arrived <= at <= until)


def _scheduled(body: bytes) -> Iterator[tuple[str, int]]:
    """The EventIds an envelope lists Scheduled, each with the number of events its document lists."""
    try:
        data = json.loads(body)
    except ValueError:
        return
    document = data.get("document") if isinstance(data, dict) else None
    events = document.get("Events", []) if isinstance(document, dict) else []
    for event in events:
        if isinstance(event, dict) and event.get("EventStatus") == "Scheduled":
            yield str(event.get("EventId")), len(events)


def conditional_write(table: TableClient, etag: str, value: int) -> tuple[float, str]:
    started = time.perf_counter()
    result = table.update_entity(
        {**PROBE, "Value": value}, mode=UpdateMode.REPLACE, etag=etag, match_condition=MatchConditions.IfNotModified
    )
    return (time.perf_counter() - started) * 1000, str(result["etag"])


@dataclass
class Recorded:
    """What one run recorded: the events created (EventId -> VM), the conditional writes, and what the stack kept."""

    created: dict[str, str] = field(default_factory=dict)
    writes: list[float] = field(default_factory=list)
    approvals: list[dict[str, Any]] = field(default_factory=list)
    sending_at: dict[str, datetime] = field(default_factory=dict)  # EventId -> its first 'sending' Approval row
    envelopes: dict[str, int] = field(default_factory=dict)  # received and accepted, by the coordinator's reports
    problems: list[str] = field(default_factory=list)


def run(
    *,
    n: int,
    vms: int = 10,
    spacing: tuple[float, float] = (0.2, 0.4),
    seed: int = 7,
    coordinator_env: dict[str, str] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """``coordinator_env`` and ``workdir`` are for the tests (e.g. a policy that never approves, a run's files kept)."""
    clock = HopClock()
    with scratch() as tmp:
        scenario = Scenario(name="hop", vms=[VmSpec(name=f"hop_{i}", placementGroupId=f"pg-{i}") for i in range(vms)])
        options = stack_options(
            Path(tmp),
            scenario,
            workdir=workdir or Path(tmp) / "local",
            # A started event leaves the documents 6 s after it starts (the stack's least), so that a VM's document
            # lists its new event beside a few others, not a dozen (events_listed_p50 says how many).
            started_min_seconds=360.0,
            timer_interval=60.0,  # once a minute, as deployed
            ingest_wrapper=clock.wrap,
            coordinator_env=coordinator_env or {},
        )
        recorded = measure(options, clock, n=n, spacing=spacing, seed=seed)
    return figures(clock, recorded, n=n, vms=vms)


def measure(options: StackOptions, clock: HopClock, *, n: int, spacing: tuple[float, float], seed: int) -> Recorded:
    rng = random.Random(seed)
    recorded = Recorded()
    collector = Collector.install()  # before the stack: the coordinator traces from its first batch on
    collector.begin()
    with batch_reports() as reports, LocalStack(options) as stack:
        assert stack.imds is not None
        assert stack.eventhubs is not None
        assert stack.host is not None
        imds = stack.imds
        names = [vm.name for vm in imds.vms()]
        wait_warm(lambda: reports.accepted() >= len(names) and clock.table is not None)
        table = clock.table
        assert table is not None
        etag = str(table.upsert_entity({**PROBE, "Value": -1})["etag"])
        for index in range(n):
            wait_until(clock.idle, timeout=2.0, interval=0.005)
            took, etag = conditional_write(table, etag, index)
            recorded.writes.append(took)
            # DurationInSeconds -1 (not announced): the local platform pauses a Freeze's VMs only for an announced
            # duration, and a paused forwarder would hold its envelopes; the hop is the coordinator's.
            name = names[index % len(names)]
            event = imds.create_event(EventType="Freeze", Resources=[name], DurationInSeconds=-1)
            recorded.created[str(event["EventId"])] = name
            time.sleep(rng.uniform(*spacing))

        def approved() -> bool:
            return set(recorded.created) <= {str(a["EventId"]) for a in imds.approvals()}

        wait_until(approved, timeout=APPROVALS_WAIT)
        stack.drain()
        report = collector.finish(stack.workdir)
        recorded.approvals = imds.approvals()
        history = stack.history_path
        for row in sorted(history_rows(history, "Approval"), key=lambda row: str(row["TimeGenerated"])):
            if row["Outcome"] == "sending":
                recorded.sending_at.setdefault(str(row["EventId"]), utc(str(row["TimeGenerated"])))
        problems = recorded.problems
        problems += stack_problems(stack, recorded.created, rule=RULE)
        problems += wiring_problems()
        problems += reports.problems()
        recorded.envelopes = reports.figures()
        traced = {str(item["eventId"]) for item in report.traces}
        untraced = [e for e in recorded.created if e in clock.sends and e not in traced]
        if untraced:
            problems.append(f"{len(untraced)} approvals without a coordinator.approval trace: {some(untraced)}")
        problems += [f"telemetry: {problem}" for problem in report.problems[:5]]
    return recorded


def figures(clock: HopClock, recorded: Recorded, *, n: int, vms: int) -> dict[str, Any]:
    """Each created event's hop, and what keeps one from being a hop of the batch that brought the event."""
    hops: list[float] = []
    cpu: list[float] = []  # of the batch's thread, from its arrival to the send (or its return, if that came first)
    requests: list[int] = []
    multi, retried, listed = 0, 0, []
    not_measured: list[str] = []
    elsewhere: list[str] = []
    wrong_vm: list[str] = []
    for event_id, vm in recorded.created.items():
        batch, send = clock.batches.get(event_id), clock.sends.get(event_id)
        if batch is None or send is None:
            not_measured.append(event_id)
            continue
        if send.vm != vm:
            wrong_vm.append(f"{event_id} sent to {send.vm}, not {vm}")
        sending = recorded.sending_at.get(event_id)
        # The run that sent it started while the batch was being processed: the batch's own run (its `now`).
        if sending is None or not batch.arrived_at <= sending <= batch.returned_at or send.at < batch.arrived:
            elsewhere.append(event_id)
            continue
        hops.append((send.at - batch.arrived) * 1000)
        cpu.append((send.cpu.get(batch.thread, batch.cpu_returned) - batch.cpu_arrived) * 1000)
        requests.append(clock.requests_before(batch, send.at))
        multi += batch.envelopes > 1
        retried += batch.retried
        listed.append(batch.listed.get(event_id, 0))
    problems = recorded.problems
    if not_measured:
        problems.append(f"{len(not_measured)} events not listed by a batch or not sent: {some(not_measured)}")
    if elsewhere:
        problems.append(
            f"{len(elsewhere)} approvals not sent by the run of the batch that brought their event: {some(elsewhere)}"
        )
    if wrong_vm:
        problems.append(f"{len(wrong_vm)} approvals sent to another VM than the event's: {some(wrong_vm)}")
    problems += too_few("hops", len(hops), n)
    problems += approvals_problems(recorded.approvals, {e: [vm] for e, vm in recorded.created.items()})
    senders = {send.sender for send in clock.sends.values()}
    if senders != {RelayApprovalSender.__name__}:
        problems.append(f"approvals sent through {sorted(senders)}, not only the Relay sender")
    result: dict[str, Any] = {
        "n": n,
        "samples": len(hops),
        "vms": vms,
        "multi_envelope_batches": multi,
        "retried_batches": retried,
        **recorded.envelopes,
    }
    if hops and recorded.writes:
        hop_p50, write_p50 = percentile(hops, 0.5), percentile(recorded.writes, 0.5)
        result |= {
            "hop_ms_p50": round(hop_p50, 2),
            "hop_ms_p99": round(percentile(hops, 0.99), 2),
            "conditional_write_ms_p50": round(write_p50, 2),
            "conditional_write_ms_p99": round(percentile(recorded.writes, 0.99), 2),
            "hop_over_conditional_write": round(hop_p50 / write_p50, 2),
            "hop_table_requests": statistics.median(requests),
            "hop_cpu_ms_p50": round(percentile(cpu, 0.5), 2),
            "events_listed_p50": statistics.median(listed),
        }
    return result | {"problems": problems}


def wiring_problems() -> list[str]:
    """What keeps the coordinator from being the one shipped: attestation not required and verified, another
    callback than the Relay sender."""
    import function_app

    coordinator = function_app.coordinator()
    problems = []
    if not coordinator.options.require_attestation or coordinator.parts.attestations is None:
        problems.append("the coordinator does not require and verify attested envelopes")
    if not isinstance(coordinator.parts.callback, RelayApprovalSender):
        problems.append(
            f"the coordinator's callback is {type(coordinator.parts.callback).__name__}, not the Relay sender"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hop", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="hops to time (default 300)")
    parser.add_argument("--vms", type=int, default=10, help="simulated VMs, one forwarder process each (default 10)")
    parser.add_argument("--spacing", type=float, nargs=2, default=(0.2, 0.4), help="seconds between events (min max)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    return finish(lambda: run(n=args.n, vms=args.vms, spacing=(args.spacing[0], args.spacing[1]), seed=args.seed))


if __name__ == "__main__":
    raise SystemExit(main())
