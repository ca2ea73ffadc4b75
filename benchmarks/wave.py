"""A maintenance wave through the coordinator's Event Hubs entry point, with state in Azurite, the product as shipped.

10,000 VMs in placement groups of 20 each report one Scheduled event (500 distinct events): every VM of a group
sees its group's event within about a second of the others, groups start 50 ms apart, and the envelopes are spread
over Event Hubs partitions by VM resource id (the forwarder's partition key), then cut into batches of 200
(host.json maxEventBatchSize) per partition and fed to ``function_app.ingest_envelopes`` as ``func.EventHubEvent``
lists. The events are Reboot/Redeploy/long Freeze, which the default policy leaves to a person: the figure covers
state, rules, history (SQLite) and alerts (cards folder), not approvals (benchmarks/approval_latency.py does those).

The coordinator runs as infra/modules/functionapp.bicep deploys it: attested envelopes required, ARM's census
configured (benchmarks/wave_fleet.py). The VMs are an IMDS emulator scenario; each envelope says of its VM what the
emulator's instance metadata says (what its forwarder reads) and carries the emulator's attested document of that
VM for its forwarder state; the census is the emulator's ARM face listing the same VMs. ``--bindings warm`` (default):
every VM is bound (its resource id to its vmId, in the state table) and known to this coordinator instance, and sent
one attested heartbeat through it before the clock starts, the steady state. The bindings are written in bulk first
(``--warm-up table``, wave_fleet.seed_bindings; ``heartbeats``: the heartbeats bind them one by one, four Table round
trips a VM; ``memory``: the instance knows them, the table does not have them, what ``auto``, the default, does above
20,000 VMs, whose bindings Azurite cannot take in reasonable time: all are in one partition, which it scans per
write). A warm wave must read no binding from the table (``binding_table_ops`` 0). ``cold``: no VM was ever bound,
each VM's first envelope binds it during the wave.
Signing, building, the census' first read and the warm-up are outside the timed part (``prep_seconds``, ``prep``).
``wave_seconds`` runs until the last batch returned and every batch's tail ended (``batches_returned_seconds``: the
batches alone).

``--policy census`` decides the same wave with a policy that needs the census (a tag rule, a percent budget per
scale set, zone and update domain that no event of the wave matches): the same writes, plus what knowing every VM
costs. ``--event-type Terminate`` makes every group's event a scale-in delete of 5 of its VMs (the default policy
waits for their prepare hooks): delete coupling looks at the open deletes. ``--replay`` records the coordinator's
Table writes and sends them again, raw, to a fresh table: the floor the wave is compared with. ``--storm``: no
envelope attested, every one must be a dead letter, spread over the dead-letter table's partitions (counted apart).

    .venv/bin/python -m benchmarks.wave [--mode processes|threads|serial] [--vms 10000] [--partitions 4]
        [--policy default|census] [--event-type mixed|Terminate] [--bindings warm|cold]
        [--warm-up auto|table|memory|heartbeats] [--replay] [--storm] [--profile FILE]

Prints one JSON object: {wave_envelopes, wave_seconds, envelopes_per_second, busiest_partition_ops_per_s, ...,
problems} (the Table operations are counted per partition per second in serial and threads modes). ``problems``
names everything the wave left otherwise than its policy must (envelopes not accepted, dead letters, events missing,
other decisions or states, census mismatches, bindings missing); the exit code is 1 when there is any.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any

import azure.functions as func
from azure.data.tables import TableServiceClient

from benchmarks.table_ops import CountingTable, Ops, replay
from benchmarks.wave_checks import Outcome, left_behind, problems
from benchmarks.wave_fleet import (
    START,
    Message,
    Prepared,
    batches,
    coordinator_settings,
    fleet_scenario,
    prepare,
    seed_bindings,
)
from coordinator import CLAIM_PARTITION, TransactionTableClient
from emulators.azurite import Azurite
from emulators.imds import ImdsEmulator
from local.coordinator_setup import AppSettings

# Up to this many VMs, a warm wave's bindings are written to the table before it (--warm-up auto): 40,000 rows in the
# one partition Azurite scans per write took 190 s, 100,000 would take about 20 minutes, 200,000 over an hour.
TABLE_WARM_UP_VMS = 20_000
# The coordinator's clock: the warm-up (and the census' first read) just before the wave, the wave 30 s in.
WARM_UP_AT = START - timedelta(seconds=30)
WAVE_AT = START + timedelta(seconds=30)


def _coordinator(env: dict[str, str], imds_url: str, reports: list[Any], environment: AppSettings) -> Any:
    """``function_app`` with a coordinator built afresh from ``env`` (approvals straight into the IMDS emulator);
    every batch's report is kept in ``reports`` (its tail adds to it after the batch returns)."""
    environment.apply(env)
    import function_app
    from local.direct_callback import direct_coordinator

    function_app.settings.cache_clear()
    function_app.coordinator = direct_coordinator(function_app.settings, imds_url)
    coordinator = function_app.coordinator()
    coordinator.parts = replace(coordinator.parts, clock=lambda: WARM_UP_AT)
    original = coordinator.process_batch

    def kept(messages: Any, **channel: Any) -> Any:
        report = original(messages, **channel)
        reports.append(report)
        return report

    coordinator.process_batch = kept  # type: ignore[method-assign]
    return function_app


