"""Spool replay rate: how fast a real forwarder process empties its on-disk spool into Event Hubs after an outage.

    .venv/bin/python -m benchmarks.spool_replay [--envelopes 5000]

The outage is simulated where it leaves its trace: the forwarder's own SQLite spool (forwarder.durable_state.Store, the
same API the daemon uses) holds N incarnation envelopes that could not be sent. Then ``python -m forwarder run``
starts with the Event Hubs emulator up and sends them, in order, in batches of ``send_batch_max`` (100), one POST
to Event Hubs' REST API each (forwarder/eventhub.py, with the IMDS emulator's managed-identity token). The rate is
measured on the emulator's enqueue times from the first to the last replayed envelope, so process start-up and the
first connection are not part of it.

Prints one JSON object: {spool_replay_per_s, envelopes (asked), replayed, replay_seconds, in_order, problems}.
``problems`` (exit 1 when not empty): the forwarder exiting before the spool was sent, spooled envelopes not
replayed within 120 s (or replayed twice), not in the spool's order, envelopes left in the spool afterwards.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.checks import finish
from contracts.document import ScheduledEventsDocument
from contracts.envelope import Envelope, VmIdentity
from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from forwarder.durable_state import Store
from forwarder.imds import identity_of
from local.observe import stored_envelopes

ROOT = Path(__file__).resolve().parents[1]
HUB = "scheduled-events"


def fill_spool(path: Path, identity: VmIdentity, count: int) -> None:
    store = Store(path, max_entries=max(10_000, count))
    try:
        for index in range(count):
            document = ScheduledEventsDocument.model_validate(
                {
                    "DocumentIncarnation": index + 2,
                    "Events": [
                        {
                            "EventId": f"00000000-0000-4000-8000-{index:012d}",
                            "EventType": "Freeze",
                            "Resources": [identity.name],
                            "EventStatus": "Scheduled",
                            "NotBefore": "Mon, 05 Jan 2026 12:15:00 GMT",
                            "DurationInSeconds": 5,
                        }
                    ],
                }
            )
            observed = datetime.now(UTC)

            def build(
                sequence: int, document: ScheduledEventsDocument = document, observed: datetime = observed
            ) -> bytes:
                return Envelope(
                    kind="incarnation",
                    vm=identity,
                    observedAt=observed,
                    sequence=sequence,
                    forwarder="benchmark",
                    document=document,
                ).to_json_bytes()

            store.enqueue("incarnation", build)
    finally:
        store.close()


def run(count: int, *, extra_args: tuple[str, ...] = (), timeout: float = 120.0) -> dict[str, Any]:
    """``extra_args`` (tests only): more flags for the forwarder; ``timeout``: seconds the replay may take."""
    problems: list[str] = []
    left = 0
    scenario = Scenario(name="replay", vms=[VmSpec(name="replay_0")])
    with tempfile.TemporaryDirectory() as tmp, ImdsEmulator(scenario=scenario, throttle_rps=0) as imds:
        eventhubs = EventHubsEmulator(hubs={HUB: 4})
        eventhubs.start()
        try:
            identity = identity_of(imds.vms()[0].compute())
            state = Path(tmp) / "state"
            state.mkdir()
            fill_spool(state / "forwarder.sqlite", VmIdentity.of(identity), count)
            env = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
            # The VM's managed identity, as in Azure: a token from the IMDS emulator, Event Hubs' REST API.
            command = [sys.executable, "-m", "forwarder", "run", "--imds-url", imds.url_for("replay_0"),
                       "--state-dir", str(state), "--sink", "eventhub", "--eventhub-name", HUB,
                       "--eventhub-namespace", eventhubs.rest_namespace,
                       "--hooks-dir", str(Path(tmp) / "hooks"), "--log-level", "WARNING", *extra_args]  # fmt: skip
            process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                deadline = time.monotonic() + timeout
                while len(eventhubs.all_events(HUB)) < count and time.monotonic() < deadline:
                    if process.poll() is not None:
                        errors = process.stderr.read().decode()[-600:] if process.stderr else ""
                        problems.append(f"the forwarder exited with {process.returncode} before the spool was sent: "
                                        f"{errors}")  # fmt: skip
                        break
                    time.sleep(0.1)
            finally:
                process.terminate()
                process.wait(timeout=15)
            found, _ = stored_envelopes(eventhubs, HUB)
            left = _left_in_spool(state / "forwarder.sqlite")
        finally:
            eventhubs.stop()
    # One VM, one partition key: the log order is the order the forwarder sent in.
    replayed = [(stored.enqueued_time_ms, env.sequence) for stored, env in found if env.forwarder == "benchmark"]
    sequences = [sequence for _, sequence in replayed]
    in_order = sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    seconds = (replayed[-1][0] - replayed[0][0]) / 1000 if len(replayed) > 1 else 0.0
    distinct = len(set(sequences))
    if distinct < count:
        problems.append(f"{count - distinct} of {count} spooled envelopes not replayed within {timeout:g} s")
    if len(sequences) > distinct:
        problems.append(f"{len(sequences) - distinct} envelopes replayed more than once")
    if sequences != sorted(sequences):
        problems.append("envelopes not replayed in the spool's order")
    if left:
        problems.append(f"{left} envelopes left in the spool after the replay")
    if seconds <= 0:
        problems.append("no replay time measured (fewer than two envelopes replayed)")
    return {
        "spool_replay_per_s": round((len(replayed) - 1) / seconds, 1) if seconds > 0 else None,
        "envelopes": count,
        "replayed": len(replayed),
        "replay_seconds": round(seconds, 3),
        "in_order": in_order,
        "problems": problems,
    }


def _left_in_spool(path: Path) -> int:
    """Envelopes still in the forwarder's spool (its process has exited)."""
    store = Store(path)
    try:
        return len(store.peek(1_000_000))
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spool_replay", description=__doc__.splitlines()[0])
    parser.add_argument("--envelopes", type=int, default=5000, help="envelopes in the spool (default 5000)")
    args = parser.parse_args(argv)
    return finish(lambda: run(args.envelopes))


if __name__ == "__main__":
    raise SystemExit(main())
