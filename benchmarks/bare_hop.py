"""The coordinator's hop alone, as shipped: from an attested Event Hubs batch reaching it to the approval leaving,
beside one conditional (If-Match) write on the same table.

    .venv/bin/python -m benchmarks.bare_hop [--n 300]

What runs: the coordinator built by ``coordinator.wiring.build_coordinator`` from its settings, as the Functions app
builds it (attestation required, its default, with the verifier trusting the IMDS emulator's root and fetching the
issuing CA from the emulator's CA Issuers URL, as local/stack.py configures it; the batch tails after the batch, on
the wiring's executor), with state in Azurite, history in SQLite, cards in a folder, and a policy that approves every
event at once. The approval callback is a stand-in for the Relay hop (``StandIn``, not the Relay sender): it notes
when the coordinator calls it and answers "approved" at once, with the emulator's attested document of the VM for
the decision (``decision_nonce``), the proof the coordinator requires of an answer, as a forwarder's listener sends
it. The Relay round trip to a connected listener is benchmarks/approval_latency.py's.

``--n`` VMs of an IMDS emulator scenario (each its own Freeze), known and bound before timing, as in steady state:
each VM's envelope says of it what the emulator's compute metadata says (what its forwarder reads), carries the
emulator's attested document of that VM for its forwarder state (nonce ``state_nonce(stateId)``, signed once, as a
forwarder attaches the same document to every envelope while it is valid), and one such envelope per VM went
through the coordinator before the clock starts (its position stored, its binding claimed and its document
verified). Then each VM in turn reports one new event in a batch of one envelope. The hop: from the call of
``Coordinator.process_batch`` to the coordinator calling the stand-in for that event's approval. It holds reading
and validating the envelope, checking its attested document (verified already: the verifier's cache) and the VM's
binding, folding it into the event and the VM's position, deciding, the deciding ETag-checked write, and handing the
request to the approval pool. Each batch's tail (the answer committed, the history, the cards) ends before the next
hop and the conditional write start, so no hop overlaps another's work.

Why it is the bare floor of the pipeline (``pipeline_added_p99_over_bare_hops_p99`` in benchmarks/catalog.py): it
is the coordinator's own work on an envelope and its state store, nothing else: no Event Hubs (eventhub_hop's), no
Relay (approval_latency's), no forwarders, function host or other emulators sharing the cores (the IMDS emulator
only serves its issuing CA, once, at the warm-up; benchmarks/hop.py measures the same span inside the whole local
stack), one envelope a batch, every VM known and bound.

The conditional write: between two hops, an If-Match update of a small entity whose ETag is known (what the deciding
write is) on the coordinator's table, through the same ``TableClient``: the floor of a hop that writes its decision
before it sends.

Prints one JSON object: hop_ms_p50/p99, conditional_write_ms_p50/p99, hop_over_conditional_write (p50 ÷ p50),
hop_table_requests (Table requests a hop makes before its approval leaves, mean), n, samples, and ``problems``
(exit 1 when not empty): an event whose approval was not made (or made twice, or to another VM), envelopes
dead-lettered or not accepted (the coordinator's reports), decisions not "approve" by the policy's rule, fewer hops
than asked, attestation not required.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from azure.core import MatchConditions
from azure.data.tables import UpdateMode

from benchmarks.approval_latency import percentile
from benchmarks.checks import dead_letter_problems, decisions_problems, finish, some, too_few
from benchmarks.table_ops import CountingTable, Ops
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import Attestation, decision_nonce, state_nonce
from contracts.envelope import SCHEMA, VmIdentity
from coordinator import Coordinator, CoordinatorSettings, RawMessage, Report, build_coordinator
from emulators.azurite import Azurite
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from forwarder.imds import identity_of

RULE = "approve-everything"
POLICY = f"version: 1\nrules:\n  - {{name: {RULE}, match: {{}}, action: approve-now}}\n"
TABLE = "barehop"
WARM_BATCH = 100


@dataclass(frozen=True)
class Vm:
    """A VM as its forwarder speaks: its identity (as read from IMDS), its state, IMDS's document for that state."""

    compute: dict[str, Any]
    identity: dict[str, Any]
    state_id: str
    attestation: dict[str, str]


@dataclass(frozen=True)
class Call:
    event_id: str
    vm: str
    at: float
    requests_before: int


@dataclass
class StandIn:
    """The approval callback in place of the Relay hop (approval_latency's): notes each call, when it came and the
    Table requests made before it, and answers "approved" at once with the IMDS emulator's attested document of the
    VM for the decision, as a listener does."""

    imds: ImdsEmulator
    ops: Ops
    computes: dict[str, dict[str, Any]]
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        at, requests_before = time.perf_counter(), self.ops.requests
        with self.lock:
            self.calls.append(Call(request.eventId, vm.name, at, requests_before))
        document = self.imds.attested.document(
            self.computes.get(vm.name, {"name": vm.name, "vmId": vm.vmId}),
            nonce=decision_nonce(request.decisionId),
            now=datetime.now(UTC),
        )
        return ApprovalResult(
            outcome="approved",
            eventId=request.eventId,
            decisionId=request.decisionId,
            attestation=Attestation.model_validate(document),
        )


