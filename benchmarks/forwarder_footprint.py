"""Steady-state footprint of the on-VM forwarder: RSS and CPU time of real `python -m forwarder run` processes
polling the IMDS emulator once a second and sending to the Event Hubs emulator through its REST API with an Entra
token from the VM's managed identity (HTTPS, and WSS to the Relay, with the emulators' local CA: emulators/tls.py),
each with its relay listener against the Relay emulator — side by side, in one run, with a bare poller
(benchmarks/bare_poller.py: `requests` polling the same emulator once a second and posting each new document and a
heartbeat a minute to the same Event Hubs REST endpoint over TLS), the baseline of the ratios.

    .venv/bin/python -m benchmarks.forwarder_footprint [--seconds 120] [--warmup 10] [--sink eventhub|stdout]
        [--auth imds|connection-string] [--event-every N]
        [--only all|production|tracing|connected|tracing_connected] [--source CHECKOUT]

The forwarders run as installed, so that the figures are what ships: ``forwarder/install.sh --root SCRATCH
--skip-venv`` (of ``--source``, this checkout by default; another checkout's to measure it the same way) lays out
``opt/scheduled-events-forwarder/app`` with the byte code it leaves (or not), and each forwarder runs as the
systemd unit runs it: the unit's ``ExecStart`` (``python -m forwarder run --config`` the settings file install.sh
wrote: ``unit_command``) from that folder, the app alone on PYTHONPATH,
PYTHONDONTWRITEBYTECODE=1 (this interpreter and its packages stand in for the VM's venv).

Four forwarders run at once (`--only` picks one), one per configuration, each on its own VM of the emulator:
production (tracing off, listener on demand and idle), `_tracing` (spans recorded in `telemetry_spans_file`),
`_connected` (listener always on: its WebSocket client and the listener loaded, connected) and `_tracing_connected`.
Prints one JSON object: per configuration `forwarder_rss_mib{suffix}`, `forwarder_cpu_s_per_hour{suffix}`,
`forwarder_rss_ratio_to_bare_poller{suffix}`, `forwarder_cpu_ratio_to_bare_poller{suffix}` (ratios of the peak RSS
and of the CPU time: the scheduler's count of each thread's run time, ``CpuMeter``; the user/system split beside it
in clock ticks) and `forwarder_threads_ended{suffix}`, and the headline `forwarder_rss_ratio_to_bare_poller` /
`forwarder_cpu_ratio_to_bare_poller`: the worst configuration's (targets <= 1.0 and <= 0.5), with
`tracing_rss_cost_mib` and `listener_rss_cost_mib`. CPU is counted after the warm-up (imports, first connections).
With --event-every N an event is scheduled every N s on each forwarder's VM, so that the change path (spool write,
send, hook report) is measured too; heartbeats (every 60 s) are always part of it.

``listener_modes`` says each configuration's listener ("on-demand" and idle, or "connected"), and ``problems`` (exit
1 when not empty) names what keeps the run from being what it claims: a forwarder or the bare poller exiting, not
polling once a second, a listener in another mode than its configuration's (an idle one connected, a connected one
not connected at a sample), a forwarder whose envelopes did not reach Event Hubs, a traced configuration that
recorded no span (or an untraced one that did), a forwarder not exiting 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.checks import finish
from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.vm_models import VmSpec
from emulators.relay import RelayEmulator

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, in clock ticks: the split only (``CpuMeter`` counts the total)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each live thread's CPU time, in ns: the scheduler's own count (/proc/PID/task/TID/schedstat)."""
    times: dict[int, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                times[int(task)] = int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return times


class CpuMeter:
    """A process's CPU time over a window, to the nanosecond: the sum over its threads of their scheduler run time
    since the window began (a thread born in it: its whole life), sampled each second (``sample``), so that a thread
    that ends in the window counts up to its last sample (``ended`` says how many did).

    Why not /proc/PID/stat: it counts in clock ticks (10 ms). An idle forwarder uses 2-16 CPU-s an hour, 7-54 ticks in
    the 120 s window, so one tick more or less moved a ratio by up to 14%: two runs side by side on a quiet machine
    read 2.0 and 2.4 CPU-s/h for configurations whose threads' schedstat differed by 10%."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._start = thread_cpu_ns(pid)
        self._last = dict(self._start)
        self._ended: set[int] = set()

    def sample(self) -> None:
        now = thread_cpu_ns(self._pid)
        self._ended.update(tid for tid in self._last if tid not in now)
        self._last.update(now)

    @property
    def ended(self) -> int:
        return len(self._ended)

    def seconds(self) -> float:
        return sum(ns - self._start.get(tid, 0) for tid, ns in self._last.items()) / 1e9


# The forwarder's relay_listener_mode for each configuration's listener (tests change it to break a run).
LISTENER_MODES = {"idle": "on-demand", "connected": "always-on"}
CONFIGURATIONS = {
    # suffix of the figures: (tracing, listener)
    "": (False, "idle"),
    "_tracing": (True, "idle"),
    "_connected": (False, "connected"),
    "_tracing_connected": (True, "connected"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.forwarder_footprint", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=120.0, help="measured time after the warm-up")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--sink", choices=("eventhub", "stdout"), default="eventhub")
    parser.add_argument(
        "--auth",
        choices=("imds", "connection-string"),
        default="imds",
        help="Event Hubs auth: the managed identity's token from IMDS (the default, as in production) or a SAS key",
    )
    parser.add_argument("--event-every", type=float, default=0.0, help="schedule an event every N s (0: none)")
    parser.add_argument(
        "--source", type=Path, default=ROOT, help="the checkout whose forwarder/install.sh installs what is measured"
    )
    parser.add_argument(
        "--only",
        choices=("all", *(suffix.strip("_") or "production" for suffix in CONFIGURATIONS)),
        default="all",
        help="run one configuration (default: all four side by side, in one run)",
    )
    args = parser.parse_args(argv)
    chosen = {
        suffix: config
        for suffix, config in CONFIGURATIONS.items()
        if args.only in ("all", suffix.strip("_") or "production")
    }
    return finish(lambda: measure(args, chosen))


def _env(base: dict[str, str], **values: str) -> dict[str, str]:
    return {**{k: v for k, v in base.items() if not k.startswith("SE_FORWARDER_")}, **values}


def install(source: Path, scratch: Path) -> Path:
    """The forwarder as ``source``'s install.sh lays it out under ``scratch`` (its settings file too): its app
    folder."""
    subprocess.run(
        ["bash", str(source / "forwarder" / "install.sh"), "--root", str(scratch), "--skip-venv",
         "--eventhub-namespace", "footprint.invalid"],
        check=True, capture_output=True, env={"PATH": os.environ.get("PATH", ""), "PYTHON": sys.executable},
    )  # fmt: skip
    return scratch / "opt" / "scheduled-events-forwarder" / "app"


def unit_command(app: Path) -> list[str]:
    """The installed unit's ``ExecStart`` under the install's root: this interpreter for the venv's, and every
    absolute path the unit names (its ``--config`` above all: the settings file install.sh wrote, which the
    daemon reads at start) under the root. So the run loads what a VM's daemon loads."""
    root = app.parents[2]
    unit = root / "etc" / "systemd" / "system" / "scheduled-events-forwarder.service"
    line = next(ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart="))
    python, *arguments = line.removeprefix("ExecStart=").split()
    if not python.endswith("/bin/python"):
        raise RuntimeError(f"{unit}: ExecStart does not start with the venv's python: {line}")
    return [sys.executable, *(f"{root}{a}" if a.startswith("/") else a for a in arguments)]


def _start(app: Path, env: dict[str, str], auth: str, hubs: EventHubsEmulator) -> subprocess.Popen[bytes]:
    """A forwarder as the unit runs it (forwarder/systemd): its command line and settings file, from the installed
    app alone, no byte code written (SE_FORWARDER_* point it at the emulators, as forwarder.env may on a VM)."""
    env = {**env, "PYTHONPATH": str(app), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    if auth == "connection-string":
        env["SE_FORWARDER_EVENTHUB_CONNECTION_STRING"] = hubs.rest_connection_string("scheduled-events")
    else:
        env.update(
            SE_FORWARDER_EVENTHUB_NAMESPACE=hubs.rest_namespace,
            SE_FORWARDER_EVENTHUB_NAME="scheduled-events",
        )
    return subprocess.Popen(
        unit_command(app),
        cwd=app.parent,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


# One VM per configuration, and the bare poller's.
FLEET = Scenario(name="footprint", vms=[VmSpec(name=f"vm_{i}", vmScaleSetName="vm") for i in range(5)])


def measure(args: argparse.Namespace, configurations: dict[str, tuple[bool, str]]) -> dict[str, Any]:  # noqa: PLR0912, PLR0915 - one run, in order
    problems: list[str] = []
    relay = RelayEmulator()
    relay.start()
    imds_emulator = ImdsEmulator(scenario=FLEET, time_scale=60)
    with tempfile.TemporaryDirectory() as scratch, imds_emulator as imds, EventHubsEmulator() as hubs:
        app = install(getattr(args, "source", ROOT), Path(scratch) / "root")
        vms = list(imds.state.vms)
        processes: dict[str, subprocess.Popen[bytes]] = {}
        spans_files: dict[str, Path] = {}
        for (suffix, (tracing, listener)), vm in zip(configurations.items(), vms, strict=False):
            home = Path(scratch) / (suffix.strip("_") or "production")
            env = _env(
                dict(os.environ),
                SE_FORWARDER_IMDS_URL=imds.url_for(vm),
                SE_FORWARDER_STATE_DIR=str(home / "state"),
                SE_FORWARDER_HOOKS_DIR=str(home / "hooks"),
                SE_FORWARDER_SINK=args.sink,
                SE_FORWARDER_RELAY_ENABLED="true",
                SE_FORWARDER_RELAY_ENDPOINT=relay.ws_url,
                # idle: on demand (the default), never connected without an event; connected: for the daemon's life.
                SE_FORWARDER_RELAY_LISTENER_MODE=LISTENER_MODES[listener],
            )
            if tracing:
                spans_files[suffix] = home / "state" / "spans.jsonl"
                env["SE_FORWARDER_TELEMETRY_SPANS_FILE"] = str(spans_files[suffix])
            processes[suffix] = _start(app, env, args.auth, hubs)
        bare = _bare_poller(imds.url_for(vms[-1]), hubs)
        polled = dict(zip(configurations, vms, strict=False))
        hybrid = {suffix: f"vm-{imds.state.vms[vm].vmId.lower()}" for suffix, vm in polled.items()}
        wrong_mode: dict[str, int] = {}
        try:
            time.sleep(args.warmup)
            if _exited(processes, bare, problems, when="during the warm-up"):
                return {"problems": problems}
            polls_before = {suffix: imds.requests_served[vm] for suffix, vm in polled.items()}
            cpu_before = {suffix: cpu_seconds(p.pid) for suffix, p in processes.items()}
            meters = {suffix: CpuMeter(p.pid) for suffix, p in processes.items()}
            bare_meter = CpuMeter(bare.pid)
            started = time.monotonic()
            samples: dict[str, list[float]] = {suffix: [] for suffix in processes}
            bare_samples: list[float] = []
            next_event = started
            while (elapsed := time.monotonic() - started) < args.seconds:
                if _exited(processes, bare, problems, when="during the measurement"):
                    return {"problems": problems}
                for suffix, process in processes.items():
                    samples[suffix].append(rss_mib(process.pid))
                    connected = relay.listener_count(hybrid[suffix]) > 0
                    # An on-demand listener connects for an event: with --event-every only the connected are checked.
                    if connected != (configurations[suffix][1] == "connected") and (connected or not args.event_every):
                        wrong_mode[suffix] = wrong_mode.get(suffix, 0) + 1
                if args.event_every and time.monotonic() >= next_event:
                    for vm in polled.values():
                        imds.create_event(EventType="Freeze", Resources=[vm], NoticeSeconds=60)
                    next_event += args.event_every
                bare_samples.append(rss_mib(bare.pid))
                for meter in (*meters.values(), bare_meter):
                    meter.sample()
                time.sleep(1.0)
            for meter in (*meters.values(), bare_meter):
                meter.sample()
            cpu_after = {suffix: cpu_seconds(p.pid) for suffix, p in processes.items()}
            bare_cpu = bare_meter.seconds()
            polls = {suffix: imds.requests_served[vm] - polls_before[suffix] for suffix, vm in polled.items()}
        finally:
            for process in (*processes.values(), bare):
                process.terminate()
            for process in (*processes.values(), bare):
                process.wait(15)
            relay.stop()
        stored = hubs.all_events("scheduled-events")
        delivered = sum(1 for event in stored if event.partition_key)  # the bare poller's have none
        keys = {str(event.partition_key or "").lower() for event in stored}
        silent = [
            s.strip("_") or "production"
            for s, vm in polled.items()
            if imds.state.vms[vm].resourceId.lower() not in keys
        ]
        spans = {s: len(f.read_text().splitlines()) if f.exists() else 0 for s, f in spans_files.items()}
        untraced = [home for home in Path(scratch).iterdir() if (home / "state" / "spans.jsonl").exists()]
    bare_per_hour = bare_cpu / elapsed * 3600
    result: dict[str, Any] = {
        "bare_poller_rss_mib": round(max(bare_samples), 1),
        "bare_poller_cpu_s_per_hour": round(bare_per_hour, 2),
        "seconds": round(elapsed, 1),
        "sink": args.sink,
        "auth": args.auth if args.sink == "eventhub" else None,
        "event_every_s": args.event_every,
        "envelopes_delivered": delivered if args.sink == "eventhub" else None,
        "exit_codes_after_sigterm": {s.strip("_") or "production": p.returncode for s, p in processes.items()},
        "listener_modes": {
            s.strip("_") or "production": "connected" if listener == "connected" else "on-demand"
            for s, (_, listener) in configurations.items()
        },
    }
    for suffix, count in wrong_mode.items():
        claimed = configurations[suffix][1]
        problems.append(
            f"forwarder{suffix or '_production'}: its listener was {'not ' if claimed == 'connected' else ''}connected "
            f"at {count} of {len(samples[suffix])} samples, though its configuration's is {claimed}"
        )
    if args.sink == "eventhub" and silent:
        problems.append(f"no envelope of {', '.join(silent)} reached Event Hubs")
    for suffix, process in processes.items():
        name = suffix.strip("_") or "production"
        if process.returncode != 0:
            problems.append(f"forwarder {name} exited {process.returncode} on SIGTERM, not 0")
        rate = polls[suffix] / elapsed
        if not 0.8 <= rate <= 1.2:
            problems.append(f"forwarder {name} polled {rate:.2f} times a second, not once")
        if configurations[suffix][0] and not spans.get(suffix):
            problems.append(f"forwarder {name} is traced but recorded no span")
    traced_homes = {(s.strip("_") or "production") for s, (tracing, _) in configurations.items() if tracing}
    stray = [home.name for home in untraced if home.name not in traced_homes]
    if stray:
        problems.append(f"untraced forwarders recorded spans: {', '.join(stray)}")
    for suffix in processes:
        # The headline ratios (below) are the worst configuration's; each configuration's own carry its suffix.
        ratio = suffix or "_production"
        user = cpu_after[suffix][0] - cpu_before[suffix][0]
        system = cpu_after[suffix][1] - cpu_before[suffix][1]
        per_hour = meters[suffix].seconds() / elapsed * 3600
        result.update(
            {
                f"forwarder_rss_mib{suffix}": round(max(samples[suffix]), 1),
                f"forwarder_rss_mib_median{suffix}": round(statistics.median(samples[suffix]), 1),
                f"forwarder_cpu_s_per_hour{suffix}": round(per_hour, 2),
                f"forwarder_user_s_per_hour{suffix}": round(user / elapsed * 3600, 2),
                f"forwarder_system_s_per_hour{suffix}": round(system / elapsed * 3600, 2),
                f"forwarder_threads_ended{suffix}": meters[suffix].ended,
                f"forwarder_rss_ratio_to_bare_poller{ratio}": round(max(samples[suffix]) / max(bare_samples), 2),
                f"forwarder_cpu_ratio_to_bare_poller{ratio}": round(per_hour / bare_per_hour, 2) if bare_cpu else None,
                f"polls_per_s{suffix}": round(polls[suffix] / elapsed, 2),
                f"spans_recorded{suffix}": spans.get(suffix, 0),
            }
        )
    # The headline ratios: the worst of the configurations measured (each must be within the target).
    result["forwarder_rss_ratio_to_bare_poller"] = max(
        result[f"forwarder_rss_ratio_to_bare_poller{suffix or '_production'}"] for suffix in processes
    )
    cpu_ratios = [result[f"forwarder_cpu_ratio_to_bare_poller{suffix or '_production'}"] for suffix in processes]
    result["forwarder_cpu_ratio_to_bare_poller"] = None if None in cpu_ratios else max(cpu_ratios)
    if "_tracing" in processes and "" in processes:
        result["tracing_rss_cost_mib"] = round(result["forwarder_rss_mib_tracing"] - result["forwarder_rss_mib"], 1)
    if "_connected" in processes and "" in processes:
        result["listener_rss_cost_mib"] = round(result["forwarder_rss_mib_connected"] - result["forwarder_rss_mib"], 1)
    return result | {"problems": problems}


def _bare_poller(imds_url: str, hubs: EventHubsEmulator) -> subprocess.Popen[bytes]:
    """The baseline, on another VM of the same emulator (so that `polls` counts each forwarder's alone), sending to
    the same Event Hubs REST endpoint over TLS as the forwarders (with the namespace key: a few lines, no identity)."""
    hub = f"{hubs.rest_url}/scheduled-events"
    return subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "bare_poller.py"), imds_url, hub, hubs.sas_key_name],
        cwd=ROOT,
        env={**os.environ, "BARE_POLLER_SAS_KEY": hubs.sas_key},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _exited(
    processes: dict[str, subprocess.Popen[bytes]], bare: subprocess.Popen[bytes], problems: list[str], *, when: str
) -> bool:
    """Whether a forwarder or the bare poller has exited (named in ``problems``)."""
    exited = [f"forwarder{s or '_production'} ({p.returncode})" for s, p in processes.items() if p.poll() is not None]
    if bare.poll() is not None:
        exited.append(f"the bare poller ({bare.returncode})")
    if exited:
        problems.append(f"exited {when}: {', '.join(exited)}")
    return bool(exited)


if __name__ == "__main__":
    raise SystemExit(main())
