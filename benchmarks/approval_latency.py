"""Approval latency on loopback, the bare Relay hop to a connected (always-on) listener: from the coordinator's
decision (``RelayApprovalSender.send`` is called) to the StartRequests POST recorded by the IMDS emulator, through
the Relay emulator, the VM's RelayListener and Approver.

    .venv/bin/python -m benchmarks.approval_latency [--n 1000]

Each approval is for a fresh Scheduled Freeze (15 minutes of notice; the emulator runs 60x, so 15 real seconds)
created before the clock starts, and is the request the coordinator would send: its notAfter from the rule's bound
(``coordinator.domain.expiry.approval_bound``: the event's NotBefore for an approve-now rule) capped by a batch's
delivery deadline (``request_bound`` with the in-run delivery time plus the allowance for a VM without a peer, as
``coordinator.pipeline.act`` does), its facts those of the event, its policyVersion the policy's fingerprint; one the
coordinator would not send (``expiry.sendable``) is a problem, not a sample. The listener connects once, before the
first approval, and stays connected (the always-on mode); the IMDS client gets a generous rate limiter: the
production limiter (4/s, burst 2) admits one approval's GET+POST at once, but 1,000 back-to-back approvals would
measure the limiter instead of the path.

Prints JSON: approval_ms_p50/p99 (decision → IMDS emulator recorded the approval), roundtrip_ms_p50/p99 (until
``send`` returned the listener's ApprovalResult), n, samples, ``listener: "connected"`` and ``problems`` (exit 1
when not empty): an approval not answered "approved", not recorded by IMDS for its event and VM (or twice), the
listener not connected when an approval was sent or connected more than once (it is the always-on one), fewer
samples than asked.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import requests
from azure.core.credentials import AzureNamedKeyCredential

from benchmarks.checks import approvals_problems, finish, some, too_few
from contracts.approval import NOT_AFTER_TOLERANCE, ApprovalFacts, ApprovalRequest, ApprovalResult
from contracts.document import ScheduledEvent
from contracts.envelope import VmIdentity
from contracts.sas import relay_resource_uri
from coordinator import (
    IN_RUN_DELIVERY,
    UNPEERED_ALLOWANCE,
    ApprovalCallback,
    EventRecord,
    RelayApprovalSender,
    approval_bound,
    hooks_required,
    parse_policy,
    request_bound,
    sendable,
)
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from emulators.relay import RelayEmulator
from forwarder.approver import Approver
from forwarder.imds import ImdsClient
from forwarder.relay_listener import RelayListener
from forwarder.relay_tokens import SasTokenProvider
from forwarder.retry import RateLimiter

KEY = "YmVuY2htYXJrLWtleQ=="
RULE = "approve-everything"
POLICY = parse_policy(f"version: 1\nrules:\n  - {{name: {RULE}, match: {{}}, action: approve-now}}\n")
# Emulated time runs 60x: a Freeze's 15 minutes of notice are 15 real seconds (the request is valid for the few
# seconds of a batch's delivery, well inside them). An approved event (5 s of Freeze) is listed Started for 6 Azure
# seconds, a tenth of a real second, so that the document stays about one event long over 1,000 approvals, as a VM's
# is, and the approver's fresh GET measures the path, not a document grown by the benchmark.
TIME_SCALE = 60.0
NOTICE_SECONDS = 900
STARTED_MIN_SECONDS = 6.0
DURATION_SECONDS = 5
# How long a request the coordinator sends from a batch is valid: the run's in-run delivery, and the allowance for a
# VM no peer can stand in for (this VM is alone in its placement group), coordinator/pipeline/act.py ``_valid_for``.
VALID_FOR = IN_RUN_DELIVERY + UNPEERED_ALLOWANCE


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def approval_request(created: dict[str, Any], *, decision_id: str, now: datetime) -> ApprovalRequest | None:
    """The request the coordinator sends for this event, decided at ``now`` by the approve-now rule (built as
    coordinator/pipeline/decide.py and act.py build it); None when the coordinator would not send it at ``now``."""
    fields = {k: v for k, v in created.items() if k[:1].isupper()} | {"EventStatus": "Scheduled"}
    event = ScheduledEvent.model_validate(fields)
    record = EventRecord(
        eventId=event.EventId,
        eventType=event.EventType,
        eventSource=event.EventSource,
        resources=list(event.Resources),
        description=event.Description,
        durationInSeconds=event.DurationInSeconds,
        notBefore=event.not_before(),
        stateSince=now,
        createdAt=now,
    )
    bound = approval_bound(POLICY, RULE, record, now, at_deadline=False)
    not_after = request_bound(bound, now, VALID_FOR, tolerance=NOT_AFTER_TOLERANCE)
    if not sendable(not_after.at, now, tolerance=NOT_AFTER_TOLERANCE):
        return None
    return ApprovalRequest(
        eventId=record.eventId,
        decisionId=decision_id,
        rule=RULE,
        issuedAt=now,
        expiresAt=not_after.at,
        notAfter=not_after.at,
        notAfterReason=not_after.why[:256],
        policyVersion=POLICY.fingerprint,
        facts=ApprovalFacts.of(event, hooks_required=hooks_required(POLICY, RULE, record)),
    )


@dataclass
class Tally:
    """What the run recorded, approval by approval."""

    approval_ms: list[float] = field(default_factory=list)
    roundtrip_ms: list[float] = field(default_factory=list)
    not_connected: list[int] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    unsendable: list[str] = field(default_factory=list)
    expected: dict[str, list[str]] = field(default_factory=dict)


class ConnectingLate:
    """A sender that starts the listener 0.3 s into its first send (tests: a listener not connected when sent to)."""

    def __init__(self, sender: ApprovalCallback, listener: RelayListener) -> None:
        self._sender = sender
        self._listener: RelayListener | None = listener

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        if self._listener is not None:
            threading.Timer(0.3, self._listener.start).start()
            self._listener = None
        return self._sender.send(request, vm=vm)


def approve_once(
    index: int, *, imds: ImdsEmulator, relay: RelayEmulator, send: ApprovalCallback, vm: VmIdentity, tally: Tally
) -> None:
    """One fresh event, the coordinator's request for it sent, the time until IMDS recorded its StartRequests."""
    created = imds.create_event(
        EventType="Freeze", Resources=[vm.name], NoticeSeconds=NOTICE_SECONDS, DurationInSeconds=DURATION_SECONDS
    )
    event_id = str(created["EventId"])
    decided_at = datetime.now(UTC)
    request = approval_request(created, decision_id=f"bench-{index}", now=decided_at)
    if request is None:
        tally.unsendable.append(event_id)
        return
    if relay.listener_count(vm.hybrid_connection_name) < 1:
        tally.not_connected.append(index)
    tally.expected[event_id] = [vm.name]
    recorded_before = len(imds.approvals())
    started = time.perf_counter()
    try:
        result = send.send(request, vm=vm)
    except Exception as error:  # a sender that gives up: the approval was not made
        tally.refused.append(f"{event_id}: {type(error).__name__}: {str(error)[:200]}")
        return
    tally.roundtrip_ms.append((time.perf_counter() - started) * 1000)
    if result.outcome != "approved":
        tally.refused.append(f"{event_id}: {result.outcome} ({result.reason[:200]})")
        return
    recorded = [a for a in imds.approvals()[recorded_before:] if a["EventId"] == event_id]
    if recorded:
        arrived = datetime.fromisoformat(str(recorded[0]["at"]).replace("Z", "+00:00"))
        tally.approval_ms.append((arrived - decided_at).total_seconds() * 1000)


