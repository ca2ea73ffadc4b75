"""Approval latency with 10% dead listeners, through the whole local pipeline (local.stack): every VM's forwarder
process, the Event Hubs, Relay and IMDS emulators, the function host (Event Hubs trigger, timer, the delivery
queue's trigger on Azurite) and the coordinator, with a policy that approves every event at once. One VM in ten has
a listener that is connected and never answers (the Relay emulator holds every request to it: a hung process, or a
VM frozen); each VM is alone in its placement group, so no peer can execute its events in its place.

    .venv/bin/python -m benchmarks.dead_listeners [--events 40] [--vms 10] [--dead 1] [--in-run-seconds 3]

Prints one JSON object: detect_to_approve_ms_p50/p99/max over the events of the live VMs (event created in IMDS →
approval recorded by IMDS, as benchmarks.pipeline_latency measures it), live_missed (live VMs' events not approved
before their NotBefore), dead_events (events of the dead VMs, never approved), slowest_batch_s and slowest_tick_s
(the longest invocation of each trigger: how long one run kept its partition or the timer waiting) and
deliveries_continued (approvals handed to the delivery queue). Events are created 0.8-1.6 s apart, round-robin over
the VMs, each a Freeze with 15 minutes of notice (15 s at the time scale of 60). ``--in-run-seconds 29`` plays the
coordinator before the delivery queue: each run waited up to the 30 s approval deadline for its own approvals.

Listeners connect on demand, as shipped (``listener: "on-demand"``); a dead VM's listener connects for its event like
the others, and the Relay emulator holds what is sent to it. ``problems`` (exit 1 when not empty) names what keeps the
run from being what it claims: a live VM's event missed (not approved before its NotBefore) or approved by another VM
or twice, a dead VM's event approved (its listener was not dead) or its listener never connected (a missing
listener, not a hung one), no approval handed to the delivery queue while dead VMs had events (with
``--in-run-seconds`` below the 15 s notice), decisions not "approve" by the policy's rule, envelopes dead-lettered
(the history's rows and the coordinator's batch reports), failed batches, a listener connected before any event.
The events start once the coordinator has taken every VM's first envelope (its cold start is not in the figures).
"""

from __future__ import annotations

import argparse
import logging
import random
import sqlite3
import time
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from benchmarks.checks import (
    approvals_problems,
    batch_reports,
    finish,
    on_demand_problems,
    scratch,
    some,
    stack_problems,
    too_few,
)
from benchmarks.stack_runs import RULE, stack_options, utc, wait_warm
from emulators.imds import Scenario, VmSpec
from local.runner import wait_until
from local.stack import LocalStack
from local.summary import percentile

# Real seconds of a Freeze's notice (15 minutes at the time scale of 60): an approval the runs give less than this is
# handed to the delivery queue when its listener does not answer.
NOTICE_SECONDS = 15.0


