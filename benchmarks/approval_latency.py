"""Approval latency on loopback: from the coordinator's decision (``RelayApprovalSender.send`` is called) to the
StartRequests POST recorded by the IMDS emulator, through the Relay emulator, the VM's RelayListener and Approver.

    .venv/bin/python -m benchmarks.approval_latency [--n 1000]

Prints JSON: approval_ms_p50/p99 (decision → IMDS emulator recorded the approval), roundtrip_ms_p50/p99 (until
``send`` returned the listener's ApprovalResult), n. Each approval is for a fresh Scheduled event created before
the clock starts. The IMDS client gets a generous rate limiter: the production limiter (4/s, burst 2) admits one
approval's GET+POST at once, but 1,000 back-to-back approvals would measure the limiter instead of the path.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta

from azure.core.credentials import AzureNamedKeyCredential

from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.document import ScheduledEvent
from contracts.envelope import VmIdentity
from contracts.sas import relay_resource_uri
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from emulators.relay import RelayEmulator
from forwarder.approver import Approver
from forwarder.imds import ImdsClient
from forwarder.relay_listener import RelayListener
from forwarder.relay_tokens import SasTokenProvider
from forwarder.retry import RateLimiter

KEY = "YmVuY2htYXJrLWtleQ=="


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(n: int, key_file: str) -> dict[str, float | int]:
    scenario = Scenario(name="bench", vms=[VmSpec(name="bench_0", placementGroupId="pg-bench")])
    # A large time scale lets approved events start and leave quickly, so the document stays small.
    with ImdsEmulator(scenario=scenario, throttle_rps=1_000_000, time_scale=600) as imds:
        relay = RelayEmulator(sas_keys={"bench": KEY})
        relay.start()
        client = ImdsClient(base_url=imds.url_for("bench_0"), limiter=RateLimiter(requests=100_000))
        identity = VmIdentity.of(client.get_identity())
        endpoint = relay.base_url.replace("http://", "ws://")
        hc = identity.hybrid_connection_name
        listener = RelayListener(
            endpoint=endpoint,
            hybrid_connection=hc,
            token_provider=SasTokenProvider(
                resource_uri=relay_resource_uri(endpoint, hc), key_name="bench", key_file=key_file
            ),
            handler=Approver(imds=client, vm_name=identity.name),
        ).start()
        if not listener.wait_connected(10):
            raise SystemExit("the listener did not connect to the relay emulator")
        sender = RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("bench", KEY))
        approval_ms: list[float] = []
        roundtrip_ms: list[float] = []
        try:
            for index in range(n):
                created = imds.create_event(EventType="Freeze", Resources=["bench_0"], NoticeSeconds=900)
                event_id = created["EventId"]
                fields = {k: v for k, v in created.items() if k[:1].isupper()} | {"EventStatus": "Scheduled"}
                issued = datetime.now(UTC)
                request = ApprovalRequest(
                    eventId=event_id,
                    decisionId=f"bench-{index}",
                    rule="bench",
                    issuedAt=issued,
                    expiresAt=issued + timedelta(minutes=5),
                    notAfter=issued + timedelta(minutes=5),
                    facts=ApprovalFacts.of(ScheduledEvent.model_validate(fields)),
                )
                started = time.perf_counter()
                decided_at = datetime.now(UTC)
                result = sender.send(request, vm=identity)
                roundtrip_ms.append((time.perf_counter() - started) * 1000)
                if result.outcome != "approved":
                    raise SystemExit(f"approval {index} was {result.outcome}: {result.reason}")
                recorded = imds.approvals()[-1]
                if recorded["EventId"] != event_id:
                    raise SystemExit(f"approval {index} did not reach IMDS: {recorded}")
                arrived = datetime.fromisoformat(recorded["at"].replace("Z", "+00:00"))
                approval_ms.append((arrived - decided_at).total_seconds() * 1000)
        finally:
            sender.close()
            listener.stop()
            relay.stop()
            client.close()
    return {
        "approval_ms_p50": round(statistics.median(approval_ms), 2),
        "approval_ms_p99": round(percentile(approval_ms, 0.99), 2),
        "roundtrip_ms_p50": round(statistics.median(roundtrip_ms), 2),
        "roundtrip_ms_p99": round(percentile(roundtrip_ms, 0.99), 2),
        "n": n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="approvals to time (default 1000)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.NamedTemporaryFile("w", suffix=".key") as key_file:
        key_file.write(KEY)
        key_file.flush()
        print(json.dumps(run(args.n, key_file.name)))


if __name__ == "__main__":
    main()
