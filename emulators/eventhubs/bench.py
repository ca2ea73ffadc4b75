"""``python -m emulators.eventhubs.bench``: figures for the Event Hubs emulator, printed as one JSON object.

With the real azure-eventhub clients over AMQP on loopback: batch send throughput (1 KiB envelopes, partition key
per VM), single ``send_event`` latency on an open producer, send → ``receive_batch`` callback latency, the time
for a stopped emulator to serve again on the same port, the on-disk log's size per event, and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from azure.eventhub import EventData, PartitionContext

from emulators.eventhubs.clients import consumer_client, producer_client
from emulators.eventhubs.emulator import EventHubsEmulator

HUB = "scheduled-events"
FAST: dict[str, Any] = {"retry_total": 3, "retry_backoff_factor": 0.05, "retry_backoff_max": 0.2}


def _payload(number: int) -> str:
    return json.dumps({"schema": "scheduled-events.envelope/1", "sequence": number, "pad": "x" * 960})


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _throughput(emulator: EventHubsEmulator, *, events: int, batch_size: int) -> dict[str, float]:
    with producer_client(emulator.connection_string(HUB), **FAST) as producer:
        producer.send_batch([EventData("warm-up")], partition_key="vm-warm")
        started = time.perf_counter()
        for start in range(0, events, batch_size):
            vm = f"vm-{start // batch_size % 50}"
            producer.send_batch(
                [EventData(_payload(n)) for n in range(start, min(events, start + batch_size))], partition_key=vm
            )
        elapsed = time.perf_counter() - started
    return {"events": events, "batch_size": batch_size, "seconds": round(elapsed, 3), "events_per_s": events / elapsed}


def _send_latency(emulator: EventHubsEmulator, *, sends: int) -> dict[str, float]:
    with producer_client(emulator.connection_string(HUB), **FAST) as producer:
        producer.send_event(EventData("warm-up"), partition_key="vm-0")
        samples = []
        for number in range(sends):
            started = time.perf_counter()
            producer.send_event(EventData(_payload(number)), partition_key="vm-0")
            samples.append((time.perf_counter() - started) * 1000)
    return {"sends": sends, "p50_ms": statistics.median(samples), "p95_ms": _percentile(samples, 0.95)}


def _end_to_end(emulator: EventHubsEmulator, *, sends: int, socket_timeout: float | None) -> dict[str, float]:
    """Events spaced 0.3 s apart, as a VM's are. pyamqp keeps reading frames until its socket read times out
    (``socket_timeout``, 0.2 s by default) before it hands a batch over, so that timeout sets the figure."""
    arrivals: dict[int, float] = {}
    attached = threading.Event()

    def on_batch(context: PartitionContext, events: list[EventData]) -> None:
        attached.set()
        now = time.perf_counter()
        for event in events:
            arrivals[int((event.properties or {})[b"n"])] = now

    options = dict(FAST) if socket_timeout is None else {**FAST, "socket_timeout": socket_timeout}
    consumer = consumer_client(emulator.connection_string(HUB), consumer_group="$Default", **options)
    thread = threading.Thread(
        target=consumer.receive_batch,
        kwargs={"on_event_batch": on_batch, "partition_id": "0", "starting_position": "@latest", "max_wait_time": 0.1},
        daemon=True,
    )
    thread.start()
    attached.wait(10)  # the first (empty) batch callback means the receiver is attached
    sent: dict[int, float] = {}
    with producer_client(emulator.connection_string(HUB), **FAST) as producer:
        for number in range(sends):
            event = EventData(_payload(number))
            event.properties = {"n": number}
            sent[number] = time.perf_counter()
            producer.send_event(event, partition_id="0")
            time.sleep(0.3)
    deadline = time.monotonic() + 10
    while len(arrivals) < sends and time.monotonic() < deadline:
        time.sleep(0.01)
    consumer.close()
    thread.join(10)
    samples = [(arrivals[n] - sent[n]) * 1000 for n in sent if n in arrivals]
    return {
        "sends": sends,
        "socket_timeout_s": socket_timeout or 0.2,
        "received": len(samples),
        "p50_ms": statistics.median(samples) if samples else -1.0,
        "p95_ms": _percentile(samples, 0.95) if samples else -1.0,
    }


def _restart(emulator: EventHubsEmulator) -> dict[str, float]:
    port = emulator.port
    started = time.perf_counter()
    emulator.stop()
    stopped = time.perf_counter()
    emulator.start()
    restarted = time.perf_counter()
    return {"same_port": float(emulator.port == port), "stop_ms": (stopped - started) * 1000,
            "start_ms": (restarted - stopped) * 1000}  # fmt: skip


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulators.eventhubs.bench", description=__doc__)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--sends", type=int, default=200)
    parser.add_argument("--spaced", type=int, default=15, help="events for the send→receive latency (0.3 s apart)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as data_dir:
        with EventHubsEmulator(hubs={HUB: 4}, data_dir=data_dir) as emulator:
            figures: dict[str, Any] = {
                "batch_send_disk": _throughput(emulator, events=args.events, batch_size=args.batch_size),
                "send_event_latency": _send_latency(emulator, sends=args.sends),
                "send_to_receive_latency": _end_to_end(emulator, sends=args.spaced, socket_timeout=None),
                "send_to_receive_latency_fast_socket": _end_to_end(emulator, sends=args.spaced, socket_timeout=0.02),
                "restart": _restart(emulator),
            }
            stored = sum(len(emulator.all_events(hub)) for hub in emulator.hubs)
        log_bytes = sum(path.stat().st_size for path in Path(data_dir).rglob("*.log"))
        figures["disk"] = {"events": stored, "bytes": log_bytes, "bytes_per_event": log_bytes / max(stored, 1)}
    with EventHubsEmulator(hubs={HUB: 4}) as emulator:
        figures["batch_send_memory"] = _throughput(emulator, events=args.events, batch_size=args.batch_size)
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(_rounded(figures), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
