"""``python -m emulators.relay.bench``: figures for the Relay emulator, printed as one JSON object.

Round-trip latency of small HTTP requests relayed to a raw listener over the control channel, throughput with
concurrent senders, a 1 MiB request through rendezvous, and the process's peak RSS with 25 listeners connected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from websockets.asyncio.client import ClientConnection, connect

from emulators.relay.auth import create_sas_token
from emulators.relay.emulator import RelayEmulator

KEY_NAME, KEY = "bench", "bench-key-not-a-secret"


async def _answer(channel: ClientConnection, request: dict[str, object]) -> None:
    body = await channel.recv() if request.get("body") else b""
    response = {"requestId": request["id"], "statusCode": 200, "responseHeaders": {}, "body": True}
    await channel.send(json.dumps({"response": response}))
    await channel.send(str(len(body)).encode())


async def _rendezvous(address: str) -> None:
    """Serves every request of one sender connection that arrives on its rendezvous socket."""
    async with connect(address, max_size=None) as channel:
        async for frame in channel:
            if isinstance(frame, str):
                await _answer(channel, json.loads(frame)["request"])


async def _echo(ws: ClientConnection) -> None:
    """A raw listener: answers every request with the size of its body, on rendezvous when asked to."""
    tasks = set()
    async for frame in ws:
        if not isinstance(frame, str):
            continue
        request = json.loads(frame)["request"]
        if "method" in request:
            await _answer(ws, request)
        else:
            task = asyncio.create_task(_rendezvous(request["address"]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


def _listeners(relay: RelayEmulator, count: int, ready: threading.Event, stop: threading.Event) -> None:
    async def run() -> None:
        token = create_sas_token(relay.resource_uri("bench"), key_name=KEY_NAME, key=KEY)
        sockets = [
            await connect(relay.listen_url("bench"), additional_headers={"ServiceBusAuthorization": token})
            for _ in range(count)
        ]
        tasks = [asyncio.create_task(_echo(ws)) for ws in sockets]
        ready.set()
        await asyncio.to_thread(stop.wait)
        for task in tasks:
            task.cancel()
        for ws in sockets:
            await ws.close()

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m emulators.relay.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential small requests (default 300)")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel senders for throughput (default 8)")
    arguments = parser.parse_args()

    with RelayEmulator(sas_keys={KEY_NAME: KEY}) as relay:
        ready, stop = threading.Event(), threading.Event()
        thread = threading.Thread(target=_listeners, args=(relay, 25, ready, stop), daemon=True)
        thread.start()
        ready.wait(30)
        url = relay.send_url("bench") + "/approve"
        headers = {"ServiceBusAuthorization": create_sas_token(relay.resource_uri("bench"), key_name=KEY_NAME, key=KEY)}
        session = requests.Session()

        latencies = []
        for _ in range(arguments.requests):
            started = time.perf_counter()
            session.post(url, data=b'{"EventId":"E1"}', headers=headers, timeout=30).raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000)

        total = arguments.requests
        started = time.perf_counter()
        with ThreadPoolExecutor(arguments.concurrency) as pool:
            statuses = list(
                pool.map(lambda _: requests.post(url, data=b"x", headers=headers, timeout=30).status_code, range(total))
            )
        throughput = total / (time.perf_counter() - started)

        payload = b"z" * (1024 * 1024)
        started = time.perf_counter()
        echoed = session.put(url, data=payload, headers=headers, timeout=30)
        rendezvous_ms = (time.perf_counter() - started) * 1000

        stop.set()
        thread.join(10)
        figures = {
            "listeners": 25,
            "small_request_round_trip_ms": {
                "n": len(latencies),
                "p50": round(statistics.median(latencies), 2),
                "p95": round(statistics.quantiles(latencies, n=20)[-1], 2),
            },
            "throughput_requests_per_s": {"concurrency": arguments.concurrency, "value": round(throughput, 1)},
            "all_ok": all(status == 200 for status in statuses) and echoed.text == str(len(payload)),
            "one_mib_request_via_rendezvous_ms": round(rendezvous_ms, 1),
            "peak_rss_mib_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "counters": relay.counters(),
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
