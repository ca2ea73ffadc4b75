"""Waves a budget decides (``python -m benchmarks.wave --policy budget-KIND``): one policy per kind of budget, the
VMs' listeners that take the approvals, and whether the budget held.

The default wave's events all wait for a person, so no budget is ever counted or claimed in it. Each policy here
puts the same wave's Reboots, Redeploys and Freezes under one kind of budget. On benchmarks/wave_fleet.py's fleet
(a scale set and placement group per group of 20 VMs, zone ``g % 3 + 1`` by group, fault domain ``i % 3`` and update
domain ``i % 5`` within it; each event reaches VMs 0-4 of its group), the tags, percent, fault-domain, update-domain
and placement-group budgets approve every event (one event per scale set: the domains they count are the scale
set's) and the zone, rate and sequence budgets run out part way through the wave:

=================  ===========================================================  ====================================
kind               the rule                                                     10,000 VMs (500 events)
=================  ===========================================================  ====================================
tags               matched by a tag, 5 VMs per scale set                        every event approved
percent            25 % of each scale set                                       every event approved
zone               10 % of each zone                                            66 per zone approved, the rest held
fault-domain       30 % of each of a scale set's fault domains                  every event approved
update-domain      1 VM per update domain of a scale set                        every event approved
placement-group    5 VMs per placement group                                    every event approved
rate               approve-now, at most 100 approvals an hour fleet-wide        100 approved, the rest held
sequence           approve-now, one zone at a time                              one zone's events, the rest held
=================  ===========================================================  ====================================

The approvals go through the coordinator's delivery path to ``ListenersElsewhere``, stand-ins for the VMs'
listeners in two processes of their own (the wave's VMs run no forwarder; Relay and IMDS are
benchmarks/approval_latency.py's): each request is judged with the listener's own rules
(``forwarder.approval_rules.judge``) against the document the VM's envelope carried, and answered with the
emulator's attested document of that VM for the decision (its proof, verified by the coordinator), signed there as
IMDS signs on the VM while the coordinator's thread waits for the answer. ``--listeners in-process`` puts them in the
coordinator's process (``WaveListeners``; how the waves ran before 2026-11-30: then the coordinator's CPU included the
VMs' judging and signing).
``budget_problems`` checks the promise, not a count: no domain holds more impacted VMs than its limit, and an event
is held only when its budget is spent.
"""

from __future__ import annotations

import math
import multiprocessing
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from contracts import wire
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import Attestation, decision_nonce
from contracts.envelope import VmIdentity
from emulators.imds import ImdsEmulator, VmSpec
from emulators.imds.attested import AttestedDocuments, Signer
from local.direct_callback import judged

__all__ = ["BUDGETS", "RULE", "BudgetWave", "ListenersElsewhere", "WaveListeners", "budget_problems", "in_process"]

RULE = "wave-budget"
_REACH = "eventType: [Reboot, Redeploy, Freeze]"


@dataclass(frozen=True)
class BudgetWave:
    """One kind of budget: its policy, the domain each VM counts in and a domain's limit by its size (both worked
    out here from the fleet's own facts, apart from the coordinator's code, to judge it)."""

    policy: str
    action: str
    domain: Callable[[VmSpec], str]
    limit: Callable[[int], int]


def _impact(budget: str, *, match: str = _REACH, trust_tags: bool = False) -> str:
    # trustTags: the tag is ARM's (the census), not what the VM says of itself, so it may widen what is approved.
    return f"""version: 1
rules:
  - name: {RULE}
    match: {{{match}}}
    action: approve-within-budget
    budget: {budget}
    trustTags: {str(trust_tags).lower()}
  - name: everything-else-waits
    match: {{}}
    action: wait-for-person
"""


def _paced(pacing: str) -> str:
    return f"""version: 1
rules:
  - name: {RULE}
    match: {{{_REACH}}}
    action: approve-now
    {pacing}
  - name: everything-else-waits
    match: {{}}
    action: wait-for-person
"""


def _at_most(n: int) -> Callable[[int], int]:
    return lambda size: n


def _percent(p: int) -> Callable[[int], int]:
    return lambda size: max(1, math.ceil(size * p / 100))


