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
costs. ``--policy budget-KIND`` (tags, percent, zone, fault-domain, update-domain, placement-group, rate, sequence)
decides it under one kind of budget that approves part of the wave, the approvals delivered to stand-ins for the
VMs' listeners (benchmarks/wave_budgets.py, which also checks that the budget held). ``--event-type Terminate``
makes every group's event a scale-in delete of 5 of its VMs (the default policy waits for their prepare hooks):
delete coupling looks at the open deletes. ``--replay`` records the coordinator's
Table writes and sends them again, raw, to a fresh table: the floor the wave is compared with. ``--storm``: no
envelope attested, every one must be a dead letter, spread over the dead-letter table's partitions (counted apart).

    .venv/bin/python -m benchmarks.wave [--mode processes|threads|serial] [--vms 10000] [--partitions 4]
        [--policy default|census|budget-KIND] [--event-type mixed|Terminate] [--bindings warm|cold]
        [--warm-up auto|table|memory|heartbeats] [--listeners elsewhere|in-process] [--replay] [--storm]
        [--profile FILE] [--profile-clock wall|cpu]

Prints one JSON object: {wave_envelopes, wave_seconds, envelopes_per_second, busiest_partition_ops_per_s, ...,
problems} (the Table operations are counted per partition per second in serial and threads modes). ``problems``
names everything the wave left otherwise than its policy must (envelopes not accepted, dead letters, events missing,
other decisions or states, census mismatches, bindings missing); the exit code is 1 when there is any.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from azure.data.tables import TableServiceClient

from benchmarks import wave_run
from benchmarks.table_ops import Ops, replay
from benchmarks.wave_budgets import BUDGETS, ListenersElsewhere, WaveListeners, in_process
from benchmarks.wave_checks import left_behind, problems
from benchmarks.wave_fleet import coordinator_settings, fleet_scenario, prepare
from coordinator import CLAIM_PARTITION, TransactionTableClient
from emulators.app_identity import AppIdentity
from emulators.azurite import Azurite
from emulators.imds import ImdsEmulator
from local.coordinator_setup import AppSettings
from local.identities import coordinator_identity

# Up to this many VMs, a warm wave's bindings are written to the table before it (--warm-up auto): 40,000 rows in the
# one partition Azurite scans per write took 190 s, 100,000 would take about 20 minutes, 200,000 over an hour.
TABLE_WARM_UP_VMS = 20_000


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
    parser.add_argument(
        "--policy",
        choices=["default", "census", *BUDGETS],
        default="default",
        help="default; census: a policy that reads ARM's census but decides as the default; budget-KIND: one kind of "
        "budget approves part of the wave (serial or threads mode)",
    )
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
    _listeners_argument(parser)
    parser.add_argument("--replay", action="store_true", help="replay the wave's Table writes raw and time them")
    parser.add_argument(
        "--profile", metavar="FILE", help="serial: a cProfile of the timed part's batches (not their tails) to FILE"
    )
    parser.add_argument(
        "--profile-clock",
        choices=["wall", "cpu"],
        default="wall",
        help="the profile's clock: wall (Azurite's waits included) or cpu (the batches' thread's CPU alone)",
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
    if args.policy in BUDGETS and (args.mode == "processes" or args.event_type != "mixed"):
        _parser().error(f"--policy {args.policy} is for the mixed wave in serial or threads mode")
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


def _listeners_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listeners",
        choices=["elsewhere", "in-process"],
        default="elsewhere",
        help="budget-KIND: where the stand-ins for the VMs' listeners judge and sign their answers. elsewhere "
        "(default): two processes of their own, as the listeners run on their VMs; in-process: the coordinator's "
        "(its CPU then includes the VMs' work; how the budget waves ran before 2026-11-30)",
    )


@contextlib.contextmanager
def _listeners(
    args: argparse.Namespace, imds: ImdsEmulator, documents: dict[str, Any]
) -> Iterator[WaveListeners | ListenersElsewhere | None]:
    """The stand-ins that answer a budget wave's approvals (none for the other policies: they approve nothing)."""
    if args.policy not in BUDGETS:
        yield None
    elif args.listeners == "in-process":
        yield in_process(imds, documents)
    else:
        elsewhere = ListenersElsewhere(imds, documents)
        try:
            yield elsewhere
        finally:
            elsewhere.close()


def _during_wave(ops: Ops, dead_ops: Ops) -> dict[str, Any]:
    """The wave's Table operations alone (the tick's are counted apart), with the bindings it read or wrote (a claim
    not found is not counted: none when every VM is known) and its dead letters' partitions."""
    during_wave = ops.summary()
    during_wave["binding_table_ops"] = sum(
        n for (p, _), n in ops.per_second.items() if p.startswith(f"{CLAIM_PARTITION}-")
    )
    dead = dead_ops.summary()
    during_wave["dead_letter_partitions"] = dead["table_partitions"]
    during_wave["dead_letter_busiest_partition_ops_per_s"] = dead["busiest_partition_ops_per_s"]
    return during_wave


def _run(args: argparse.Namespace, environment: AppSettings) -> dict[str, Any]:
    started = time.perf_counter()
    ops, dead_ops = Ops(record=args.replay), Ops()  # dead_ops: the dead-letter table's (serial and threads modes)
    reports: list[Any] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Azurite() as azurite,
        ImdsEmulator(scenario=fleet_scenario(args.vms, args.group_size), throttle_rps=0) as imds,
        contextlib.ExitStack() as stack,
    ):
        identity = stack.enter_context(AppIdentity(coordinator_identity(imds.scenario))).environment()
        prepared = prepare(args, imds, identity, tmp, started)  # the coordinator's tokens: its own identity's
        connection = azurite.connection_string
        if args.mode == "processes":
            outcome = wave_run.processes(
                args, prepared, connection=connection, imds_url=imds.url, tmp=tmp, started=started
            )
            env = coordinator_settings(connection, tmp, "history-tick.sqlite", args.policy) | prepared.env
            function_app = wave_run.coordinator_app(env, imds.url, reports, environment)
            outcome.histories.append("history-tick.sqlite")
        else:
            env = coordinator_settings(connection, tmp, "history.sqlite", args.policy) | prepared.env
            listeners = stack.enter_context(_listeners(args, imds, prepared.documents))  # open until the tick is done
            function_app = wave_run.coordinator_app(env, imds.url, reports, environment, listeners=listeners)
            outcome = wave_run.in_process(
                args, prepared, function_app, reports, ops=ops, dead_ops=dead_ops, started=started
            )
        ops.record = False
        during_wave = _during_wave(ops, dead_ops)
        tick_from = int(time.time()) + 1
        tick, tick_totals = wave_run.tick(function_app)
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
        args, prepared.envelopes, outcome, left=left, tick_totals=tick_totals, during_wave=during_wave,
        listed=listed, specs={spec.name: spec for spec in imds.vms()}, events=prepared.events,
    )  # fmt: skip
    states = Counter(left["states"].values())
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
        "listeners": args.listeners if args.policy in BUDGETS else None,
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
