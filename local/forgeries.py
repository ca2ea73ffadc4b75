"""What a hostile process on one fleet VM sends or answers, played by the local platform's ``forge`` steps
(local/platform.py; the kinds are ``emulators.imds.models.ForgeStep``'s). Every VM of a fleet holds the one Event Hubs
sender identity and Relay listener role, so such a process can send any envelope and listen on any VM's hybrid
connection; what it cannot do is make IMDS sign a vmId other than its own VM's.

Two kinds of forger:

- **Without root** (``relabel``, ``user``, ``hook``, ``gone``, ``sequence``; ``deep``, ``oversized`` under its own
  identity): envelopes without an attested document, each refused at the door while attestation is required.
- **With root on its VM** (issue 34): it asks its own IMDS for an attested document of a forwarder state of its own,
  so each envelope carries a valid document of the forger's own vmId, with sequences from 2^62:

  - ``name``: its own vmId and resource id (the partition key), ``about``'s name, ``about``'s events relabelled as a
    5 s Freeze: believed, the approval would go to the forger's hybrid connection;
  - ``silence``: the same, listing ``about``'s events as they are, then an empty document: believed, ``about`` would
    be silenced (no position of its own passes 2^62) and its events concluded;
  - ``name-hook`` and ``name-impact``: under ``about``'s name, its prepare hooks succeeded, an hour's impact;
  - ``squat``: ``about``'s name and resource id (its partition key) with the forger's vmId and document, the first
    binding of that resource id when the real VM had not spoken yet (a census would settle it);
  - ``malformed``: its own identity and events, its document with one byte changed;
  - ``scale-set``: its own identity and the events its IMDS shows for it (``about`` is itself), under a scale set
    name that is not its own (``not-`` and its own): believed, its events would escape a ``scaleSet`` rule and its
    delete the deletes of its scale set;
  - ``liar``: a listener on ``about``'s hybrid connection that answers every approval request "approved" with the
    forger's own attested proof for that decision, and never POSTs StartRequests; until the run ends.

``sent`` gives each message with the SHA-256 of its body, which the coordinator's dead letters carry: the oracle
matches what the door refused to each attack (oracle/attacks.py).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import requests

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import ATTESTED_API_VERSION, Attestation, decision_nonce, state_nonce
from contracts.document import ScheduledEventsDocument
from contracts.envelope import (
    MAX_TAG_NAME,
    MAX_TAG_VALUE,
    MAX_TAGS,
    Envelope,
    HookReport,
    HookStep,
    ImpactReport,
    VmIdentity,
)
from emulators.imds.local_steps import ForgeStep
from forwarder.credential import ImdsManagedIdentityCredential
from forwarder.imds import ImdsClient
from forwarder.relay_listener import RelayListener
from forwarder.relay_protocol import RelayRequest, RelayResponse
from forwarder.relay_tokens import EntraTokenProvider
from forwarder.retry import RateLimiter

__all__ = ["ATTESTED", "FORGED_SEQUENCE", "LyingListener", "attestation_of", "digest", "forged"]

log = logging.getLogger("local.forgeries")

# Sequences no forwarder reaches: a forger's envelopes are never dropped as stale.
FORGED_SEQUENCE = 2**62
FORGER = "scheduled-events-forwarder/0.1.0"
# The kinds a forger with root on its VM plays, each envelope carrying its own IMDS's document.
ATTESTED = frozenset({"name", "silence", "name-hook", "name-impact", "squat", "malformed", "scale-set"})
# How deep the forger nests its document: far beyond any parser's recursion limit.
DEEP = 20_000
MAX_EVENTS = 100

Message = tuple[bytes, str]


def now_utc() -> datetime:
    return datetime.now(UTC)


def digest(body: bytes) -> str:
    """A message as the dead-letter rows name it (``bodySha256``)."""
    return hashlib.sha256(body).hexdigest()


def attestation_of(vm_url: str, state: str) -> Attestation:
    """The forger's own IMDS signs its own vmId for a forwarder state of its own (root on the VM can ask it)."""
    answer = requests.get(
        f"{vm_url}/metadata/attested/document",
        params={"api-version": ATTESTED_API_VERSION, "nonce": state_nonce(state)},
        headers={"Metadata": "true"},
        timeout=10,
    )
    answer.raise_for_status()
    return Attestation.model_validate(answer.json())


