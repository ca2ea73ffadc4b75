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
  both ways, for good (``StateStore.claim``, first writer wins): no other VM can speak under that name or resource
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

from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from contracts.approval import ApprovalResult
from contracts.attestation import AttestationError, decision_nonce, state_nonce
from contracts.envelope import Envelope
from coordinator.adapters.census import CensusView
from coordinator.domain.attestation import Attestations
from coordinator.domain.census import identity_problem
from coordinator.state.store import StateStore

T = TypeVar("T")


class StoreOutage(Exception):
    """The state store failed while a message was read at the door: nothing in the message is at fault, and no
    message is refused for want of a read, so the batch fails (Event Hubs delivers it again)."""


def _store(call: Callable[[], T], what: str) -> T:
    try:
        return call()
    except Exception as error:
        raise StoreOutage(f"the state store failed to {what}: {type(error).__name__}: {str(error)[:300]}") from error


def _resource_claim(resource_id: str) -> str:
    return f"vm-resource:{resource_id.lower()}"


def _vm_claim(vm_id: str) -> str:
    return f"vm-id:{vm_id.lower()}"


def _name_claim(name: str) -> str:
    return f"vm-name:{name.lower()}"


def _vm_name_claim(vm_id: str) -> str:
    return f"vm-id-name:{vm_id.lower()}"


def _bound(attestations: Attestations, store: StateStore, name: str) -> str | None:
    known = attestations.remembered(name)
    if known is None and (found := _store(lambda: store.claimed(name), "read a binding")) is not None:
        known = attestations.remember(name, found)
    return known


def _bind(attestations: Attestations, store: StateStore, name: str, value: str) -> str:
    return attestations.remembered(name) or attestations.remember(
        name, _store(lambda: store.claim(name, value), "write a binding")
    )


def binding_problem(attestations: Attestations, store: StateStore, envelope: Envelope, *, claim: bool) -> str:
    """Why this envelope may not speak under its name ("" when it may): the resource id or the name is another
    VM's, or its VM speaks under another resource id or name. ``claim``: bind them to each other where free (an
    attested envelope); a refused envelope binds nothing."""
    vm_id, resource, name = envelope.vm.vmId.lower(), envelope.vm.resourceId.lower(), envelope.vm.name.lower()
    wanted = {
        _vm_claim(vm_id): resource,
        _resource_claim(resource): vm_id,
        _vm_name_claim(vm_id): name,
        _name_claim(name): vm_id,
    }
    bound = {key: _bound(attestations, store, key) for key in wanted}
    if claim and None in bound.values() and all(bound[key] in (None, value) for key, value in wanted.items()):
        # Each claim is insert-only: of two envelopes racing for one name, the later reads the earlier's value
        # and is refused below (what it bound names only itself).
        bound = {key: _bind(attestations, store, key, value) for key, value in wanted.items()}
    named, owner = bound[_vm_claim(vm_id)], bound[_resource_claim(resource)]
    called, holder = bound[_vm_name_claim(vm_id)], bound[_name_claim(name)]
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


def identity_problem_of(
    attestations: Attestations, store: StateStore, envelope: Envelope, *, claim: bool, census: CensusView | None
) -> str:
    """Why the envelope's name, resource id and vmId are not one VM's ("" when they are): ARM's census when it
    lists the VM (the bindings are then written where free, for a later instance whose census cannot be read, and
    never outrank it), else the bindings."""
    verdict = census_problem(census, envelope) if census is not None else None
    if verdict is None:
        return binding_problem(attestations, store, envelope, claim=claim)
    if not verdict and claim:
        binding_problem(attestations, store, envelope, claim=True)
    return verdict


def envelope_problem(
    attestations: Attestations | None,
    store: StateStore,
    envelope: Envelope,
    *,
    at: datetime,
    required: bool,
    census: CensusView | None = None,
) -> str:
    """Why the envelope is not accepted ("" when it is). ``at``: when Event Hubs took the message in (the
    coordinator's time when unknown), which a document valid when sent covers however late the batch runs.
    ``census``: ARM's, when the coordinator has one: the VM's name, resource id and vmId are checked against it."""
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
        return identity_problem_of(attestations, store, envelope, claim=False, census=census)
    try:
        attestations.verifier.verify(
            envelope.attestation, vm_id=envelope.vm.vmId, nonce=state_nonce(envelope.stateId), at=at
        )
    except AttestationError as error:
        return f"attestation refused: {error}"
    return identity_problem_of(attestations, store, envelope, claim=True, census=census)


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
