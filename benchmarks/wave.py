"""A maintenance wave through the coordinator's Event Hubs entry point, with state in Azurite.

10,000 VMs in placement groups of 20 each report one Scheduled event (500 distinct events): every VM of a group
sees its group's event within about a second of the others, groups start 50 ms apart, and the envelopes are spread
over Event Hubs partitions by VM resource id (the forwarder's partition key), then cut into batches of 200
(host.json maxEventBatchSize) per partition and fed to ``function_app.ingest_envelopes`` as ``func.EventHubEvent``
lists. The events are Reboot/Redeploy/long Freeze, which the default policy leaves to a person: the figure covers
state, rules, history (SQLite) and alerts (cards folder), not approvals (benchmarks/approval_latency.py does those).

``--policy census`` decides the same wave with a policy that needs the census (a tag rule, a percent budget per
scale set, zone and update domain that no event of the wave matches): the same writes, plus what knowing every VM
costs. ``--event-type Terminate`` makes every group's event a scale-in delete of 5 of its VMs (the default policy
waits for their prepare hooks): delete coupling looks at the open deletes. ``--replay`` records the coordinator's
Table writes and sends them again, raw, to a fresh table: the floor the wave is compared with.

    .venv/bin/python -m benchmarks.wave [--mode processes|threads|serial] [--vms 10000] [--partitions 4]
        [--policy default|census] [--event-type mixed|Terminate] [--replay]

Prints one JSON object: {wave_envelopes, wave_seconds, envelopes_per_second, busiest_partition_ops_per_s, ...}
(the Table operations are counted per partition per second in serial and threads modes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import azure.functions as func
from azure.data.tables import TableServiceClient

from benchmarks.table_ops import CountingTable, Ops, replay
from contracts.envelope import SCHEMA
from coordinator.adapters.history import SqliteHistory
from coordinator.state.tables import TableStateStore
from emulators.azurite import Azurite
from emulators.imds import ImdsEmulator

START = datetime(2026, 11, 20, 1, 0, tzinfo=UTC)
# A policy that needs the census (Policy.needs_census: a tag rule, percent budgets per zone and update domain) and
# decides the wave as the default policy does: nothing of the wave carries the tag or matches the budget rule, so
# the writes are the same and the difference is what knowing every VM costs.
CENSUS_POLICY = """version: 1
rules:
  - name: opted-out
    match: {tags: {scheduled-events: manual}}
    action: wait-for-person
  - name: paced-short-freezes
    match: {eventType: [Freeze], durationSeconds: {min: 0, max: 8}}
    action: approve-within-budget
    budget: {maxPercent: 10, per: [scaleSet, zone, updateDomain]}
  - name: terminate-after-prepare-hooks
    match: {eventType: [Terminate]}
    action: approve-after-hooks
    hooks: {deadlineSeconds: 240, onDeadline: approve, noHooks: wait}
  - name: everything-else-waits
    match: {}
    action: wait-for-person
