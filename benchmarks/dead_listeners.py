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
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sqlite3
import tempfile
import time
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from emulators.imds import Scenario, VmSpec
from local.observe import sent_envelopes
from local.runner import wait_until
from local.stack import HUB, LocalStack, StackOptions
from local.summary import percentile

APPROVE_ALL = """version: 1
rules:
  - name: approve-everything
    description: benchmark policy - every event is approved at once
    match: {}
    action: approve-now
"""


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def run(*, events: int, vms: int, dead: int, in_run_seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "approve-all.yaml"
        policy.write_text(APPROVE_ALL, encoding="utf-8")
        # Each VM in a placement group of its own: a dead listener's events have no peer to go through.
        scenario = Scenario(
            name="dead-listeners", vms=[VmSpec(name=f"bench_{i}", placementGroupId=f"pg-{i}") for i in range(vms)]
        )
        options = StackOptions(
            scenario=scenario,
            workdir=Path(tmp) / "local",
            time_scale=60.0,  # a Freeze's 15-minute notice lasts 15 s; Started events leave after 10 s
            poll_interval=1.0,
            heartbeat_interval=60.0,
            timer_interval=5.0,
            policy_path=policy,
            prepare_hooks=False,
            coordinator_env={"COORDINATOR_IN_RUN_DELIVERY_SECONDS": f"{in_run_seconds:g}"},
        )
        with LocalStack(options) as stack:
            assert stack.imds is not None
            assert stack.eventhubs is not None
            assert stack.relay is not None
            assert stack.host is not None
            imds, eventhubs, relay = stack.imds, stack.eventhubs, stack.relay
            names = [vm.name for vm in imds.vms()]
            # Every tenth VM (the first `dead` of each ten) has a listener that never answers.
            dead_vms = {vm.name for index, vm in enumerate(imds.vms()) if index % 10 < dead}
            for vm in imds.vms():
                if vm.name in dead_vms:
                    relay.set_listener_fault(f"vm-{vm.vmId.lower()}", dead=True)
            ready = wait_until(lambda: len(sent_envelopes(eventhubs, HUB)[0]) >= len(names), timeout=60)
            if not ready:
                raise RuntimeError("the forwarders did not report within 60 s; see their logs in the work folder")
            time.sleep(1.0)  # past the first documents' processing
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
            stats = stack.host.stats
            continued = _continued(stack)
    latencies, missed = [], 0
    for event_id in live:
        summary = summaries[event_id]
        approved_at = summary["approvedAt"]
        if not approved_at or _time(approved_at) >= parsedate_to_datetime(summary["NotBefore"]):
            missed += 1
            continue
        latencies.append((_time(approved_at) - _time(summary["scheduledAt"])).total_seconds() * 1000)
    if not latencies:
        raise RuntimeError(f"no live VM's event was approved ({missed} missed)")
    return {
        "detect_to_approve_ms_p50": round(percentile(latencies, 0.5), 1),
        "detect_to_approve_ms_p99": round(percentile(latencies, 0.99), 1),
        "detect_to_approve_ms_max": round(max(latencies), 1),
        "live_events": len(live),
        "live_missed": missed,
        "dead_events": len(created) - len(live),
        "dead_listeners_percent": round(100 * len(dead_vms) / vms, 1),
        "slowest_batch_s": round(stats.slowest_batch, 2),
        "slowest_tick_s": round(stats.slowest_tick, 2),
        "deliveries_continued": continued,
        "in_run_seconds": in_run_seconds,
        "finished": finished,
        "vms": vms,
    }


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
    result = run(events=args.events, vms=args.vms, dead=args.dead, in_run_seconds=args.in_run_seconds, seed=args.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
