"""Figures for the IMDS emulator, printed as one JSON object:

    .venv/bin/python -m emulators.imds.bench [--requests 1000] [--threads 4]

start-up time, sequential GET latency (p50/p95) and throughput over loopback HTTP, concurrent throughput, and
the cost of the pure state machine for a large fleet (documents for 200 VMs with 400 live events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from datetime import UTC, datetime, timedelta

import requests

from emulators.imds.models import EventCreate, Scenario
from emulators.imds.server import ImdsEmulator
from emulators.imds.state import EmulatorState
from emulators.imds.vm_models import VmSpec


def _http(requests_total: int, threads: int) -> dict[str, float]:
    started = time.perf_counter()
    emulator = ImdsEmulator(time_scale=60, throttle_rps=0)
    emulator.start()
    startup_ms = (time.perf_counter() - started) * 1000
    try:
        emulator.create_event(EventType="Freeze", Resources=["WestNO_0", "WestNO_1"])
        url = emulator.scheduled_events_url("WestNO_1")
        headers = {"Metadata": "true"}
        latencies: list[float] = []
        with requests.Session() as session:
            session.get(url, headers=headers, timeout=5)
            begin = time.perf_counter()
            for _ in range(requests_total):
                one = time.perf_counter()
                session.get(url, headers=headers, timeout=5).raise_for_status()
                latencies.append((time.perf_counter() - one) * 1000)
            sequential_rps = requests_total / (time.perf_counter() - begin)

        def worker(count: int) -> None:
            with requests.Session() as session:
                for _ in range(count):
                    session.get(url, headers=headers, timeout=5).raise_for_status()

        per_thread = requests_total // threads
        pool = [threading.Thread(target=worker, args=(per_thread,)) for _ in range(threads)]
        begin = time.perf_counter()
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        concurrent_rps = per_thread * threads / (time.perf_counter() - begin)
    finally:
        emulator.stop()
    quantiles = statistics.quantiles(latencies, n=20)
    return {
        "startup_ms": round(startup_ms, 2),
        "get_p50_ms": round(statistics.median(latencies), 3),
        "get_p95_ms": round(quantiles[18], 3),
        "sequential_rps": round(sequential_rps, 1),
        "concurrent_rps": round(concurrent_rps, 1),
    }


def _state(vms: int, events: int) -> dict[str, float]:
    scenario = Scenario(vms=[VmSpec(name=f"vm_{index}", placementGroupId=f"pg{index % 10}") for index in range(vms)])
    start = datetime(2026, 1, 1, tzinfo=UTC)
    state = EmulatorState(scenario, start=start)
    begin = time.perf_counter()
    for index in range(events):
        state.create_event(EventCreate(EventType="Freeze", Resources=[f"vm_{index % vms}"]), start)
    create_ms = (time.perf_counter() - begin) * 1000 / events
    begin = time.perf_counter()
    for index in range(vms):
        state.document(f"vm_{index}", "2020-07-01", start + timedelta(seconds=1))
    document_ms = (time.perf_counter() - begin) * 1000 / vms
    return {
        "vms": vms,
        "events": events,
        "create_ms_each": round(create_ms, 3),
        "document_ms_each": round(document_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m emulators.imds.bench")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps({"http": _http(args.requests, args.threads), "state": _state(200, 400)}))


if __name__ == "__main__":
    main()
