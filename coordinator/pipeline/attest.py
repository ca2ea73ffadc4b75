"""Who speaks: envelopes and approval answers held to IMDS attested documents (docs/security.md, *Attested
forwarders*).

Every VM of a fleet shares one Event Hubs identity and one Relay identity, so a name in an envelope or an answer is
a claim. Azure's signature settles it:

- **An envelope** carries an attested document of its VM (``vm.vmId``) whose nonce is ``state_nonce(stateId)``,
  valid when Event Hubs took the message in; ``envelope_problem`` checks it. With ``COORDINATOR_REQUIRE_ATTESTATION``
  (the default in Azure and locally) an envelope without a document is refused; with it off, such an envelope is
  taken as before, except under a name or resource id already bound to another vmId.
- **Its name is Azure's.** IMDS signs only the vmId: the name and resource id beside it are the VM's claim, and every
  VM shares one sender identity. With ARM's census, its name, resource id and vmId must be one VM as ARM lists them
  (``domain/census.identity_problem``; a VM ARM does not list yet makes the census read again). Without a census,
  or for a VM it does not list, the first attested envelope of a VM binds its resource id and its name to its vmId,
  both ways, for good (insert-only claims, first writer wins; a batch's are read and written together:
  pipeline/bindings.py): no other VM can speak under that name or resource
  id, nor that VM under another. ARM outranks a binding: a resource id claimed before its VM spoke, or a VM created
  again under one name (a new vmId), is ARM's once the census lists it.
- **An answer** to an approval carries a fresh document whose nonce is ``decision_nonce(decisionId)``: the answer
  of the VM the approval went to, or of another instance listening on its hybrid connection (``answer_problem``).

What fails is refused with a reason that names what to check, never the stateId (the history shows only digests).
A document that cannot be read is refused like one that does not verify (the verifier refuses, never raises); the
bindings are the state store's, and a store that fails raises ``StoreOutage``: the one failure at the door that is
not the message's own, so the batch fails and is delivered again (ingest.read_batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from contracts.approval import ApprovalResult
from contracts.attestation import AttestationError, decision_nonce, state_nonce
from contracts.envelope import Envelope
from coordinator.adapters.census import CensusView
from coordinator.domain.attestation import Attestations
from coordinator.domain.census import identity_problem
from coordinator.pipeline.bindings import (
    StoreOutage,
    Wanted,
    name_claim,
    resolve,
    resource_claim,
    vm_claim,
    vm_name_claim,
)
from coordinator.state.store import StateStore

__all__ = ["Pending", "StoreOutage", "answer_problem", "binding_problems", "door_problem", "envelope_problem"]


@dataclass(frozen=True)
class Pending:
    """An envelope through every check but its bindings: whether it binds its VM (attested), and the census'
    verdict when ARM's census decided ("" accepted: the bindings are then only written; None: they decide)."""

    envelope: Envelope
    claim: bool
    verdict: str | None = None

    def wanted(self) -> Wanted:
        vm = self.envelope.vm
        return Wanted(vm.vmId.lower(), vm.resourceId.lower(), vm.name.lower(), self.claim)


def binding_problems(attestations: Attestations, store: StateStore, pending: Sequence[Pending]) -> list[str]:
    """Each envelope's verdict ("" accepted), its batch's bindings read and written together (pipeline/bindings.py):
    the census' when it decided (its claims then left to the timer), else why its name is not its own. A refused
    envelope binds nothing."""
    cache, backlog = attestations.bindings, attestations.backlog
    for item in pending:
        if item.verdict == "" and item.claim:
            # ARM vouched for it: its claims decide nothing while the census is usable; the timer writes them.
            backlog.add({name: value for name, value in item.wanted().claims().items() if cache.get(name) is None})
    undecided = [item for item in pending if item.verdict is None]
    bound = iter(resolve(cache, store, [item.wanted() for item in undecided], backlog=backlog) if undecided else [])
    return [
        item.verdict if item.verdict is not None else _binding_verdict(item.envelope, next(bound)) for item in pending
    ]