def run(
    n: int, key_file: str, *, listener_mode: str = "connected", sender: ApprovalCallback | None = None
) -> dict[str, Any]:
    """``listener_mode`` and ``sender`` are for the tests: "late" connects the listener only once the first approval
    was sent (a listener not connected when the benchmark claims it is), ``sender`` replaces the Relay sender (e.g.
    one that answers without reaching the VM)."""
    scenario = Scenario(name="bench", vms=[VmSpec(name="bench_0", placementGroupId="pg-bench")])
    problems: list[str] = []
    tally = Tally()
    with ImdsEmulator(
        scenario=scenario, throttle_rps=1_000_000, time_scale=TIME_SCALE, started_min_seconds=STARTED_MIN_SECONDS
    ) as imds:
        relay = RelayEmulator(sas_keys={"bench": KEY})
        relay.start()
        client = ImdsClient(base_url=imds.url_for("bench_0"), limiter=RateLimiter(requests=100_000))
        identity = VmIdentity.of(client.get_identity())
        endpoint = relay.ws_url
        hc = identity.hybrid_connection_name
        listener = RelayListener(
            endpoint=endpoint,
            hybrid_connection=hc,
            token_provider=SasTokenProvider(
                resource_uri=relay_resource_uri(endpoint, hc), key_name="bench", key_file=key_file
            ),
            handler=Approver(imds=client, vm_name=identity.name),
        )
        if listener_mode == "connected":
            listener.start()
            if not listener.wait_connected(10):
                problems.append("the listener did not connect to the relay emulator within 10 s")
        real_sender = RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("bench", KEY))
        try:
            send = sender or real_sender
            if listener_mode == "late":  # it connects while the first approval waits for it
                send = ConnectingLate(send, listener)
            for index in range(n):
                approve_once(index, imds=imds, relay=relay, send=send, vm=identity, tally=tally)
            approvals = imds.approvals()
            connections = relay.counters().get(f"listener.{hc.lower()}", 0)
            still_connected = relay.listener_count(hc)
            document = requests.get(imds.scheduled_events_url("bench_0"), headers={"Metadata": "true"}, timeout=10)
            listed = len(document.json()["Events"])
        finally:
            real_sender.close()
            listener.stop()
            relay.stop()
            client.close()
    problems += judge(tally, approvals=approvals, connections=connections, still_connected=still_connected, n=n)
    result: dict[str, Any] = {"listener": "connected", "n": n, "samples": len(tally.approval_ms)}
    result["events_listed_at_end"] = listed
    if tally.approval_ms and tally.roundtrip_ms:
        result |= {
            "approval_ms_p50": round(statistics.median(tally.approval_ms), 2),
            "approval_ms_p99": round(percentile(tally.approval_ms, 0.99), 2),
            "roundtrip_ms_p50": round(statistics.median(tally.roundtrip_ms), 2),
            "roundtrip_ms_p99": round(percentile(tally.roundtrip_ms, 0.99), 2),
        }
    return result | {"problems": problems}