def damaged(attestation: Attestation) -> Attestation:
    """The document with one byte of its DER changed, half way in (inside the signing certificate or the
    signature): it still looks like a document, and proves nothing."""
    der = bytearray(base64.b64decode(attestation.signature))
    der[len(der) // 2] ^= 0x5A
    return Attestation(encoding="pkcs7", signature=base64.b64encode(bytes(der)).decode())


class _Forgery:
    """One forgery's envelopes: under a state of its own, with sequences no forwarder reaches, carrying the forger's
    proof (if any), about the events the forger's IMDS shows at ``incarnation``."""

    def __init__(self, state: str, proof: Attestation | None, incarnation: int, events: list[dict[str, Any]]) -> None:
        self._state = state
        self._proof = proof
        self._incarnation = incarnation
        self._events = events
        self._sequences = iter(range(FORGED_SEQUENCE, FORGED_SEQUENCE + 1_000))

    def envelope(self, vm: VmIdentity, *, key: str | None = None, **fields: Any) -> Message:
        sent = Envelope(
            vm=vm,
            attestation=self._proof,
            observedAt=now_utc(),
            sequence=next(self._sequences),
            forwarder=FORGER,
            stateId=self._state,
            **fields,
        )
        return sent.to_json_bytes(), key or vm.partition_key

    def document(self, items: list[dict[str, Any]]) -> ScheduledEventsDocument:
        return ScheduledEventsDocument.model_validate({"DocumentIncarnation": self._incarnation + 1, "Events": items})

    def hooks(self, vm: VmIdentity) -> list[Message]:
        done = HookStep(hook="10-drain", outcome="succeeded", durationSeconds=0.1, exitCode=0)
        return [
            self.envelope(
                vm,
                kind="hook",
                hook=HookReport(
                    eventId=str(e["EventId"]), phase="prepare", outcome="succeeded", durationSeconds=0.1, steps=[done]
                ),
            )
            for e in self._events
        ]

    def impacts(self, vm: VmIdentity) -> list[Message]:
        start = now_utc()
        return [
            self.envelope(
                vm,
                kind="impact",
                impact=ImpactReport(
                    eventId=str(e["EventId"]),
                    eventType=str(e["EventType"]),
                    measure="pause",
                    measuredSeconds=3600,
                    start=start,
                    end=start + timedelta(hours=1),
                ),
            )
            for e in self._events
        ]


def forged(
    step: ForgeStep,
    *,
    victim: VmIdentity,
    forger: VmIdentity,
    incarnation: int,
    events: list[dict[str, Any]],
    attest: Callable[[str], Attestation] | None = None,
) -> list[Message]:
    """The messages (body, partition key) a forger on ``forger`` sends about ``victim``, each under a state of its
    own with a sequence no forwarder reaches. ``attest``: the forger's IMDS, for the kinds in ``ATTESTED``."""
    state = uuid.uuid4().hex
    proof = attest(state) if attest is not None and step.kind in ATTESTED else None
    if proof is not None and step.kind == "malformed":
        proof = damaged(proof)
    forgery = _Forgery(state, proof, incarnation, events)
    envelope, document = forgery.envelope, forgery.document
    # The forger's own vmId and resource id (its partition key) under the victim's name: what its own document and
    # its own key allow.
    as_victim = forger.model_copy(update={"name": victim.name})
    short = [{**e, "EventType": "Freeze", "DurationInSeconds": 5} for e in events]
    kinds: dict[str, Callable[[], list[Message]]] = {
        "sequence": lambda: [envelope(victim, kind="heartbeat")],
        "gone": lambda: [envelope(victim, kind="incarnation", document=document([]))],
        "deep": lambda: [_deep(forger, state)],
        "oversized": lambda: [
            envelope(_longest_tags(forger), kind="incarnation", document=document(_many_events(forger)))
        ],
        # The lies about the victim's own events need events to lie about (those the forger's IMDS shows).
        "relabel": lambda: [envelope(victim, kind="incarnation", document=document(short))] if events else [],
        "user": lambda: (
            [envelope(forger, kind="incarnation", document=document([{**e, "EventSource": "User"} for e in events]))]
            if events
            else []
        ),
        "hook": lambda: forgery.hooks(victim),
        "name": lambda: [envelope(as_victim, kind="incarnation", document=document(short))] if events else [],
        "silence": lambda: (
            [
                envelope(as_victim, kind="incarnation", document=document(events)),
                envelope(as_victim, kind="incarnation", document=document([])),
            ]
            if events
            else []
        ),
        "name-hook": lambda: forgery.hooks(as_victim),
        "name-impact": lambda: forgery.impacts(as_victim),
        "squat": lambda: [
            envelope(
                victim.model_copy(update={"vmId": forger.vmId}),
                kind="incarnation",
                document=document(short),
            )
        ],
        "malformed": lambda: [envelope(forger, kind="heartbeat")],
        "scale-set": lambda: _elsewhere(forgery, forger, events),
    }
    return kinds[step.kind]()


def _elsewhere(forgery: _Forgery, forger: VmIdentity, events: list[dict[str, Any]]) -> list[Message]:
    """The forger's own events under its own identity, in a scale set not its own."""
    lied = forger.model_copy(update={"vmScaleSetName": f"not-{forger.vmScaleSetName}"[:64]})
    return [forgery.envelope(lied, kind="incarnation", document=forgery.document(events))] if events else []


class LyingListener:
    """A listener on ``about``'s hybrid connection, run by a process with root on VM ``by``: it answers every
    approval request "approved" with ``by``'s own attested document for that decision (the best proof its IMDS
    signs), and executes nothing. ``answered`` lists the (eventId, decisionId) it lied about."""

    def __init__(self, *, relay_endpoint: str, hybrid_connection: str, vm_url: str) -> None:
        self.answered: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        imds = ImdsClient(base_url=vm_url, timeout=5.0, limiter=RateLimiter(requests=1000))
        self._vm_url = vm_url
        self._listener = RelayListener(
            endpoint=relay_endpoint,
            hybrid_connection=hybrid_connection,
            token_provider=EntraTokenProvider(credential=ImdsManagedIdentityCredential(imds=imds)),
            handler=self._lie,
        )

    def start(self) -> LyingListener:
        self._listener.start()
        return self

    def stop(self) -> None:
        self._listener.stop(timeout=5)

    def _lie(self, request: RelayRequest) -> RelayResponse:
        approval = ApprovalRequest.model_validate_json(request.body)
        with self._lock:
            self.answered.append((approval.eventId, approval.decisionId))
        answer = requests.get(
            f"{self._vm_url}/metadata/attested/document",
            params={"api-version": ATTESTED_API_VERSION, "nonce": decision_nonce(approval.decisionId)},
            headers={"Metadata": "true"},
            timeout=5,
        )
        result = ApprovalResult(
            outcome="approved",
            eventId=approval.eventId,
            decisionId=approval.decisionId,
            attestation=Attestation.model_validate(answer.json()) if answer.ok else None,
        )
        return RelayResponse(200, "OK", {"Content-Type": "application/json"}, result.model_dump_json().encode())


def _deep(vm: VmIdentity, state: str) -> Message:
    """An envelope whose document's one event is a list nested ``DEEP`` deep: well-formed JSON no schema allows."""
    head = Envelope(
        vm=vm, observedAt=now_utc(), sequence=FORGED_SEQUENCE, forwarder=FORGER, stateId=state, kind="heartbeat"
    )
    text = head.to_json_bytes().decode()
    nested = "[" * DEEP + "]" * DEEP
    body = text[:-1] + f', "document": {{"DocumentIncarnation": 1, "Events": [{nested}]}}}}'
    return body.replace('"kind":"heartbeat"', '"kind":"incarnation"').encode(), vm.partition_key


def _longest_tags(vm: VmIdentity) -> VmIdentity:
    """The VM's identity with as many tags as the envelope allows, each name and value as long as allowed."""
    tags = {f"{index:03d}".ljust(MAX_TAG_NAME, "t"): "v" * MAX_TAG_VALUE for index in range(MAX_TAGS)}
    return vm.model_copy(update={"tags": tags})


def _many_events(vm: VmIdentity) -> list[dict[str, Any]]:
    """As many events as the coordinator accepts in one document, each naming the VM."""
    return [
        {
            "EventId": str(uuid.uuid4()).upper(),
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": [vm.name],
            "EventStatus": "Scheduled",
            "NotBefore": "",
            "DurationInSeconds": 5,
            "EventSource": "Platform",
        }
        for _ in range(MAX_EVENTS)
    ]
