"""DirectImdsCallback: FOR LOCAL USE ONLY. Approves straight into the IMDS emulator over loopback HTTP.

In Azure the coordinator cannot reach a VM's IMDS (169.254.169.254 answers only inside the VM); approvals travel
through Azure Relay to the VM's listener (coordinator/adapters/relay_sender.py -> forwarder/approver.py). This stand-in
plays that listener without the Relay: it reads the VM's current document from the emulator's per-VM URL, judges
the request with the listener's own rules (``forwarder.approval_rules.judge``: listed, still Scheduled, names
Resources, a Terminate only through the VM it deletes, and the decision's facts against the document and the VM's
hook ledger), and only then POSTs ``{"StartRequests": [{"EventId": ...}]}``.

It is not in the Functions package (scripts/package-functions.sh ships coordinator/ only); the local runner, the
benchmarks and the coordinator's tests wire it in with ``approve_directly``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlsplit

import requests
from pydantic import ValidationError

from contracts import wire
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.attestation import ATTESTED_API_VERSION, Attestation, decision_nonce
from contracts.document import ScheduledEventsDocument
from contracts.envelope import VmIdentity
from coordinator import ApprovalDeliveryError, Coordinator, CoordinatorSettings, build_coordinator
from forwarder.approval_rules import judge
from forwarder.durable_state import Store

API_VERSION = "2020-07-01"

# A VM's own hook ledger: (VM name, EventId) -> the prepare phase's outcome, None when it has not finished.
HookLedger = Callable[[str, str], str | None]


class DirectImdsCallback:
    """``ApprovalCallback`` for the local mode and tests: ``base_url`` is the IMDS emulator (``http://127.0.0.1:P``);
    each VM is addressed as ``{base_url}/vm/{name}``. ``hook_ledger`` answers for the VMs' own hook ledgers, which
    only the forwarders keep; without one, an approval that rested on a VM's prepare hooks is refused, as that VM's
    listener would refuse it if its hooks had not succeeded."""

    def __init__(
        self,
        *,
        base_url: str,
        timeout: float = 5.0,
        session: requests.Session | None = None,
        hook_ledger: HookLedger | None = None,
        prove: bool = True,
    ) -> None:
        host = urlsplit(base_url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"DirectImdsCallback is for a loopback IMDS emulator only, not {base_url!r}")
        self._base = base_url.rstrip("/")
        self._timeout = timeout
        self._session = session or requests.Session()
        self._hook_ledger = hook_ledger
        # Answer with the VM's attested document for the decision, as its listener does (off: as an older one).
        self._prove = prove

    def _url(self, vm: VmIdentity) -> str:
        return f"{self._base}/vm/{quote(vm.name, safe='')}/metadata/scheduledevents?api-version={API_VERSION}"

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        url = self._url(vm)
        headers = {"Metadata": "true"}
        ledger = self._hook_ledger
        prepare_outcome = functools.partial(ledger, vm.name) if ledger is not None else None
        # The proof first, as the listener takes it: a VM whose delete this starts has no IMDS a moment later.
        proof = self._proof(request.decisionId, vm)
        try:
            current = self._session.get(url, headers=headers, timeout=self._timeout)
            if current.status_code != 200:
                raise ApprovalDeliveryError(f"IMDS of {vm.name} answered {current.status_code} to GET")
            document = ScheduledEventsDocument.model_validate_json(current.content)
            # The listener's own judgement, on what the listener reads (contracts/wire.py).
            answer = judged(
                request,
                wire.ScheduledEventsDocument.from_mapping(document.model_dump()),
                vm_name=vm.name,
                prepare_outcome=prepare_outcome,
                proof=proof,
            )
            if answer.outcome != "approved":
                return answer
            if request.facts is not None and request.facts.forceHook:
                # A force step's hook runs on the VM, by its listener (forwarder/approver.py): none here.
                reason = f"force hook {request.facts.forceHook}: no listener runs VM hooks in direct mode"
                return answer.model_copy(update={"outcome": "rejected", "reason": reason})
            posted = self._session.post(
                url, headers=headers, json={"StartRequests": [{"EventId": request.eventId}]}, timeout=self._timeout
            )
        except (requests.RequestException, ValidationError) as error:
            raise ApprovalDeliveryError(f"IMDS of {vm.name} unreachable: {type(error).__name__}: {error}") from error
        if posted.status_code != 200:
            raise ApprovalDeliveryError(f"IMDS of {vm.name} answered {posted.status_code} to the StartRequest")
        return answer

    def _proof(self, decision_id: str, vm: VmIdentity) -> Attestation | None:
        """The VM's attested document for the decision, as its listener takes it (forwarder/approver.py)."""
        if not self._prove:
            return None
        url = (
            f"{self._base}/vm/{quote(vm.name, safe='')}/metadata/attested/document?api-version="
            f"{ATTESTED_API_VERSION}&nonce={decision_nonce(decision_id)}"
        )
        try:
            answer = self._session.get(url, headers={"Metadata": "true"}, timeout=self._timeout)
            return Attestation.model_validate_json(answer.content) if answer.status_code == 200 else None
        except (requests.RequestException, ValidationError):
            return None  # answered without proof, as a listener whose IMDS refused it


def judged(
    request: ApprovalRequest,
    document: wire.ScheduledEventsDocument,
    *,
    vm_name: str,
    proof: Attestation | None,
    prepare_outcome: Callable[[str], str | None] | None = None,
) -> ApprovalResult:
    """A listener's answer to ``request`` on its VM's fresh ``document``: its own rules
    (``forwarder.approval_rules.judge``), with the VM's attested document for the decision (``proof``)."""
    outcome, reason = judge(
        wire.ApprovalRequest.from_mapping(request.model_dump()),
        document,
        vm_name=vm_name,
        prepare_outcome=prepare_outcome,
        # The stand-in has no clock of its own: the request's issue time, the coordinator's, is the VM's here.
        now=request.issuedAt,
    )
    return ApprovalResult(
        outcome=outcome,
        eventId=request.eventId,
        decisionId=request.decisionId,
        documentIncarnation=document.DocumentIncarnation,
        reason=reason,
        attestation=proof,
    )


def forwarder_hook_ledger(vms_dir: Path) -> HookLedger:
    """Each VM's hook ledger as its forwarder keeps it, in ``vms_dir/NAME/state`` (the local stack's layout)."""

    def ledger(vm: str, event_id: str) -> str | None:
        path = vms_dir / vm / "state" / "forwarder.sqlite"
        if not path.exists():
            return None
        store = Store(path)
        try:
            return store.hook_outcome(event_id, "prepare")
        finally:
            store.close()

    return ledger


def direct_coordinator(
    settings: Callable[[], CoordinatorSettings], imds_url: str, *, hook_ledger: HookLedger | None = None
) -> functools._lru_cache_wrapper[Coordinator]:
    """A cached builder of the coordinator that approves through ``DirectImdsCallback`` instead of Azure Relay, to
    stand in for ``function_app.coordinator`` (``cache_clear`` starts afresh with the settings then in the
    environment): the local wiring of what the deployed app cannot do."""

    @functools.cache
    def coordinator() -> Coordinator:
        current = settings()
        # Proofs only for a coordinator that requires them: one that does not still verifies a proof it is given,
        # against trust anchors that, in such a test, need not be the emulator's.
        callback = DirectImdsCallback(base_url=imds_url, hook_ledger=hook_ledger, prove=current.require_attestation)
        return build_coordinator(current, callback=callback)

    return coordinator
