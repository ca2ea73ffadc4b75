"""Records an event keeps beside its own decision: the escalation steps taken (``EventRecord.escalation``; the steps
themselves: domain/escalation.py), the shadow policy's verdict (``EventRecord.shadow``: pipeline/shadow.py) and its
VMs' return to service once it completed (``EventRecord.returnToService``: domain/returns.py)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EscalationTaken", "ReturnWatch", "ShadowVerdict", "VmReturn", "refused_force"]


class EscalationTaken(BaseModel):
    """A step of its rule's escalation ladder the event reached (coordinator/domain/escalation.py): which of how many,
    what it did, its time (NotBefore minus its lead), when and by which decision it was taken, whom it told."""

    model_config = ConfigDict(extra="ignore")

    step: int
    of: int
    do: str
    beforeNotBeforeSeconds: int
    at: datetime
    takenAt: datetime
    decisionId: str
    owners: list[str] = Field(default_factory=list)
    hook: str = ""  # a force step's hook
    # A force step's: the VM its approval was sent to, which refused it after its force hook failed (its own report);
    # the step is not taken again (domain/escalation.py).
    refusedBy: str = ""


def refused_force(steps: Iterable[EscalationTaken]) -> EscalationTaken | None:
    """The force step whose approval its VM refused after its force hook failed (``refusedBy``), if any."""
    return next((step for step in steps if step.do == "force" and step.refusedBy), None)


class ShadowVerdict(BaseModel):
    """The shadow policy's decision on the event (a candidate evaluated beside the live policy, never sent), as last
    recorded with a Shadow row: its rule, action, verdict and reason, when, under which version of the candidate, and
    when it first would have approved (kept once set: "would have approved at X")."""

    model_config = ConfigDict(extra="ignore")

    rule: str
    action: str
    verdict: str
    reason: str
    decidedAt: datetime
    policyVersion: str
    approveAt: datetime | None = None


ReturnStatus = Literal["returning", "back", "late", "abandoned"]


class VmReturn(BaseModel):
    """One VM's way back: ``returning`` until its recover hooks are done and its gates pass, ``late`` once the bound
    passed first (still counted impacted), ``back`` (when, how many seconds after the completion), ``abandoned``
    when no longer watched (domain/returns.py, ``RETURN_WATCH_LIMIT`` past the bound); ``waiting``: why not back."""

    model_config = ConfigDict(extra="ignore")

    status: ReturnStatus = "returning"
    backAt: datetime | None = None
    seconds: float | None = None
    waiting: str = ""


class ReturnWatch(BaseModel):
    """The return to service of a completed event's VMs, under its rule's ``returnToService``: since the completion,
    until the bound, with the gates a VM must pass; each VM's status by name."""

    model_config = ConfigDict(extra="ignore")

    rule: str
    since: datetime
    bound: datetime
    gates: list[str] = Field(default_factory=list)
    vms: dict[str, VmReturn] = Field(default_factory=dict)
    # When the last VM came back or was abandoned (None while any is watched): a sequence's gap runs from then.
    doneAt: datetime | None = None

    @property
    def watched(self) -> list[str]:
        """The VMs not back yet (returning or late): each still counts as impacted."""
        return sorted(name for name, vm in self.vms.items() if vm.status in ("returning", "late"))
