"""The approval contract (coordinator -> Azure Relay -> the VM's listener -> IMDS). Both sides import this.

The listener approves only an EventId that is in its current IMDS document, still Scheduled, and concerns this
VM's group (a Terminate: this VM itself), and only when the facts the decision rested on (``ApprovalFacts``)
match its fresh document and, where the decision waited for this VM's prepare hooks, its own hook ledger; it
answers with what it did. IMDS answers 200 to any valid EventId, so an "approved" result means "StartRequests was
accepted", not "the event started": the coordinator confirms by seeing Started or gone.

An approval expires: ``notAfter`` is the earliest instant at which a condition the decision rested on stops holding
(the rule's window closes, a blackout opens, the gates' results grow too old, the delivery's deadline, the event's
NotBefore). The listener refuses a request from ``NOT_AFTER_TOLERANCE`` before it on its own clock, and the
coordinator's senders start no attempt then: what reaches IMDS was decided on conditions that still held, as long as
the two clocks agree within the tolerance (docs/security.md, "Approvals expire").
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from contracts import wire_rules
from contracts.attestation import Attestation
from contracts.document import ScheduledEvent

ApprovalOutcome = wire_rules.ApprovalOutcome
# How far the listener's clock and the coordinator's may disagree: a request is refused from this long before its
# notAfter, and no sender starts an attempt then. Azure keeps a VM's clock and a Functions host's on the platform's
# time (host time sync), within milliseconds of each other; 2 s leaves room for a VM whose sync lagged.
NOT_AFTER_TOLERANCE = wire_rules.NOT_AFTER_TOLERANCE


class ApprovalFacts(BaseModel):
    """The facts a decision rested on, as the coordinator recorded them from the VMs' sightings. The listener
    approves only when its own fresh IMDS document shows the same: a VM that lied to the coordinator (one fleet
    identity is shared by every VM) cannot make another VM approve something other than what was decided."""

    model_config = ConfigDict(frozen=True)

    eventType: str = Field(min_length=1, max_length=64)
    eventSource: str = Field(max_length=64)
    durationInSeconds: int
    notBefore: datetime | None
    resources: list[str] = Field(max_length=1000)
    # The VMs whose prepare hooks the rule waited for (empty when the decision did not rest on hooks): the listener
    # of each of them checks its own hook ledger.
    hooksRequired: list[str] = Field(default_factory=list, max_length=1000)
    # Set when the decision rested on NotBefore being this near (an escalation ladder's approve step): the listener
    # executes it only when its own document's NotBefore is within this many seconds of its own clock (with the
    # clock skew it tolerates), so an approval made for the last minutes is not executed an hour early.
    nearNotBeforeSeconds: int | None = Field(default=None, ge=0, le=7 * 86400)
    # Set by an escalation ladder's force step: the listener first runs its own installed hook of this name
    # (``force.d/NAME`` in its hooks folder; a VM without it refuses), answers "accepted" meanwhile, and sends
    # StartRequests only once the hook succeeded and the event, judged again on a fresh document, still may start.
    forceHook: str | None = Field(default=None, pattern=f"^{wire_rules.HOOK_NAME}$")

    @classmethod
    def of(cls, event: ScheduledEvent, *, hooks_required: Iterable[str] = ()) -> ApprovalFacts:
        return cls(**wire_rules.facts_of(event, hooks_required))

    def differences(self, event: ScheduledEvent) -> list[str]:
        """Where this VM's IMDS document disagrees with the facts, each as 'FIELD is X here, the decision rested
        on Y' (empty when they agree). Resources are compared as sets; NotBefore as instants."""
        return wire_rules.facts_differences(ApprovalFacts.of(event), self)


class ApprovalRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    eventId: str = Field(min_length=1, max_length=128)
    decisionId: str = Field(min_length=1, max_length=128)
    rule: str = Field(min_length=1, max_length=256)
    issuedAt: datetime
    # The same instant as notAfter in a request of this release, so that a listener of an earlier release, which
    # reads only this, refuses it past then as well.
    expiresAt: datetime
    # Optional in the model so that an older coordinator's request still parses into a clear refusal, not a 400.
    facts: ApprovalFacts | None = None
    # Until when the decision's conditions hold, and which condition ends first (module docstring); the listener
    # refuses a request without it, past it, or dated beyond the event's NotBefore or a fixed maximum.
    notAfter: datetime | None = None
    notAfterReason: str = Field(default="", max_length=256)
    # The policy the decision was made under (a digest of the loaded policy; "" for a person's approval): logged by
    # the listener, kept in the history, compared by the coordinator before it sends a decision again.
    policyVersion: str = Field(default="", max_length=64)

    @property
    def deadline(self) -> datetime:
        """The instant after which this request must not be executed: the earlier of notAfter and expiresAt."""
        return min(self.expiresAt, self.notAfter) if self.notAfter is not None else self.expiresAt


class ApprovalResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    outcome: ApprovalOutcome
    eventId: str
    decisionId: str
    documentIncarnation: int | None = None
    reason: str = ""
    # IMDS's attested document of the answering VM, its nonce contracts.attestation.decision_nonce(decisionId):
    # proof of which VM answered (optional: a listener older than it, or one whose IMDS refused it, sends none).
    attestation: Attestation | None = None
