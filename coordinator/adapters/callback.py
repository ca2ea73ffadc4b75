"""How an approval decided here reaches the VM. The Azure Relay sender implements this in production."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity


class ApprovalCallback(Protocol):
    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        """Deliver one approval to the VM that should execute it and return what the VM did.

        Raises ``ApprovalDeliveryError`` when the VM could not be reached (nobody listening, timeout);
        the caller retries until the event's NotBefore.
        """
        ...


@runtime_checkable
class BoundedCallback(ApprovalCallback, Protocol):
    def send_within(self, request: ApprovalRequest, *, vm: VmIdentity, seconds: float) -> ApprovalResult:
        """``send``, ended (answered, or ``ApprovalDeliveryError``) within ``seconds``: a run gives each approval a
        few seconds and hands the rest to the delivery queue (coordinator/pipeline/act.py), which must not find the
        run's own attempt still going."""
        ...


class ApprovalDeliveryError(RuntimeError):
    """The approval did not reach the VM; safe to retry (the listener is idempotent)."""
