"""Steady-state footprint of the on-VM forwarder: RSS and CPU time of a real `python -m forwarder run` process
polling the IMDS emulator once a second and sending to the Event Hubs emulator over AMQP with an Entra token from
the VM's managed identity, its relay listener on demand against the Relay emulator (the production configuration,
but plain AMQP and WebSocket on loopback instead of TLS) — side by side, in the same run, with a bare poller
(benchmarks/bare_poller.py: `requests` polling the same emulator once a second), the baseline of the ratios.

    .venv/bin/python -m benchmarks.forwarder_footprint [--seconds 120] [--warmup 10] [--sink eventhub|stdout]
        [--auth imds|azure-identity|connection-string] [--event-every N] [--tracing off|on|both]

Prints one JSON object: {forwarder_rss_mib, forwarder_cpu_s_per_hour, bare_poller_rss_mib,
bare_poller_cpu_s_per_hour, forwarder_rss_ratio_to_bare_poller, forwarder_cpu_ratio_to_bare_poller, polls, ...}
(ratios of the peak RSS and of the CPU time; targets <= 1.35 and <= 0.5). With --tracing on the forwarder
records its spans (`telemetry_spans_file`, which loads the OpenTelemetry SDK); with --tracing both it runs twice,
off then on, one after the other, and adds `*_tracing` figures and `tracing_rss_cost_mib` (what recording costs).
Targets: RSS <= 48 MiB and <= 2 CPU-seconds per hour at 1 poll/s. CPU is counted after the warm-up (imports, first
connections). With --event-every N an event is scheduled every N s, so that the change path (spool write, send,
hook report) is measured too; heartbeats (every 60 s) are always part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="measured time after the warm-up")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--sink", choices=("eventhub", "stdout"), default="eventhub")
    parser.add_argument(
        "--auth",
        choices=("imds", "azure-identity", "connection-string"),
        default="imds",
        help="Event Hubs auth: the managed identity via the forwarder's IMDS credential (the default, as in "
        "production), via azure-identity's ManagedIdentityCredential, or a SAS connection string",
    )
    parser.add_argument("--event-every", type=float, default=0.0, help="schedule an event every N s (0: none)")
    parser.add_argument(
        "--tracing",
        choices=("off", "on", "both"),
        default="off",
        help="record spans to a file (on), not (off, the default), or measure both one after the other",
    )
    args = parser.parse_args()

    if args.tracing != "both":
        print(json.dumps(measure(args, tracing=args.tracing == "on")))
        return
    off = measure(args, tracing=False)
    on = measure(args, tracing=True)
    figures = (
        "forwarder_rss_mib",
        "forwarder_rss_mib_median",
        "forwarder_cpu_s_per_hour",
        "spans_recorded",
        "forwarder_rss_ratio_to_bare_poller",
        "forwarder_cpu_ratio_to_bare_poller",
    )
    result = {**off, **{f"{key}_tracing": on[key] for key in figures}}
    result["tracing_rss_cost_mib"] = round(on["forwarder_rss_mib"] - off["forwarder_rss_mib"], 1)
    result["tracing_cpu_cost_s_per_hour"] = round(on["forwarder_cpu_s_per_hour"] - off["forwarder_cpu_s_per_hour"], 2)
    print(json.dumps(result))


def measure(args: argparse.Namespace, *, tracing: bool) -> dict[str, Any]:  # noqa: PLR0915 - one run, in order
    relay = RelayEmulator()
    relay.start()
    with tempfile.TemporaryDirectory() as scratch, ImdsEmulator(time_scale=60) as imds, EventHubsEmulator() as hubs:
        vm = imds.first_vm
        spans_file = Path(scratch) / "state" / "spans.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
        env.update(
            SE_FORWARDER_IMDS_URL=imds.url_for(vm),
            SE_FORWARDER_STATE_DIR=str(Path(scratch) / "state"),
            SE_FORWARDER_HOOKS_DIR=str(Path(scratch) / "hooks"),
            SE_FORWARDER_SINK=args.sink,
            SE_FORWARDER_RELAY_ENABLED="true",  # on demand (the default): connected only while an event is pending
            SE_FORWARDER_RELAY_ENDPOINT=relay.base_url.replace("http://", "ws://", 1),
        )
        if tracing:
            env["SE_FORWARDER_TELEMETRY_SPANS_FILE"] = str(spans_file)
        if args.auth == "connection-string":
            env["SE_FORWARDER_EVENTHUB_CONNECTION_STRING"] = hubs.connection_string("scheduled-events")
        else:
            env.update(
                SE_FORWARDER_EVENTHUB_NAMESPACE=f"127.0.0.1:{hubs.port}",
                SE_FORWARDER_EVENTHUB_NAME="scheduled-events",
                SE_FORWARDER_EVENTHUB_USE_TLS="false",
                SE_FORWARDER_CREDENTIAL=args.auth,
                **imds.identity_environment(vm),  # azure-identity's token endpoint: the emulator's
            )
        process = subprocess.Popen(
            [sys.executable, "-m", "forwarder", "run"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        bare = subprocess.Popen(
            # Another VM of the same emulator, so that `polls` counts the forwarder's alone.
            [sys.executable, str(ROOT / "benchmarks" / "bare_poller.py"), imds.url_for(list(imds.state.vms)[-1])],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(args.warmup)
            polls_before = imds.requests_served[vm]
            cpu_before = cpu_seconds(process.pid)
            bare_before = cpu_seconds(bare.pid)
            started = time.monotonic()
            samples: list[float] = []
            bare_samples: list[float] = []
            next_event = started
            while (elapsed := time.monotonic() - started) < args.seconds:
                if process.poll() is not None:
                    raise SystemExit(f"the forwarder exited with {process.returncode}")
                if args.event_every and time.monotonic() >= next_event:
                    imds.create_event(EventType="Freeze", Resources=[vm], NoticeSeconds=60)
                    next_event += args.event_every
                if bare.poll() is not None:
                    raise SystemExit(f"the bare poller exited with {bare.returncode}")
                samples.append(rss_mib(process.pid))
                bare_samples.append(rss_mib(bare.pid))
                time.sleep(1.0)
            user_after, system_after = cpu_seconds(process.pid)
            bare_after = cpu_seconds(bare.pid)
            user, system = user_after - cpu_before[0], system_after - cpu_before[1]
            bare_cpu = sum(bare_after) - sum(bare_before)
            polls = imds.requests_served[vm] - polls_before
        finally:
            process.terminate()
            bare.terminate()
            process.wait(15)
            bare.wait(15)
            relay.stop()
        delivered = len(hubs.all_events("scheduled-events"))
        spans = len(spans_file.read_text().splitlines()) if spans_file.exists() else 0
    cpu_per_hour = (user + system) / elapsed * 3600
    bare_per_hour = bare_cpu / elapsed * 3600
    return {
        "forwarder_rss_ratio_to_bare_poller": round(max(samples) / max(bare_samples), 2),
        "forwarder_cpu_ratio_to_bare_poller": round(cpu_per_hour / bare_per_hour, 2) if bare_cpu else None,
        "bare_poller_rss_mib": round(max(bare_samples), 1),
        "bare_poller_cpu_s_per_hour": round(bare_per_hour, 2),
        "forwarder_rss_mib": round(max(samples), 1),
        "forwarder_rss_mib_median": round(statistics.median(samples), 1),
        "forwarder_cpu_s_per_hour": round(cpu_per_hour, 2),
        "forwarder_user_s_per_hour": round(user / elapsed * 3600, 2),
        "forwarder_system_s_per_hour": round(system / elapsed * 3600, 2),
        "polls": polls,
        "polls_per_s": round(polls / elapsed, 2),
        "seconds": round(elapsed, 1),
        "sink": args.sink,
        "auth": args.auth if args.sink == "eventhub" else None,
        "event_every_s": args.event_every,
        "envelopes_delivered": delivered if args.sink == "eventhub" else None,
        "exit_code_after_sigterm": process.returncode,
        "tracing": tracing,
        "spans_recorded": spans,
    }


if __name__ == "__main__":
    main()