_APPROVE = "approve-within-budget"
BUDGETS: dict[str, BudgetWave] = {
    "budget-tags": BudgetWave(
        _impact("{maxImpacted: 5, per: [scaleSet]}", match=f"tags: {{team: wave}}, {_REACH}", trust_tags=True),
        _APPROVE,
        lambda vm: vm.vmScaleSetName,
        _at_most(5),
    ),
    "budget-percent": BudgetWave(
        _impact("{maxPercent: 25, per: [scaleSet]}"), _APPROVE, lambda vm: vm.vmScaleSetName, _percent(25)
    ),
    "budget-zone": BudgetWave(_impact("{maxPercent: 10, per: [zone]}"), _APPROVE, lambda vm: vm.zone, _percent(10)),
    # Fault and update domains are numbered per scale set (coordinator VmFacts.domain: "scale set/number").
    "budget-fault-domain": BudgetWave(
        _impact("{maxPercent: 30, per: [faultDomain]}"),
        _APPROVE,
        lambda vm: f"{vm.vmScaleSetName}/{vm.platformFaultDomain}",
        _percent(30),
    ),
    "budget-update-domain": BudgetWave(
        _impact("{maxImpacted: 1, per: [updateDomain]}"),
        _APPROVE,
        lambda vm: f"{vm.vmScaleSetName}/{vm.platformUpdateDomain}",
        _at_most(1),
    ),
    "budget-placement-group": BudgetWave(
        _impact("{maxImpacted: 5, per: [placementGroup]}"), _APPROVE, lambda vm: vm.placementGroupId, _at_most(5)
    ),
    "budget-rate": BudgetWave(
        _paced("rate: {maxApprovals: 100, periodSeconds: 3600, per: fleet}"),
        "approve-now",
        lambda vm: "fleet",
        _at_most(100),
    ),
    "budget-sequence": BudgetWave(_paced("sequence: {per: zone}"), "approve-now", lambda vm: vm.zone, _at_most(1)),
}


class WaveListeners:
    """The wave's VMs' listeners (a stand-in: the wave runs no forwarder): ``send`` judges a request with the
    listener's rules against the document the VM's envelope carried and answers with the VM's attested document
    for the decision, signed by ``attested`` (the IMDS emulator's signer) at the request's issue time. ``computes``:
    each VM's instance metadata (``VmSpec.compute()``), what IMDS signs of it."""

    def __init__(
        self, attested: AttestedDocuments, computes: Mapping[str, dict[str, Any]], documents: Mapping[str, Any]
    ) -> None:
        self._attested = attested
        self._computes = computes
        self._documents = {name: wire.ScheduledEventsDocument.from_mapping(doc) for name, doc in documents.items()}

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return self.answer(request, vm.name)

    def answer(self, request: ApprovalRequest, name: str) -> ApprovalResult:
        document = self._documents.get(name)
        if document is None:
            return ApprovalResult(
                outcome="not-found", eventId=request.eventId, decisionId=request.decisionId, reason="no such VM"
            )
        nonce = decision_nonce(request.decisionId)
        proof = self._attested.document(self._computes[name], nonce=nonce, now=request.issuedAt)
        return judged(request, document, vm_name=name, proof=Attestation.model_validate(proof))


@dataclass(frozen=True)
class _Elsewhere:
    """What a listeners' process needs: the emulator's signing key and certificate (PEM), its issuer URL and
    validity, each VM's instance metadata and the documents their envelopes carried."""

    key: bytes
    certificate: bytes
    issuer_url: str
    validity_seconds: float
    computes: dict[str, dict[str, Any]]
    documents: dict[str, Any]


_HERE: WaveListeners | None = None  # in a listeners' process: its stand-in