def judge(
    tally: Tally, *, approvals: list[dict[str, Any]], connections: int, still_connected: int, n: int
) -> list[str]:
    """What is wrong with the run, from what it recorded."""
    problems: list[str] = []
    if tally.unsendable:
        problems.append(
            f"{len(tally.unsendable)} approvals the coordinator would not send (notAfter within its tolerance): "
            f"{some(tally.unsendable)}"
        )
    if tally.refused:
        problems.append(f"{len(tally.refused)} approvals not answered 'approved': {some(tally.refused)}")
    if tally.not_connected:
        problems.append(
            f"the listener was not connected when {len(tally.not_connected)} approvals were sent (approvals "
            f"{some(str(i) for i in tally.not_connected)}): this benchmark's listener is the connected, always-on one"
        )
    if connections != 1:
        problems.append(f"the listener connected {connections} times, not once for the whole run (always-on)")
    if still_connected < 1:
        problems.append("the listener was not connected at the end of the run")
    problems += approvals_problems(approvals, tally.expected)
    problems += too_few("approvals", len(tally.approval_ms), n)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.approval_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="approvals to time (default 1000)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with tempfile.NamedTemporaryFile("w", suffix=".key") as key_file:
        key_file.write(KEY)
        key_file.flush()
        return finish(lambda: run(args.n, key_file.name))


if __name__ == "__main__":
    raise SystemExit(main())