def run(
    *, events: int, vms: int, dead: int, in_run_seconds: float, seed: int, kill: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``kill`` (tests only): VMs whose listener is dead although the run counts them live."""
    rng = random.Random(seed)
    problems: list[str] = []
    with scratch() as tmp:
        # Each VM in a placement group of its own: a dead listener's events have no peer to go through.
        scenario = Scenario(
            name="dead-listeners", vms=[VmSpec(name=f"bench_{i}", placementGroupId=f"pg-{i}") for i in range(vms)]
        )
        options = stack_options(
            Path(tmp),
            scenario,
            timer_interval=5.0,
            coordinator_env={"COORDINATOR_IN_RUN_DELIVERY_SECONDS": f"{in_run_seconds:g}"},
        )
        with batch_reports() as reports, LocalStack(options) as stack:
            assert stack.imds is not None
            assert stack.eventhubs is not None
            assert stack.relay is not None
            assert stack.host is not None
            imds, relay = stack.imds, stack.relay
            names = [vm.name for vm in imds.vms()]
            # Every tenth VM (the first `dead` of each ten) has a listener that never answers.
            dead_vms = {vm.name for index, vm in enumerate(imds.vms()) if index % 10 < dead}
            for vm in imds.vms():
                if vm.name in dead_vms | kill:
                    relay.set_listener_fault(f"vm-{vm.vmId.lower()}", dead=True)
            wait_warm(lambda: reports.accepted() >= len(names))
            problems += on_demand_problems(stack)
            created: dict[str, str] = {}
            for index in range(events):
                name = names[index % len(names)]
                event = imds.create_event(EventType="Freeze", Resources=[name], DurationInSeconds=5)
                created[str(event["EventId"])] = name
                time.sleep(rng.uniform(0.8, 1.6))
            live = [event_id for event_id, name in created.items() if name not in dead_vms]

            def settled() -> bool:
                states = {str(e["EventId"]): e for e in imds.events()}
                return all(states[e]["approvedAt"] or states[e]["state"] != "Scheduled" for e in live)

            finished = wait_until(settled, timeout=60)
            summaries = {str(e["EventId"]): e for e in imds.events()}
            stack.drain()
            stats = stack.host.stats
            continued = _continued(stack)
            problems += _listener_problems(stack, created, dead_vms)
            problems += stack_problems(stack, created, rule=RULE)
            problems += reports.problems()
            envelopes = reports.figures()
    latencies, missed = _latencies(live, summaries)
    if missed:
        problems.append(f"{len(missed)} live VMs' events not approved before their NotBefore: {some(missed)}")
    dead_events = len(created) - len(live)
    if dead_events and not continued and in_run_seconds < NOTICE_SECONDS:
        problems.append(f"{dead_events} events of dead listeners, but no approval was handed to the delivery queue")
    problems += too_few("live approvals", len(latencies), len(live))
    result: dict[str, Any] = {"listener": "on-demand"}
    if latencies:
        result |= {
            "detect_to_approve_ms_p50": round(percentile(latencies, 0.5), 1),
            "detect_to_approve_ms_p99": round(percentile(latencies, 0.99), 1),
            "detect_to_approve_ms_max": round(max(latencies), 1),
        }
    return result | {
        "live_events": len(live),
        "live_missed": len(missed),
        "dead_events": dead_events,
        "dead_listeners_percent": round(100 * len(dead_vms) / vms, 1),
        "slowest_batch_s": round(stats.slowest_batch, 2),
        "slowest_tick_s": round(stats.slowest_tick, 2),
        "batch_retries": stats.retries,
        "deliveries_continued": continued,
        "in_run_seconds": in_run_seconds,
        "finished": finished,
        "vms": vms,
        **envelopes,
        "problems": problems,
    }


def _latencies(live: list[str], summaries: dict[str, dict[str, Any]]) -> tuple[list[float], list[str]]:
    """Detect-to-approve of the live VMs' events approved before their NotBefore; the others, missed."""
    latencies: list[float] = []
    missed: list[str] = []
    for event_id in live:
        summary = summaries[event_id]
        approved_at = summary["approvedAt"]
        if not approved_at or utc(approved_at) >= parsedate_to_datetime(summary["NotBefore"]):
            missed.append(event_id)
            continue
        latencies.append((utc(approved_at) - utc(summary["scheduledAt"])).total_seconds() * 1000)
    return latencies, missed


def _listener_problems(stack: LocalStack, created: dict[str, str], dead_vms: set[str]) -> list[str]:
    """The live VMs' approvals made by their own VM once, the dead VMs' never, and the dead listeners connected."""
    assert stack.imds is not None
    assert stack.relay is not None
    approvals = stack.imds.approvals()
    problems = approvals_problems(
        approvals, {e: [name] for e, name in created.items() if name not in dead_vms}, unexpected_ok=True
    )
    approved = {str(item["EventId"]) for item in approvals}
    dead_approved = [e for e, name in created.items() if name in dead_vms and e in approved]
    if dead_approved:
        problems.append(
            f"{len(dead_approved)} events of dead listeners were approved (not dead): {some(dead_approved)}"
        )
    connections = stack.relay.counters()
    never = [
        vm.name
        for vm in stack.imds.vms()
        if vm.name in dead_vms and vm.name in created.values() and not connections.get(f"listener.vm-{vm.vmId.lower()}")
    ]
    if never:
        problems.append(f"dead VMs whose listener never connected (missing, not hung): {some(never)}")
    return problems


def _continued(stack: LocalStack) -> int:
    """Approvals handed to the delivery queue: their 'continued' Approval rows in the run's history."""
    with sqlite3.connect(stack.history_path) as db:
        (count,) = db.execute(
            "SELECT count(*) FROM ScheduledEventsHistory_CL WHERE RecordType = 'Approval' AND Outcome = 'continued'"
        ).fetchone()
    return int(count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dead_listeners", description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=40, help="events to time (default 40)")
    parser.add_argument("--vms", type=int, default=10, help="simulated VMs, one forwarder process each (default 10)")
    parser.add_argument("--dead", type=int, default=1, help="dead listeners in every ten VMs (default 1: 10%%)")
    parser.add_argument(
        "--in-run-seconds", type=float, default=3.0, help="COORDINATOR_IN_RUN_DELIVERY_SECONDS (29: before the queue)"
    )
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    return finish(
        lambda: run(
            events=args.events, vms=args.vms, dead=args.dead, in_run_seconds=args.in_run_seconds, seed=args.seed
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