def _start(state: _Elsewhere) -> None:
    global _HERE  # noqa: PLW0603 - one stand-in per worker process, made by the pool's initializer
    key = serialization.load_pem_private_key(state.key, password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    signer = Signer(x509.load_pem_x509_certificate(state.certificate), key)
    attested = AttestedDocuments(issuer_url=state.issuer_url, validity_seconds=state.validity_seconds, signer=signer)
    _HERE = WaveListeners(attested, state.computes, state.documents)


def _answer(request: str, vm: str) -> str:
    assert _HERE is not None
    return _HERE.answer(ApprovalRequest.model_validate_json(request), vm).model_dump_json()


def _ready() -> bool:
    return _HERE is not None


class ListenersElsewhere:
    """``WaveListeners`` in processes of their own, as the VMs' listeners run on their VMs: the coordinator's
    approval thread sends the request as JSON and waits for the answer (the GIL released, as for Relay's), and reads
    the answer from its JSON, as ``RelayApprovalSender`` does; the judging and the signing are not the coordinator's
    CPU. (In the coordinator's process they were about 0.3 s of CPU a 500-approval wave.) The workers start before
    the clock."""

    def __init__(self, imds: ImdsEmulator, documents: Mapping[str, Any], *, workers: int = 2) -> None:
        signer = imds.attested.signer()
        state = _Elsewhere(
            key=signer.key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            certificate=signer.certificate.public_bytes(serialization.Encoding.PEM),
            issuer_url=imds.attested.issuer_url,
            validity_seconds=imds.attested.validity.total_seconds(),
            computes={spec.name: spec.compute() for spec in imds.vms()},
            documents=dict(documents),
        )
        self._pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start, initargs=(state,)
        )
        if not all(f.result() for f in [self._pool.submit(_ready) for _ in range(workers)]):
            raise RuntimeError("a listeners' process did not start its stand-in")

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        answer = self._pool.submit(_answer, request.model_dump_json(), vm.name).result()
        return ApprovalResult.model_validate_json(answer)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def in_process(imds: ImdsEmulator, documents: Mapping[str, Any]) -> WaveListeners:
    """The stand-in in the coordinator's process (``--listeners in-process``: how the wave ran before 2026-11-30)."""
    return WaveListeners(imds.attested, {spec.name: spec.compute() for spec in imds.vms()}, documents)


def budget_problems(
    kind: str, specs: Mapping[str, VmSpec], events: Mapping[str, list[str]], states: Mapping[str, str]
) -> list[str]:
    """Whether the budget held: per domain, the VMs the approved events impact within its limit (for a rate, the
    approvals; for a sequence, one domain at a time), and each held event held because its budget is spent
    (``states``: each event's state as the wave left it)."""
    wave = BUDGETS[kind]
    approved = sorted(e for e, state in states.items() if state == "Approved")
    held = sorted(e for e, state in states.items() if state == "Scheduled")
    other = {s for s in states.values() if s not in ("Approved", "Scheduled")}
    found = [f"event states {sorted(other)} (expected Approved or Scheduled)"] if other else []
    if not approved:
        return [*found, f"{kind}: no event approved (the budget decided nothing)"]
    if kind == "budget-sequence":
        zones = {zone for e in approved for zone in _domains(wave, specs, events[e])}
        found += [f"{kind}: events approved in {len(zones)} zones at once ({sorted(zones)})"] if len(zones) > 1 else []
        found += [
            f"{kind}: {e} held in the zone under way" for e in held if _domains(wave, specs, events[e]).keys() & zones
        ]
        return found

    # What each event counts in its domains: one approval (a rate), or its VMs in each.
    def need(event_id: str) -> Counter[str]:
        return Counter({"fleet": 1}) if kind == "budget-rate" else _domains(wave, specs, events[event_id])

    size = Counter(wave.domain(spec) for spec in specs.values())
    used: Counter[str] = Counter()
    for event_id in approved:
        used.update(need(event_id))
    over = {d: n for d, n in used.items() if n > wave.limit(size[d])}
    found += [f"{kind}: domain {d!r} has {n} impacted (limit {wave.limit(size[d])})" for d, n in sorted(over.items())]
    found += [
        f"{kind}: {e} held though its budget had room"
        for e in held
        if all(used[d] + n <= wave.limit(size[d]) for d, n in need(e).items())
    ]
    return found


def _domains(wave: BudgetWave, specs: Mapping[str, VmSpec], names: list[str]) -> Counter[str]:
    return Counter(wave.domain(specs[name]) for name in names)
