"""The bare Event Hubs hop of the local pipeline: a forwarder's send to the local trigger's batch callback.

    .venv/bin/python -m benchmarks.eventhub_hop [--events 300]

The Event Hubs emulator with the local stack's partitions; a producer sends each envelope-sized event as the forwarder
does (``create_batch(partition_key=<the VM's resource id>)``, ``send_batch``), one VM after another, 0.1-0.3 s apart;
a consumer configured as the local runner's (``local/runner.py``: greedy load balancing every 2 s, a 5 ms socket
timeout, no ``max_wait_time``, batches of up to 100) receives them. The time from the send's start to the batch
callback is the hop that pipeline_latency's ``pipeline_added`` spends in Event Hubs, with nothing else on it.

Prints one JSON object: eventhub_hop_ms_p50/p99, events.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import threading
import time
from typing import Any

from azure.eventhub import EventData, EventHubConsumerClient, EventHubProducerClient, PartitionContext

from benchmarks.approval_latency import percentile
from emulators.eventhubs.emulator import EventHubsEmulator
from local.stack import HUB, PARTITIONS


def run(events: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: dict[int, float] = {}
    attached = threading.Event()

    def on_batch(_context: PartitionContext, batch: list[EventData]) -> None:
        attached.set()
        now = time.perf_counter()
        for event in batch:
            arrivals[int((event.properties or {})[b"n"])] = now

    with EventHubsEmulator(hubs={HUB: PARTITIONS}) as emulator:
        consumer = EventHubConsumerClient.from_connection_string(
            emulator.connection_string(HUB),
            consumer_group="$Default",
            socket_timeout=0.005,
            load_balancing_strategy="greedy",
            load_balancing_interval=2.0,
        )
        thread = threading.Thread(
            target=consumer.receive_batch,
            kwargs={"on_event_batch": on_batch, "max_batch_size": 100, "starting_position": "@latest"},
            daemon=True,
        )
        thread.start()
        sent: dict[int, float] = {}
        body = json.dumps({"schema": "scheduled-events.envelope/1", "pad": "x" * 1500})
        with EventHubProducerClient.from_connection_string(emulator.connection_string(HUB)) as producer:
            warm = producer.create_batch(partition_key="warm-up")
            warm.add(EventData("warm-up"))
            producer.send_batch(warm)
            time.sleep(5.0)  # the consumer claims every partition (greedy, every 2 s) before the first is sent
            for number in range(events):
                batch = producer.create_batch(partition_key=f"/subscriptions/s/virtualmachines/vm-{number % 10}")
                event = EventData(body)
                event.properties = {"n": number}
                batch.add(event)
                sent[number] = time.perf_counter()
                producer.send_batch(batch)
                time.sleep(rng.uniform(0.1, 0.3))
        deadline = time.monotonic() + 10
        while len(arrivals) < events and time.monotonic() < deadline:
            time.sleep(0.01)
        consumer.close()
        thread.join(10)
    samples = [(arrivals[n] - sent[n]) * 1000 for n in sent if n in arrivals]
    if not samples:
        raise RuntimeError("no event arrived")
    return {
        "eventhub_hop_ms_p50": round(percentile(samples, 0.5), 2),
        "eventhub_hop_ms_p99": round(percentile(samples, 0.99), 2),
        "events": len(samples),
        "missed": events - len(samples),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eventhub_hop", description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    print(json.dumps(run(args.events, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