def _read_census(function_app: Any) -> float:
    """The instance's first read of ARM's census (the emulator's ARM face), before the clock; its seconds."""
    started = time.perf_counter()
    census = function_app.coordinator().parts.census
    if census is not None and not census.refresh(WARM_UP_AT, why="the wave's instance starts"):
        raise RuntimeError(f"the census could not be read from the IMDS emulator's ARM face: {census.error}")
    return time.perf_counter() - started


def _totals(reports: list[Any]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for report in reports:
        totals.update(report.as_dict())
    return totals


def _feed(function_app: Any, partitions: list[list[list[func.EventHubEvent]]], *, threads: bool) -> None:
    """Each partition's batches in order: one partition after another, or side by side on threads (as the host
    runs an instance's partitions)."""

    def drain(partition: list[list[func.EventHubEvent]]) -> None:
        for events in partition:
            function_app.ingest_envelopes(events)

    if not threads:
        for partition in partitions:
            drain(partition)
        return
    with ThreadPoolExecutor(max_workers=max(1, len(partitions))) as pool:
        for future in [pool.submit(drain, p) for p in partitions]:
            future.result()


def _warm_up(
    function_app: Any,
    partitions: list[list[Message]],
    args: argparse.Namespace,
    reports: list[Any],
    timings: dict[str, float],
) -> Counter[str]:
    """Every VM's attested heartbeat through this instance, its partitions side by side, their tails ended; their
    reports taken out of ``reports``. First, unless ``--warm-up heartbeats`` (they bind the VMs themselves), every
    VM's binding remembered by the instance, and written to the table in bulk with ``--warm-up table``."""
    if not any(partitions):
        return Counter()
    started = time.perf_counter()
    if args.warm_up != "heartbeats":
        identities = (json.loads(m[0])["vm"] for p in partitions for m in p)
        seed_bindings(function_app.coordinator(), identities, table=args.warm_up == "table")
        timings["seed_bindings_seconds"] = time.perf_counter() - started
    _feed(function_app, [batches(p, args.batch) for p in partitions], threads=True)
    function_app.coordinator().drain(600)
    counts = _totals(reports)
    reports.clear()
    return counts


def _instance(
    args: argparse.Namespace, mine: list[Message], warm: list[Message], *, env: dict[str, str], imds_url: str,
    ready: Any, go: Any, out: Any,
) -> None:  # fmt: skip
    """One Functions instance owning one partition, in its own process (how the host scales out)."""
    reports: list[Any] = []
    function_app = _coordinator(env, imds_url, reports, AppSettings())
    _read_census(function_app)
    warmed = _warm_up(function_app, [warm], args, reports, {})
    work = batches(mine, args.batch)
    coordinator = function_app.coordinator()
    coordinator.parts = replace(coordinator.parts, clock=lambda: WAVE_AT)
    ready.release()
    go.wait()
    _feed(function_app, [work], threads=False)
    drained = function_app.coordinator().drain(600)
    out.put((time.time(), dict(_totals(reports)), dict(warmed), drained))


def _tick(function_app: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """The timer's next run: it settles the cards the batches logged as sent (the outbox), re-evaluates every
    open event and checks heartbeats. That is work the batches leave for later, so it is measured too; then the
    tick after it (the instance's fleet cache is warm: it reads what changed). Also the two ticks' counts."""
    coordinator = function_app.coordinator()
    coordinator.parts = replace(coordinator.parts, clock=lambda: START + timedelta(seconds=90))
    started = time.perf_counter()
    report = coordinator.tick()
    seconds = time.perf_counter() - started
    # The next minute's tick: what changed since the last one (nothing here), the steady state.
    coordinator.parts = replace(coordinator.parts, clock=lambda: START + timedelta(seconds=150))
    again = time.perf_counter()
    second = coordinator.tick()
    again_seconds = time.perf_counter() - again
    counts = Counter(report.as_dict())
    counts.update(second.as_dict())
    return {
        "tick_seconds": round(seconds, 3),
        "tick_again_seconds": round(again_seconds, 3),
        "tick_events_changed": report.events_changed,
        "tick_alerts_sent": report.alerts_sent,
        "cards_pending_after_tick": sum(1 for s in coordinator.parts.store.open_events() if s.record.pendingAlerts),
    }, dict(counts)


def _processes(
    args: argparse.Namespace, prepared: Prepared, *, connection: str, imds_url: str, tmp: str, started: float
) -> Outcome:
    """One instance per partition, each in its own process (its census read and its warm-up before the clock),
    started together; the seconds until the last ends."""
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Semaphore(0), context.Event(), context.Queue()
    workers = [
        context.Process(
            target=_instance,
            args=(args, prepared.work[p], prepared.warm[p]),
            kwargs={
                "env": coordinator_settings(connection, tmp, f"history-{p}.sqlite", args.policy) | prepared.env,
                "imds_url": imds_url,
                "ready": ready,
                "go": go,
                "out": out,
            },
        )
        for p in range(args.partitions)
    ]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.acquire()
    prepared.timings["prep_seconds"] = time.perf_counter() - started
    started_wall = time.time()
    go.set()
    outcome = Outcome(0.0, 0.0, True, [f"history-{p}.sqlite" for p in range(args.partitions)])
    ends = []
    for _ in workers:
        end, counts, warmed, drained = out.get(timeout=3600)
        ends.append(end)
        outcome.totals.update(counts)
        outcome.warmed.update(warmed)
        outcome.drained = outcome.drained and drained
    for worker in workers:
        worker.join()
    outcome.seconds = max(ends) - started_wall
    return outcome


def _in_process(
    args: argparse.Namespace,
    prepared: Prepared,
    function_app: Any,
    reports: list[Any],
    *,
    ops: Ops,
    dead_ops: Ops,
    started: float,
) -> Outcome:
    """Serial or threads: the warm-up, then the timed wave through this process's instance (whose batches' reports
    go to ``reports``), its tails ended."""
    coordinator = function_app.coordinator()
    prepared.timings["census_read_seconds"] = _read_census(function_app)
    warm_started = time.perf_counter()
    warmed = _warm_up(function_app, prepared.warm, args, reports, prepared.timings)
    prepared.timings["warm_up_seconds"] = time.perf_counter() - warm_started  # the seeding included
    store = coordinator.parts.store
    store._table = CountingTable(store._table, ops)
    store._dead_letters = CountingTable(store._dead_letters, dead_ops)
    work = [batches(p, args.batch) for p in prepared.work]
    coordinator.parts = replace(coordinator.parts, clock=lambda: WAVE_AT)
    prepared.timings["prep_seconds"] = time.perf_counter() - started
    profile = cProfile.Profile() if args.profile else None
    wave_started, cpu_started = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    _feed(function_app, work, threads=args.mode == "threads")
    returned = time.perf_counter() - wave_started
    drained = coordinator.drain(600)
    seconds = time.perf_counter() - wave_started
    # The coordinator's own CPU (this process; Azurite is another): what the coordinator does per envelope, apart
    # from the emulator, whose operations cost more as its table grows.
    cpu = time.process_time() - cpu_started
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    outcome = Outcome(seconds, cpu, drained, ["history.sqlite"], _totals(reports), warmed)
    outcome.extra["batches_returned_seconds"] = round(returned, 3)
    return outcome


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wave")
    parser.add_argument("--vms", type=int, default=10_000)
    parser.add_argument("--group-size", type=int, default=20)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=200, help="envelopes per batch (host.json maxEventBatchSize)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--group-spacing-ms", type=float, default=50.0, help="time between placement groups")
    parser.add_argument(
        "--mode",
        choices=["processes", "threads", "serial"],
        default="serial",
        help="serial: one instance, one partition after another (default: this machine has 2 cores); processes: "
        "one instance per partition, as the host scales out; threads: one instance, partitions on its thread pool",
    )
    parser.add_argument("--policy", choices=["default", "census"], default="default")
    parser.add_argument("--event-type", choices=["mixed", "Terminate"], default="mixed")
    parser.add_argument(
        "--bindings",
        choices=["warm", "cold"],
        default="warm",
        help="warm: every VM sent an attested heartbeat through this instance before the clock starts (bound, "
        "known); cold: no VM was ever bound, each VM's first envelope binds it during the wave",
    )
    parser.add_argument(
        "--warm-up",
        choices=["auto", "table", "memory", "heartbeats"],
        default="auto",
        help="warm: how the VMs come to be bound before their heartbeats. table: the bindings written to the state "
        "table in bulk and remembered by the instance; memory: remembered only (Azurite scans the bindings' one "
        f"partition per write: 200,000 take over an hour); auto (default): table up to {TABLE_WARM_UP_VMS:,} VMs, "
        "memory above; heartbeats: the heartbeats bind them through the coordinator (four Table round trips a VM)",
    )
    parser.add_argument("--replay", action="store_true", help="replay the wave's Table writes raw and time them")
    parser.add_argument(
        "--profile", metavar="FILE", help="serial: a cProfile of the timed part's batches (not their tails) to FILE"
    )
    parser.add_argument(
        "--storm",
        action="store_true",
        help="a dead-letter storm: no envelope attested (a fleet whose forwarders predate attestation), every one "
        "refused and kept as a dead letter (implies --bindings cold: nothing binds)",
    )
    # For the tests only: a wave the coordinator must refuse (no documents; a root that is not the emulator's).
    parser.add_argument("--sabotage", choices=["unsigned", "foreign-anchor"], default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.storm:
        args.bindings = "cold"
    if args.warm_up == "auto":
        args.warm_up = "table" if args.vms <= TABLE_WARM_UP_VMS else "memory"
    import function_app

    environment, built = AppSettings(), function_app.coordinator
    try:
        result = _run(args, environment)
    finally:
        # As found: the app settings, the app's own coordinator (a test in this process may run the app next).
        environment.restore()
        function_app.coordinator = built
        function_app.settings.cache_clear()
    print(json.dumps(result))
    return 1 if result["problems"] else 0


def _replay_floor(connection: str, recorded: list[tuple[str, Any]]) -> float:
    """The wave's writes again, through the store's own $batch transport (the SDK's made the floor the slower)."""
    TableServiceClient.from_connection_string(connection).create_table("wavereplay")
    return replay(TransactionTableClient.from_connection_string(connection, table_name="wavereplay"), recorded)


def _run(args: argparse.Namespace, environment: AppSettings) -> dict[str, Any]:
    started = time.perf_counter()
    ops = Ops(record=args.replay)
    dead_ops = Ops()  # the dead-letter table's (serial and threads modes)
    reports: list[Any] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Azurite() as azurite,
        ImdsEmulator(scenario=fleet_scenario(args.vms, args.group_size), throttle_rps=0) as imds,
    ):
        prepared = prepare(args, imds, tmp, started)
        connection = azurite.connection_string
        if args.mode == "processes":
            outcome = _processes(args, prepared, connection=connection, imds_url=imds.url, tmp=tmp, started=started)
            env = coordinator_settings(connection, tmp, "history-tick.sqlite", args.policy) | prepared.env
            function_app = _coordinator(env, imds.url, reports, environment)
            outcome.histories.append("history-tick.sqlite")
        else:
            env = coordinator_settings(connection, tmp, "history.sqlite", args.policy) | prepared.env
            function_app = _coordinator(env, imds.url, reports, environment)
            outcome = _in_process(args, prepared, function_app, reports, ops=ops, dead_ops=dead_ops, started=started)
        ops.record = False
        during_wave = ops.summary()  # the wave alone; the tick's operations are counted apart
        # Bindings read or written by the wave (a claim not found is not counted): none when every VM is known.
        during_wave["binding_table_ops"] = sum(
            n for (p, _), n in ops.per_second.items() if p.startswith(f"{CLAIM_PARTITION}-")
        )
        dead = dead_ops.summary()
        during_wave["dead_letter_partitions"] = dead["table_partitions"]
        during_wave["dead_letter_busiest_partition_ops_per_s"] = dead["busiest_partition_ops_per_s"]
        tick_from = int(time.time()) + 1
        tick, tick_totals = _tick(function_app)
        during_wave["tick_busiest_partition_ops_per_s"] = ops.busiest(since=tick_from)["busiest_partition_ops_per_s"]
        census = function_app.coordinator().parts.census
        listed = len(census.snapshot()[0]) if census is not None else 0
        if args.replay:
            seconds_raw = _replay_floor(connection, ops.recorded)
            outcome.extra |= {
                "replay_seconds": round(seconds_raw, 3),
                "wave_over_replay": round(outcome.seconds / seconds_raw, 2),
            }
        function_app.coordinator().close()
        function_app.coordinator().parts.history.close()
        left = left_behind(connection, tmp, outcome.histories)
    found = problems(
        args, prepared.envelopes, outcome, left=left, tick_totals=tick_totals, during_wave=during_wave, listed=listed
    )
    states: Counter[str] = left["states"]
    return {
        "wave_envelopes": prepared.envelopes,
        "wave_seconds": round(outcome.seconds, 3),
        "envelopes_per_second": round(prepared.envelopes / outcome.seconds, 1),
        "mode": args.mode,
        "partitions": args.partitions,
        "batches": sum(-(-len(p) // args.batch) for p in prepared.work),
        "bindings": args.bindings,
        "warm_up": args.warm_up if args.bindings == "warm" else None,
        "prep_seconds": round(prepared.timings.pop("prep_seconds"), 3),
        "prep": {key: round(value, 3) for key, value in prepared.timings.items()},
        "distinct_events": sum(states.values()),
        "event_states": dict(states),
        "vms_merged_per_event": args.group_size,
        "group_spacing_ms": args.group_spacing_ms,
        "history_rows": len(left["rows"]),
        "cards": left["cards"],
        "accepted": outcome.totals["accepted"],
        "dead_lettered": outcome.totals["dead_lettered"],
        "conflicts": outcome.totals["conflicts"],
        "policy": args.policy,
        "event_type": args.event_type,
        "seconds_per_1k_envelopes": round(outcome.seconds / prepared.envelopes * 1000, 4),
        "coordinator_cpu_seconds": round(outcome.cpu, 3),
        "coordinator_cpu_seconds_per_1k_envelopes": round(outcome.cpu / prepared.envelopes * 1000, 4),
        **outcome.extra,
        **during_wave,
        **tick,
        "census_vms": listed,
        "binding_rows": left["claims"],
        "problems": found,
    }


if __name__ == "__main__":
    sys.exit(main())
