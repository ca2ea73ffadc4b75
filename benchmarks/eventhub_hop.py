"""The bare Event Hubs hop of the local pipeline: a forwarder's send to the local trigger's function call.

    .venv/bin/python -m benchmarks.eventhub_hop [--events 300] [--vms 10]

Both ends are the pipeline's own code, with nothing else running: the sender is the forwarder's sink
(``forwarder.eventhub.EventHubSink.with_credential``: a POST to the Event Hubs emulator's REST API over a kept-alive
connection, with a managed-identity token from the IMDS emulator's identity endpoint, as local/stack.py starts each
forwarder), one sink per simulated VM, each VM's envelope-sized event sent under its partition key (the VM's resource
id), one VM after another, 0.1-0.3 s apart. The receiver is the local runner's ``FunctionHost`` (local/runner.py: the
``EventHubConsumerClient`` over AMQP with checkpoints in Azurite, a thread per partition) whose function only notes
the arrival. The time from the send's start to the function's call is the hop that pipeline_latency's
``pipeline_added`` spends in Event Hubs and the trigger, without the forwarder's poll, spool and the coordinator.

Prints one JSON object: eventhub_hop_ms_p50/p99, events (sent), samples, missed, and ``problems`` (exit 1 when not
empty): a send that failed, events that never reached the function (missed) or reached it more than once, fewer
samples than asked.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import threading
import time
from typing import Any

import azure.functions as func

from benchmarks.approval_latency import percentile
from benchmarks.checks import finish, some, too_few
from emulators.azurite import Azurite
from emulators.eventhubs.emulator import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from forwarder.credential import ImdsManagedIdentityCredential
from forwarder.durable_state import SpooledEnvelope
from forwarder.eventhub import EventHubSink
from forwarder.imds import ImdsClient
from local.runner import FunctionHost
from local.stack import HUB, PARTITIONS

# What the senders' first token and the consumer's partition claims (greedy, every 2 s) take before the first timed
# send: real seconds.
SETTLE_SECONDS = 5.0
# Real seconds the last events are waited for once every event was sent.
ARRIVAL_WAIT = 10.0


def run(events: int, vms: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: dict[int, float] = {}
    duplicates: list[int] = []
    failed: list[str] = []
    lock = threading.Lock()

    def ingest(batch: list[func.EventHubEvent]) -> None:
        now = time.perf_counter()
        with lock:
            for event in batch:
                number = json.loads(event.get_body()).get("n")
                if isinstance(number, int):
                    if number in arrivals:
                        duplicates.append(number)
                    else:
                        arrivals[number] = now

    scenario = Scenario(name="eventhub-hop", vms=[VmSpec(name=f"hop_{i}") for i in range(vms)])
    with ImdsEmulator(scenario=scenario) as imds, Azurite() as storage:
        senders = {vm.resourceId for vm in imds.vms()}
        with EventHubsEmulator(hubs={HUB: PARTITIONS}, data_senders=senders) as eventhubs:
            host = FunctionHost(
                eventhub_connection_string=eventhubs.connection_string(),
                eventhub_name=HUB,
                storage_connection_string=storage.connection_string,
                ingest=ingest,
            )
            host.start()
            # One sink per VM, as each forwarder process has its own, with the VM's own token (cached per sink).
            sinks = [
                (
                    vm.resourceId.lower(),
                    EventHubSink.with_credential(
                        fully_qualified_namespace=eventhubs.rest_namespace,
                        eventhub_name=HUB,
                        credential=ImdsManagedIdentityCredential(imds=ImdsClient(base_url=imds.url_for(vm.name))),
                    ),
                )
                for vm in imds.vms()
            ]
            pad = "x" * 1500  # about an envelope's size
            sent: dict[int, float] = {}
            try:
                for key, sink in sinks:  # each sink's token and connection, before the timed sends
                    sink.send([SpooledEnvelope(-1, 0, "warm-up", b'{"n": null}')], partition_key=key)
                time.sleep(SETTLE_SECONDS)
                for number in range(events):
                    key, sink = sinks[number % len(sinks)]
                    body = json.dumps({"n": number, "pad": pad}).encode()
                    sent[number] = time.perf_counter()
                    try:
                        sink.send([SpooledEnvelope(number, number, "incarnation", body)], partition_key=key)
                    except Exception as error:  # a send the hub refused: named, not timed
                        failed.append(f"{number}: {type(error).__name__}: {str(error)[:200]}")
                        del sent[number]
                    time.sleep(rng.uniform(0.1, 0.3))
                deadline = time.monotonic() + ARRIVAL_WAIT
                while len(arrivals) < events and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                for _, sink in sinks:
                    sink.close()
                host.stop()
    return judge(sent, arrivals, events=events, vms=vms, duplicates=duplicates, failed=failed)


def judge(
    sent: dict[int, float],
    arrivals: dict[int, float],
    *,
    events: int,
    vms: int,
    duplicates: list[int],
    failed: list[str],
) -> dict[str, Any]:
    """The figures, and what the run recorded against them."""
    samples = [(arrivals[n] - sent[n]) * 1000 for n in sent if n in arrivals]
    missed = sorted(set(sent) - set(arrivals))
    problems: list[str] = []
    if failed:
        problems.append(f"{len(failed)} sends failed: {some(failed)}")
    if missed:
        problems.append(f"{len(missed)} events sent never reached the function: {some(str(n) for n in missed)}")
    if duplicates:
        problems.append(f"{len(duplicates)} events reached the function more than once")
    problems += too_few("events", len(samples), events)
    result: dict[str, Any] = {"events": events, "samples": len(samples), "missed": len(missed), "vms": vms}
    if samples:
        result["eventhub_hop_ms_p50"] = round(percentile(samples, 0.5), 2)
        result["eventhub_hop_ms_p99"] = round(percentile(samples, 0.99), 2)
    return result | {"problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eventhub_hop", description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--vms", type=int, default=10, help="simulated VMs, one sink (and token) each")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    return finish(lambda: run(args.events, args.vms, args.seed))


if __name__ == "__main__":
    raise SystemExit(main())
