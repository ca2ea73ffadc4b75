"""python -m emulators.imds --port PORT [--scenario FILE] [--time-scale N]

Serves the emulator on 127.0.0.1, prints one JSON line with its URL and VMs, and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from types import FrameType

from emulators.imds.faults import DEFAULT_THROTTLE_RPS
from emulators.imds.lifecycle import DEFAULT_STARTED_MIN_SECONDS
from emulators.imds.models import Scenario, ScenarioError
from emulators.imds.server import ImdsEmulator
from emulators.tls import local_tls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulators.imds", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 = a free port)")
    parser.add_argument("--scenario", help="scenario file (YAML or JSON); default: two VMs, no events")
    parser.add_argument("--time-scale", type=float, default=1.0, help="60 makes a 15-minute notice last 15 s")
    parser.add_argument(
        "--started-min-seconds",
        type=float,
        default=DEFAULT_STARTED_MIN_SECONDS,
        help="least time (Azure seconds, scaled) a Started event stays in the document before removal",
    )
    parser.add_argument(
        "--throttle-rps",
        type=float,
        default=DEFAULT_THROTTLE_RPS,
        help="requests per second per VM above which IMDS answers 429 (0 = off)",
    )
    args = parser.parse_args(argv)
    if args.time_scale <= 0:
        parser.error("--time-scale must be > 0")
    try:
        scenario = Scenario.from_file(args.scenario) if args.scenario else Scenario.default()
    except ScenarioError as error:
        print(json.dumps({"error": str(error)}), file=sys.stderr)
        return 2
    emulator = ImdsEmulator(
        scenario=scenario,
        time_scale=args.time_scale,
        port=args.port,
        started_min_seconds=args.started_min_seconds,
        throttle_rps=args.throttle_rps,
    )
    try:
        url = emulator.start()
    except OSError as error:
        print(json.dumps({"error": f"cannot listen on 127.0.0.1:{args.port}: {error}"}), file=sys.stderr)
        return 2
    done = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    print(
        json.dumps(
            {
                "service": "imds-emulator",
                "url": url,
                "scenario": scenario.name,
                "timeScale": args.time_scale,
                "vms": {vm.name: emulator.url_for(vm.name) for vm in emulator.vms()},
                **_arm(emulator),
            }
        ),
        flush=True,
    )
    done.wait()
    emulator.stop()
    return 0


def _arm(emulator: ImdsEmulator) -> dict[str, str]:
    """The ARM face, over TLS with the local CA (emulators/tls.py): ``REQUESTS_CA_BUNDLE=caBundle`` trusts it."""
    return {"arm": emulator.arm_url, "caBundle": str(local_tls().bundle)}


if __name__ == "__main__":
    sys.exit(main())