def _binding_verdict(envelope: Envelope, bound: dict[str, str | None]) -> str:
    """Why this envelope may not speak under its name ("" when it may): the resource id or the name is another
    VM's, or its VM speaks under another resource id or name."""
    vm_id, resource, name = envelope.vm.vmId.lower(), envelope.vm.resourceId.lower(), envelope.vm.name.lower()
    named, owner = bound[vm_claim(vm_id)], bound[resource_claim(resource)]
    called, holder = bound[vm_name_claim(vm_id)], bound[name_claim(name)]
    if named is not None and named != resource:
        return (
            f"VM {envelope.vm.vmId} is bound to {named[:300]} (its first attested envelope): it speaks under "
            "another VM's name here; refused"
        )
    if owner is not None and owner != vm_id:
        return (
            f"{envelope.vm.name} ({resource[:300]}) is VM {owner} (bound by its first attested envelope), not VM "
            f"{envelope.vm.vmId}: another VM speaks under its name; refused. A VM deleted and created again under "
            "the same resource id gets a new vmId: delete the state table's 'claim' rows of that name and vmId"
        )
    if called is not None and called != name:
        return (
            f"VM {envelope.vm.vmId} is named {called[:64]!r} (its first attested envelope), not "
            f"{envelope.vm.name[:64]!r}: it speaks under another VM's name here; refused"
        )
    if holder is not None and holder != vm_id:
        return (
            f"vm.name {envelope.vm.name[:64]!r} is VM {holder} (bound by its first attested envelope), not VM "
            f"{envelope.vm.vmId}: another VM speaks under its name; refused"
        )
    return ""


def census_problem(census: CensusView, envelope: Envelope) -> str | None:
    """What ARM's census says of the envelope's name, resource id and vmId together (``identity_problem``): None
    when ARM lists neither, even after reading it again (rate-limited: a flood of invented names costs one read
    per interval)."""
    vm = envelope.vm
    verdict = identity_problem(vm, census.entry(vm.name), census.entry_of_resource(vm.resourceId))
    if verdict is None and census.ensure([vm.name]):
        verdict = identity_problem(vm, census.entry(vm.name), census.entry_of_resource(vm.resourceId))
    return verdict


def door_problem(
    attestations: Attestations | None,
    envelope: Envelope,
    *,
    at: datetime,
    required: bool,
    census: CensusView | None = None,
) -> str | Pending:
    """Why the envelope is not accepted ("" when it is), as far as it is known without its bindings: else what
    they must decide (``binding_problems``). ``at``: when Event Hubs took the message in (the coordinator's time
    when unknown), which a document valid when sent covers however late the batch runs. ``census``: ARM's, when the
    coordinator has one: the VM's name, resource id and vmId are checked against it, and it outranks the bindings
    (which are still written where free, by the timer, for a later instance whose census cannot be read)."""
    if attestations is None:
        # No verifier configured (unit tests of other stages): ARM's census still names the VMs.
        return (census_problem(census, envelope) or "") if census is not None else ""
    if envelope.attestation is None:
        if required:
            return (
                "unattested: the envelope carries no IMDS attested document for its forwarder state, and "
                "COORDINATOR_REQUIRE_ATTESTATION is on (a forwarder older than attestation, or one whose IMDS "
                "refused it: see its log)"
            )
        claim = False
    else:
        try:
            attestations.verifier.verify(
                envelope.attestation, vm_id=envelope.vm.vmId, nonce=state_nonce(envelope.stateId), at=at
            )
        except AttestationError as error:
            return f"attestation refused: {error}"
        claim = True
    verdict = census_problem(census, envelope) if census is not None else None
    if verdict:
        return verdict
    if verdict == "" and not claim:
        return ""
    return Pending(envelope, claim, verdict)


def envelope_problem(
    attestations: Attestations | None,
    store: StateStore,
    envelope: Envelope,
    *,
    at: datetime,
    required: bool,
    census: CensusView | None = None,
) -> str:
    """Why the envelope is not accepted ("" when it is): ``door_problem``, then its bindings alone."""
    found = door_problem(attestations, envelope, at=at, required=required, census=census)
    if isinstance(found, str) or attestations is None:
        return found if isinstance(found, str) else ""
    return binding_problems(attestations, store, [found])[0]


def answer_problem(
    attestations: Attestations | None, result: ApprovalResult, *, vm_id: str, decision_id: str, at: datetime,
    required: bool,
) -> str:  # fmt: skip
    """Why an approval's answer is not the executing VM's ("" when it is): no proof (when required), or a document
    of another VM, or one made for another decision."""
    if attestations is None:
        return ""
    if result.attestation is None:
        return "the answer carries no attested document (proof of which VM answered)" if required else ""
    try:
        attestations.verifier.verify(result.attestation, vm_id=vm_id, nonce=decision_nonce(decision_id), at=at)
    except AttestationError as error:
        return f"the answer's proof is refused: {error}"
    return ""