def scenario(n: int) -> Scenario:
    """``n`` VMs of one scale set, 20 to a placement group."""
    return Scenario(
        name="bare-hop",
        description="benchmarks/bare_hop.py",
        vms=[
            VmSpec(
                name=f"hop_{i}", vmScaleSetName="hop", placementGroupId=f"pg-hop-{i // 20}", resourceGroupName="rg-hop"
            )
            for i in range(n)
        ],
    )


def attest(imds: ImdsEmulator, *, forged: int = 0) -> list[Vm]:
    """Every VM with the emulator's attested document for its forwarder state (one RSA signature a VM). The first
    ``forged`` VMs' documents sign another state's nonce: the coordinator must refuse them (a test of the checks)."""
    now = datetime.now(UTC)
    fleet = []
    for index, spec in enumerate(imds.vms()):
        compute = spec.compute()
        state_id = uuid.uuid5(uuid.NAMESPACE_URL, f"bare-hop-forwarder-state:{spec.vmId}").hex
        signed_for = state_id if index >= forged else state_id[::-1]
        document = imds.attested.document(compute, nonce=state_nonce(signed_for), now=now)
        fleet.append(Vm(compute, identity_of(compute).to_mapping(), state_id, document))
    return fleet


def envelope(vm: Vm, sequence: int, events: list[dict[str, Any]], now: datetime) -> RawMessage:
    """What the VM's forwarder sends: an incarnation of its document, its state and IMDS's document for that state."""
    data = {
        "schema": SCHEMA,
        "kind": "incarnation",
        "vm": vm.identity,
        "observedAt": now.isoformat(),
        "sequence": sequence,
        "forwarder": "bare-hop/1.0",
        "stateId": vm.state_id,
        "attestation": vm.attestation,
        "document": {"DocumentIncarnation": sequence, "Events": events},
    }
    return RawMessage(body=json.dumps(data).encode(), partition_key=str(vm.identity["resourceId"]).lower())


def event(event_id: str, vm: Vm, now: datetime) -> dict[str, Any]:
    return {
        "EventId": event_id,
        "EventType": "Freeze",
        "ResourceType": "VirtualMachine",
        "Resources": [vm.identity["name"]],
        "EventStatus": "Scheduled",
        "NotBefore": (now + timedelta(minutes=15)).strftime("%a, %d %b %Y %H:%M:%S GMT"),
        "Description": "benchmark",
        "EventSource": "Platform",
        "DurationInSeconds": 5,
    }


def settings(connection_string: str, imds: ImdsEmulator, folder: Path) -> CoordinatorSettings:
    """The coordinator's app settings as local/stack.py gives them, for this run: Azurite, its own table, history
    and cards in ``folder``, the approve-everything policy, the emulator's root as the trust anchor."""
    policy, root = folder / "policy.yaml", folder / "imds-root.pem"
    policy.write_text(POLICY, encoding="utf-8")
    root.write_bytes(imds.root_pem)
    return CoordinatorSettings(
        storage_connection_string=connection_string,
        state_table=TABLE,
        history_sqlite_path=folder / "history.sqlite",
        cards_folder=folder / "cards",
        policy_path=policy,
        require_attestation=True,
        attestation_trust_anchors=root,
        attestation_issuer_urls=imds.url + "/_emulator/pki/",
    )


@dataclass
class Measured:
    """What a run recorded: the hops and conditional writes (ms), the Table requests before each approval left,
    the coordinator's reports of the warm-up and of the timed batches, the events made (EventId -> VM), problems."""

    hops: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    warm: Counter[str] = field(default_factory=Counter)
    timed: Counter[str] = field(default_factory=Counter)
    created: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def run(n: int, *, forged: int = 0) -> dict[str, Any]:
    """``n`` timed hops and conditional writes; ``forged``: the first VMs' documents sign the wrong nonce (tests)."""
    measured = Measured()
    ops = Ops()
    with (
        tempfile.TemporaryDirectory() as tmp,
        Azurite() as azurite,
        ImdsEmulator(scenario=scenario(n)) as imds,
    ):
        folder = Path(tmp)
        fleet = attest(imds, forged=forged)
        stand_in = StandIn(imds, ops, {str(vm.identity["name"]): vm.compute for vm in fleet})
        coordinator = build_coordinator(settings(azurite.connection_string, imds, folder), callback=stand_in)
        try:
            if not coordinator.options.require_attestation or coordinator.parts.attestations is None:
                measured.problems.append("the coordinator does not require attested envelopes (not as shipped)")
            table = coordinator.parts.store._table  # type: ignore[attr-defined]
            coordinator.parts.store._table = CountingTable(table, ops)  # type: ignore[attr-defined]
            now = datetime.now(UTC)
            for first in range(0, n, WARM_BATCH):  # known and bound: positions stored, bindings claimed
                batch = [envelope(vm, 1, [], now) for vm in fleet[first : first + WARM_BATCH]]
                measured.warm.update(_counts(coordinator.process_batch(batch)))
            if not coordinator.drain():
                measured.problems.append("the warm-up's batch tails still running after 30 s")
            _time_hops(coordinator, table, fleet, stand_in, measured)
        finally:
            coordinator.close()
        history = folder / "history.sqlite"
        problems = measured.problems
        problems += _report_problems("warm-up", measured.warm, n)
        problems += _report_problems("timed", measured.timed, n)
        problems += dead_letter_problems(history)  # why, from the coordinator's DeadLetter rows
        problems += _approval_problems(stand_in.calls, measured.created)
        problems += decisions_problems(history, measured.created, rule=RULE)
        problems += too_few("hops", len(measured.hops), n)
    return _figures(measured, n) | {"problems": problems}


