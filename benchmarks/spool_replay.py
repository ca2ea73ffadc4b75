"""Spool replay rate: how fast a real forwarder process empties its on-disk spool into Event Hubs after an outage.

    .venv/bin/python -m benchmarks.spool_replay [--envelopes 5000]

The outage is simulated where it leaves its trace: the forwarder's own SQLite spool (forwarder.durable_state.Store, the
same API the daemon uses) holds N incarnation envelopes that could not be sent. Then ``python -m forwarder run``
starts with the Event Hubs emulator up and sends them, in order, in batches of ``send_batch_max`` (100), one POST
to Event Hubs' REST API each (forwarder/eventhub.py, with the IMDS emulator's managed-identity token). The rate is
measured on the emulator's enqueue times from the first to the last replayed envelope, so process start-up and the
first connection are not part of it.

Prints one JSON object: {spool_replay_per_s, envelopes, replay_seconds, in_order}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

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


def run(count: int) -> dict[str, object]:
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
                       "--eventhub-namespace", eventhubs.rest_namespace, "--no-eventhub-use-tls",
                       "--hooks-dir", str(Path(tmp) / "hooks"), "--log-level", "WARNING"]  # fmt: skip
            process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                deadline = time.monotonic() + 120
                while len(eventhubs.all_events(HUB)) < count and time.monotonic() < deadline:
                    if process.poll() is not None:
                        raise RuntimeError(f"the forwarder exited: {process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
                    time.sleep(0.1)
            finally:
                process.terminate()
                process.wait(timeout=15)
            found, _ = stored_envelopes(eventhubs, HUB)
        finally:
            eventhubs.stop()
    # One VM, one partition key: the log order is the order the forwarder sent in.
    replayed = [(stored.enqueued_time_ms, env.sequence) for stored, env in found if env.forwarder == "benchmark"]
    sequences = [sequence for _, sequence in replayed]
    in_order = sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    seconds = (replayed[-1][0] - replayed[0][0]) / 1000 if len(replayed) > 1 else 0.0
    return {
        "spool_replay_per_s": round((len(replayed) - 1) / seconds, 1) if seconds > 0 else None,
        "envelopes": len(replayed),
        "replay_seconds": round(seconds, 3),
        "in_order": in_order,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spool_replay", description=__doc__.splitlines()[0])
    parser.add_argument("--envelopes", type=int, default=5000, help="envelopes in the spool (default 5000)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.envelopes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