"""


def build_wave(
    vms: int, group_size: int, spacing_ms: float, rng: random.Random, event_type: str = "mixed"
) -> list[dict[str, Any]]:
    groups = vms // group_size
    kinds = [("Reboot", -1), ("Redeploy", -1), ("Freeze", 30)] if event_type == "mixed" else [(event_type, -1)]
    out: list[dict[str, Any]] = []
    for g in range(groups):
        group_start = START + timedelta(milliseconds=spacing_ms * g)
        names = [f"vmss{g:03d}_{i}" for i in range(group_size)]
        event_type, duration = kinds[g % len(kinds)]
        event = {
            "EventId": str(uuid.UUID(int=rng.getrandbits(128))).upper(),
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": names[: group_size // 4],  # one update domain of the group
            "EventStatus": "Scheduled",
            "NotBefore": format_datetime(group_start + timedelta(minutes=15), usegmt=True),
            "Description": "Virtual machine is going to be restarted for platform maintenance.",
            "EventSource": "Platform",
            "DurationInSeconds": duration,
        }
        for i, name in enumerate(names):
            vm_index = g * group_size + i
            vm_id = str(uuid.UUID(int=vm_index + 1))
            observed = group_start + timedelta(milliseconds=rng.uniform(0, 1000))
            out.append(
                {
                    "schema": SCHEMA,
                    "kind": "incarnation",
                    "vm": {
                        "name": name,
                        "vmId": vm_id,
                        "resourceId": (
                            "/subscriptions/00000000-0000-0000-0000-000000000001/resourceGroups/rg-wave/providers/"
                            f"Microsoft.Compute/virtualMachineScaleSets/vmss{g:03d}/virtualMachines/{i}"
                        ),
                        "vmScaleSetName": f"vmss{g:03d}",
                        "placementGroupId": f"pg-{g:03d}",
                        "location": "westeurope",
                        "zone": str(g % 3 + 1),
                        "platformUpdateDomain": str(i % 5),
                        "tags": {"team": "wave"},
                    },
                    "observedAt": observed.isoformat(),
                    "sequence": 100,
                    "forwarder": "wave/1.0",
                    "document": {"DocumentIncarnation": 2, "Events": [event]},
                }
            )
    out.sort(key=lambda e: e["observedAt"])
    return out


def batches(wave: list[dict[str, Any]], partitions: int, batch: int) -> list[list[list[func.EventHubEvent]]]:
    """Per partition, its batches in order."""
    per_partition: list[list[func.EventHubEvent]] = [[] for _ in range(partitions)]
    for envelope in wave:
        key = envelope["vm"]["resourceId"].lower()
        partition = zlib.crc32(key.encode()) % partitions
        events = per_partition[partition]
        events.append(
            func.EventHubEvent(
                body=json.dumps(envelope).encode(),
                partition_key=key,
                sequence_number=len(events),
                offset=str(len(events)),
                enqueued_time=datetime.fromisoformat(envelope["observedAt"]),
            )
        )
    return [[p[i : i + batch] for i in range(0, len(p), batch)] for p in per_partition]


def _env(azurite_connection: str, tmp: str, history: str, policy: str = "default") -> dict[str, str]:
    env = {
        "COORDINATOR_STORAGE_CONNECTION_STRING": azurite_connection,
        "COORDINATOR_STATE_TABLE": "wave",
        "COORDINATOR_HISTORY_SQLITE_PATH": f"{tmp}/{history}",
        "COORDINATOR_CARDS_FOLDER": f"{tmp}/cards",
    }
    if policy == "census":
        path = f"{tmp}/census-policy.yaml"
        with open(path, "w", encoding="utf-8") as file:
            file.write(CENSUS_POLICY)
        env["COORDINATOR_POLICY_PATH"] = path
    return env


def _coordinator(env: dict[str, str], imds_url: str, totals: Counter[str]) -> Any:
    os.environ.update(env)
    import function_app
    from local.direct_callback import direct_coordinator

    function_app.coordinator = direct_coordinator(function_app.settings, imds_url)

    coordinator = function_app.coordinator()
    coordinator.clock = lambda: START + timedelta(seconds=30)
    original = coordinator.process_batch

    def counted(messages: Any, **channel: Any) -> Any:
        report = original(messages, **channel)
        totals.update(report.as_dict())
        return report

    coordinator.process_batch = counted  # type: ignore[method-assign]
    return function_app


def _instance(
    args: argparse.Namespace, partition: int, *, env: dict[str, str], imds_url: str, ready: Any, go: Any, out: Any
) -> None:
    """One Functions instance owning one partition, in its own process (how the host scales out)."""
    totals: Counter[str] = Counter()
    function_app = _coordinator(env, imds_url, totals)
    work = batches(
        build_wave(args.vms, args.group_size, args.group_spacing_ms, random.Random(args.seed), args.event_type),
        args.partitions,
        args.batch,
    )
    mine = work[partition]
    ready.release()
    go.wait()
    for batch in mine:
        function_app.ingest_envelopes(batch)
    out.put((time.time(), dict(totals)))


def _tick(function_app: Any) -> dict[str, Any]:
    """The timer's next run: it settles the cards the batches logged as sent (the outbox), re-evaluates every
    open event and checks heartbeats. That is work the batches leave for later, so it is measured too; then the
    tick after it (the instance's fleet cache is warm: it reads what changed)."""
    coordinator = function_app.coordinator()
    coordinator.clock = lambda: START + timedelta(seconds=90)
    started = time.perf_counter()
    report = coordinator.tick()
    seconds = time.perf_counter() - started
    # The next minute's tick: what changed since the last one (nothing here), the steady state.
    coordinator.clock = lambda: START + timedelta(seconds=150)
    again = time.perf_counter()
    coordinator.tick()
    return {
        "tick_seconds": round(seconds, 3),
        "tick_again_seconds": round(time.perf_counter() - again, 3),
        "tick_events_changed": report.events_changed,
        "tick_alerts_sent": report.alerts_sent,
        "cards_pending_after_tick": sum(1 for s in coordinator.store.open_events() if s.record.pendingAlerts),
    }


def _processes(
    args: argparse.Namespace, connection: str, imds_url: str, tmp: str, totals: Counter[str]
) -> tuple[float, list[str]]:
    """One instance per partition, each in its own process, started together; the seconds until the last ends."""
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Semaphore(0), context.Event(), context.Queue()
    workers = [
        context.Process(
            target=_instance,
            args=(args, p),
            kwargs={
                "env": _env(connection, tmp, f"history-{p}.sqlite", args.policy),
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
    started_wall = time.time()
    go.set()
    ends = []
    for _ in workers:
        end, counts = out.get(timeout=600)
        ends.append(end)
        totals.update(counts)
    for worker in workers:
        worker.join()
    return max(ends) - started_wall, [f"history-{p}.sqlite" for p in range(args.partitions)]


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
    parser.add_argument("--replay", action="store_true", help="replay the wave's Table writes raw and time them")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    wave = build_wave(args.vms, args.group_size, args.group_spacing_ms, random.Random(args.seed), args.event_type)
    ops = Ops(record=args.replay)
    work = batches(wave, args.partitions, args.batch)
    totals: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp, Azurite() as azurite, ImdsEmulator(throttle_rps=0) as imds:
        if args.mode == "processes":
            seconds, histories = _processes(args, azurite.connection_string, imds.url, tmp, totals)
            cpu = 0.0
        else:
            env = _env(azurite.connection_string, tmp, "history.sqlite", args.policy)
            function_app = _coordinator(env, imds.url, totals)
            store = function_app.coordinator().store
            store._table = CountingTable(store._table, ops)

            def drain(partition: list[list[func.EventHubEvent]]) -> None:
                for batch in partition:
                    function_app.ingest_envelopes(batch)

            started, cpu_started = time.perf_counter(), time.process_time()
            with ThreadPoolExecutor(max_workers=args.partitions if args.mode == "threads" else 1) as pool:
                for future in [pool.submit(drain, p) for p in work]:
                    future.result()
            seconds = time.perf_counter() - started
            # The coordinator's own CPU (this process; Azurite is another): what the coordinator does per envelope,
            # apart from the emulator, whose operations cost more as its table grows.
            cpu = time.process_time() - cpu_started
            histories = ["history.sqlite"]
        if args.mode == "processes":
            env = _env(azurite.connection_string, tmp, "history-tick.sqlite", args.policy)
            function_app = _coordinator(env, imds.url, totals)
            histories.append("history-tick.sqlite")
        ops.record = False
        during_wave = ops.summary()  # the wave alone; the tick's operations are counted apart
        tick_from = int(time.time()) + 1
        tick = _tick(function_app)
        replayed: dict[str, Any] = {}
        if args.replay:
            service = TableServiceClient.from_connection_string(azurite.connection_string)
            raw = service.create_table("wavereplay")
            seconds_raw = replay(raw, ops.recorded)
            replayed = {"replay_seconds": round(seconds_raw, 3), "wave_over_replay": round(seconds / seconds_raw, 2)}
        store = TableStateStore.from_connection_string(azurite.connection_string, table_name="wave")
        states = Counter(s.record.state for s in store.open_events())
        cards = len(os.listdir(f"{tmp}/cards"))
        rows = 0
        for name in histories:
            history = SqliteHistory(f"{tmp}/{name}")
            rows += history.query("SELECT count(*) AS n FROM ScheduledEventsHistory_CL")[0]["n"]
            history.close()
    result = {
        "wave_envelopes": len(wave),
        "wave_seconds": round(seconds, 3),
        "envelopes_per_second": round(len(wave) / seconds, 1),
        "mode": args.mode,
        "partitions": args.partitions,
        "batches": sum(len(p) for p in work),
        "distinct_events": sum(states.values()),
        "event_states": dict(states),
        "vms_merged_per_event": args.group_size,
        "group_spacing_ms": args.group_spacing_ms,
        "history_rows": rows,
        "cards": cards,
        "accepted": totals["accepted"],
        "dead_lettered": totals["dead_lettered"],
        "conflicts": totals["conflicts"],
        "policy": args.policy,
        "event_type": args.event_type,
        "seconds_per_1k_envelopes": round(seconds / len(wave) * 1000, 4),
        "coordinator_cpu_seconds": round(cpu, 3),
        "coordinator_cpu_seconds_per_1k_envelopes": round(cpu / len(wave) * 1000, 4),
        **during_wave,
        "tick_busiest_partition_ops_per_s": ops.busiest(since=tick_from)["busiest_partition_ops_per_s"],
        **replayed,
        **tick,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
