"""How benchmarks/wave.py plays a wave: the coordinator as ``function_app`` runs it, the warm-up before the clock,
the timed batches (one instance in this process, serially or on threads, or one process per partition), their
tails, and the timer's ticks after them. What a wave is and what it must leave: benchmarks/wave.py,
benchmarks/wave_checks.py.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import multiprocessing
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any

import azure.functions as func

from benchmarks.table_ops import CountingTable, Ops
from benchmarks.wave_checks import Outcome
from benchmarks.wave_fleet import START, Message, Prepared, batches, coordinator_settings, seed_bindings
from coordinator import ApprovalCallback, build_coordinator
from local.coordinator_setup import AppSettings

__all__ = ["WARM_UP_AT", "WAVE_AT", "coordinator_app", "in_process", "processes", "tick"]

# The coordinator's clock: the warm-up (and the census' first read) just before the wave, the wave 30 s in.
WARM_UP_AT = START - timedelta(seconds=30)
WAVE_AT = START + timedelta(seconds=30)


def coordinator_app(
    env: dict[str, str], imds_url: str, reports: list[Any], environment: AppSettings, *,
    listeners: ApprovalCallback | None = None,
) -> Any:  # fmt: skip
    """``function_app`` with a coordinator built afresh from ``env`` (approvals straight into the IMDS emulator, or
    to ``listeners``); every batch's report is kept in ``reports`` (its tail adds to it after the batch returns)."""
    environment.apply(env)
    import function_app
    from local.direct_callback import direct_coordinator

    function_app.settings.cache_clear()
    if listeners is None:
        function_app.coordinator = direct_coordinator(function_app.settings, imds_url)
    else:
        function_app.coordinator = functools.cache(
            lambda: build_coordinator(function_app.settings(), callback=listeners)
        )
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
    function_app = coordinator_app(env, imds_url, reports, AppSettings())
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


# Ticks after the measured two that may still write bindings (a 100,000-VM cold wave's 400,000 claims at a few
# seconds a tick), before the wave's bindings are counted.
BINDING_TICKS = 60


def tick(function_app: Any) -> tuple[dict[str, Any], dict[str, int]]:
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
    # The claims of VMs ARM's census vouched for (a cold wave's) are written by the ticks, a few seconds each: the
    # ticks after those two until none is left, counted (not timed).
    more = 0
    while len(coordinator.parts.attestations.backlog) and more < BINDING_TICKS:
        more += 1
        at = START + timedelta(seconds=150 + 60 * more)
        coordinator.parts = replace(coordinator.parts, clock=lambda at=at: at)
        counts.update(coordinator.tick().as_dict())
    return {
        "tick_seconds": round(seconds, 3),
        "tick_again_seconds": round(again_seconds, 3),
        "bindings_written_by_ticks": counts["bindings_written"],
        "ticks_writing_bindings_after": more,
        "tick_events_changed": report.events_changed,
        "tick_alerts_sent": report.alerts_sent,
        "cards_pending_after_tick": sum(1 for s in coordinator.parts.store.open_events() if s.record.pendingAlerts),
    }, dict(counts)


def processes(
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


def in_process(
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
    profile = None
    if args.profile:
        # cpu: the batches' thread's CPU alone (the wall clock counts Azurite's waits in the function that waited).
        profile = cProfile.Profile(time.thread_time) if args.profile_clock == "cpu" else cProfile.Profile()
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
