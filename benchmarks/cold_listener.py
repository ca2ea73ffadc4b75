"""The price of an on-demand listener: how long an approval takes when the VM's listener was not connected.

    .venv/bin/python -m benchmarks.cold_listener [--n 20] [--mode on-demand|always-on|both]

The real race, on loopback: a real `python -m forwarder run` process (relay listener on demand, 1 poll/s, envelopes
to a JSON-lines file) polls the IMDS emulator; an event is created there; the moment the forwarder's envelope
listing it is written (the forwarder has seen it, and has started connecting its listener), the coordinator's
``RelayApprovalSender`` sends the approval — as the coordinator would if it decided at once — and the clock runs
until the listener's answer (approved, through the Relay emulator and IMDS). Then the event starts, the listener
leaves after its grace period (0.5 s here), and the next trial begins with no listener connected.

With ``--mode both`` the same trials run against an always-on listener too, and ``cold_listener_extra_ms_p50/p99``
is the difference: the cost of connecting on demand. Prints one JSON object: cold_listener_approval_ms_p50/p99
(the on-demand figures), warm_listener_approval_ms_p50/p99, n.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from azure.core.credentials import AzureNamedKeyCredential

from benchmarks.approval_latency import percentile
from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.document import ScheduledEvent
from contracts.envelope import VmIdentity
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from forwarder.imds import ImdsClient

ROOT = Path(__file__).resolve().parents[1]
KEY = "Y29sZC1saXN0ZW5lci1iZW5jaA=="
GRACE_SECONDS = 0.5
REFILL_SECONDS = 3.0


def wait(predicate: Any, *, timeout: float, what: str, step: float = 0.002) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def seen_scheduled(envelopes: Path, event_id: str) -> bool:
    """Whether the forwarder has written an envelope listing the event as Scheduled (its poll saw it)."""
    if not envelopes.exists():
        return False
    for line in envelopes.read_text(encoding="utf-8").splitlines()[-5:]:
        document = json.loads(line).get("document") or {}
        if any(e["EventId"] == event_id and e["EventStatus"] == "Scheduled" for e in document.get("Events", [])):
            return True
    return False


def trials(n: int, *, mode: str) -> list[float]:
    relay = RelayEmulator(sas_keys={"send": KEY})
    relay.start()
    # Emulated time runs 600x (a day of notice is 144 s): approved events finish and leave the document quickly.
    with tempfile.TemporaryDirectory() as scratch, ImdsEmulator(time_scale=600, throttle_rps=0) as imds:
        vm = imds.first_vm
        envelopes = Path(scratch) / "envelopes.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
        env.update(
            SE_FORWARDER_IMDS_URL=imds.url_for(vm),
            SE_FORWARDER_STATE_DIR=str(Path(scratch) / "state"),
            SE_FORWARDER_HOOKS_DIR=str(Path(scratch) / "hooks"),
            SE_FORWARDER_SINK="jsonl",
            SE_FORWARDER_JSONL_PATH=str(envelopes),
            SE_FORWARDER_RELAY_ENABLED="true",
            SE_FORWARDER_RELAY_ENDPOINT=relay.base_url.replace("http://", "ws://", 1),
            SE_FORWARDER_RELAY_LISTENER_MODE=mode,
            SE_FORWARDER_RELAY_LISTENER_GRACE_SECONDS=str(GRACE_SECONDS),
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "forwarder", "run"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The production sender (its "no listener" retries capped at 1 s), with a SAS key for the emulator.
        sender = RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", KEY))
        timings: list[float] = []
        try:
            client = ImdsClient(base_url=imds.url_for(vm))
            identity = VmIdentity.of(client.get_identity())
            client.close()
            hc = identity.hybrid_connection_name
            if mode == "always-on":
                wait(lambda: relay.listener_count(hc) == 1, timeout=30, what="the always-on listener")
            for index in range(n):
                if mode == "on-demand":
                    wait(lambda: relay.listener_count(hc) == 0, timeout=30, what="the listener to leave", step=0.05)
                # The forwarder's IMDS rate limiter (forwarder/retry.py: 4 in any second, shared by the poll, the
                # attestor, the relay token and the approver); back-to-back approvals would fill its window and
                # measure the limiter, so each trial starts with it empty, as a VM's rare approval does.
                time.sleep(REFILL_SECONDS)
                created = imds.create_event(EventType="Freeze", Resources=[vm], NoticeSeconds=86_400)
                event_id = created["EventId"]
                fields = {k: v for k, v in created.items() if k[:1].isupper()} | {"EventStatus": "Scheduled"}
                wait(lambda e=event_id: seen_scheduled(envelopes, e), timeout=30, what="the forwarder to see the event")
                issued = datetime.now(UTC)
                facts = ApprovalFacts.of(ScheduledEvent.model_validate(fields))
                # At 600x the day of notice is 144 real seconds: the approval is valid until NotBefore at the latest,
                # as the coordinator bounds it (the listener refuses a notAfter past the event's NotBefore).
                not_after = issued + timedelta(minutes=5)
                if facts.notBefore is not None:
                    not_after = min(not_after, facts.notBefore)
                request = ApprovalRequest(
                    eventId=event_id,
                    decisionId=f"cold-{mode}-{index}",
                    rule="bench",
                    issuedAt=issued,
                    expiresAt=issued + timedelta(minutes=5),
                    notAfter=not_after,
                    facts=facts,
                )
                started = time.perf_counter()
                result = sender.send(request, vm=identity)
                timings.append((time.perf_counter() - started) * 1000)
                if result.outcome != "approved":
                    raise SystemExit(f"trial {index} ({mode}) was {result.outcome}: {result.reason}")
        finally:
            sender.close()
            process.terminate()
            process.wait(15)
            relay.stop()
    return timings


def figures(prefix: str, timings: list[float]) -> dict[str, float]:
    return {
        f"{prefix}_approval_ms_p50": round(statistics.median(timings), 1),
        f"{prefix}_approval_ms_p99": round(percentile(timings, 0.99), 1),
        f"{prefix}_approval_ms_max": round(max(timings), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="approvals per mode (default 20)")
    parser.add_argument("--mode", choices=("on-demand", "always-on", "both"), default="both")
    args = parser.parse_args()
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    logging.basicConfig(level=logging.ERROR)
    result: dict[str, Any] = {"n": args.n, "grace_seconds": GRACE_SECONDS}
    if args.mode in ("on-demand", "both"):
        result |= figures("cold_listener", trials(args.n, mode="on-demand"))
    if args.mode in ("always-on", "both"):
        result |= figures("warm_listener", trials(args.n, mode="always-on"))
    if args.mode == "both":
        for stat in ("p50", "p99"):
            extra = result[f"cold_listener_approval_ms_{stat}"] - result[f"warm_listener_approval_ms_{stat}"]
            result[f"cold_listener_extra_ms_{stat}"] = round(extra, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