def _time_hops(coordinator: Coordinator, table: Any, fleet: list[Vm], stand_in: StandIn, measured: Measured) -> None:
    """Each VM's new event in a batch of one envelope, its tail ended, then one conditional write."""
    etag = table.create_entity({"PartitionKey": "probe", "RowKey": "write", "Value": 0})["etag"]
    for index, vm in enumerate(fleet):
        now = datetime.now(UTC)
        event_id = str(uuid.uuid4()).upper()
        measured.created[event_id] = str(vm.identity["name"])
        message = envelope(vm, 2, [event(event_id, vm, now)], now)
        stand_in.ops.requests = 0
        started = time.perf_counter()
        measured.timed.update(_counts(coordinator.process_batch([message])))
        if not coordinator.drain():
            measured.problems.append(f"the tail of hop {index} still running after 30 s")
        call = next((c for c in stand_in.calls if c.event_id == event_id), None)
        if call is not None:
            measured.hops.append((call.at - started) * 1000)
            measured.requests.append(call.requests_before)
        write_started = time.perf_counter()
        result = table.update_entity(
            {"PartitionKey": "probe", "RowKey": "write", "Value": index},
            mode=UpdateMode.REPLACE,
            etag=etag,
            match_condition=MatchConditions.IfNotModified,
        )
        measured.writes.append((time.perf_counter() - write_started) * 1000)
        etag = result["etag"]


def _counts(report: Report) -> dict[str, int]:
    return {k: v for k, v in report.as_dict().items() if isinstance(v, int)}


def _report_problems(what: str, totals: Counter[str], n: int) -> list[str]:
    """The coordinator's reports of the ``what`` batches: every one of the ``n`` envelopes accepted, none
    dead-lettered, no state entity set aside."""
    problems = []
    if totals["dead_lettered"]:
        problems.append(
            f"the coordinator's reports: {totals['dead_lettered']} of {totals['received']} {what} envelopes "
            "dead-lettered"
        )
    if totals["accepted"] < n:
        problems.append(f"the coordinator's reports: {totals['accepted']} of {n} {what} envelopes accepted")
    if totals["set_aside"]:
        problems.append(f"the coordinator's reports: {totals['set_aside']} state entities set aside")
    return problems


def _approval_problems(calls: list[Call], created: dict[str, str]) -> list[str]:
    """What the stand-in was called with against the events made: each approved once, to its own VM, and none
    other."""
    by_event: dict[str, list[Call]] = {}
    for call in calls:
        by_event.setdefault(call.event_id, []).append(call)
    problems = []
    missing = [event_id for event_id in created if event_id not in by_event]
    if missing:
        problems.append(f"{len(missing)} of {len(created)} events' approvals not made: {some(missing)}")
    twice = [event_id for event_id, made in by_event.items() if len(made) > 1]
    if twice:
        problems.append(f"{len(twice)} events' approvals made more than once: {some(twice)}")
    wrong = [f"{c.event_id} to {c.vm}" for c in calls if c.event_id in created and c.vm != created[c.event_id]]
    if wrong:
        problems.append(f"{len(wrong)} approvals sent to another VM than the event's: {some(wrong)}")
    extra = [event_id for event_id in by_event if event_id not in created]
    if extra:
        problems.append(f"{len(extra)} approvals of events the benchmark did not create: {some(extra)}")
    return problems


def _figures(measured: Measured, n: int) -> dict[str, Any]:
    hops, writes, requests = measured.hops, measured.writes, measured.requests
    result: dict[str, Any] = {"n": n, "samples": len(hops)}
    if not hops or not writes:
        return result
    hop_p50, write_p50 = percentile(hops, 0.5), percentile(writes, 0.5)
    return result | {
        "hop_ms_p50": round(hop_p50, 2),
        "hop_ms_p99": round(percentile(hops, 0.99), 2),
        "conditional_write_ms_p50": round(write_p50, 2),
        "conditional_write_ms_p99": round(percentile(writes, 0.99), 2),
        "hop_over_conditional_write": round(hop_p50 / write_p50, 2),
        "hop_table_requests": round(sum(requests) / len(requests), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bare_hop", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="hops to time, one VM each (default 300)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")
    return finish(lambda: run(args.n))


if __name__ == "__main__":
    raise SystemExit(main())
