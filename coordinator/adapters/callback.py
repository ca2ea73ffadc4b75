"""How an approval decided here reaches the VM. The Azure Relay sender implements this in production."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeGuard, runtime_checkable

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


@runtime_checkable
class BatchCallback(BoundedCallback, Protocol):
    def batch_key(self, vm: VmIdentity) -> str:
        """Approvals whose VMs share this key may go in one ``send_many`` (the Maintenance RP's list acknowledge:
        the events of one resource)."""
        ...

    def send_many(
        self, items: Sequence[tuple[ApprovalRequest, VmIdentity]], *, seconds: float
    ) -> list[ApprovalResult | ApprovalDeliveryError]:
        """Several approvals of one ``batch_key`` in one request, ended within ``seconds``; each one's outcome, in
        the order given (an ``ApprovalDeliveryError`` for one that failed, as ``send`` would have raised it)."""
        ...


class ApprovalDeliveryError(RuntimeError):
    """The approval did not reach the VM; safe to retry (the listener is idempotent).

    ``unreached``: no attempt can have reached the VM's listener (every connect refused, or the relay answered
    that no listener was connected), so the VM cannot be executing it: another VM may be sent the event at once
    (pipeline/attempt.py ``open_after``). Otherwise an attempt may have reached it and it may still execute it.

    ``answer_lost``: an attempt reached the listener, which went away before it answered (the relay's 502: the
    listener disconnected with the request outstanding). Its outcome is unknown, not failed: the listener may have
    had IMDS accept StartRequests just before it went (a VM deleted by the Terminate it executed), and no retry can
    tell once that VM is gone (domain/lifecycle.py ``lost_answer``)."""

    def __init__(self, message: str, *, unreached: bool = False, answer_lost: bool = False) -> None:
        super().__init__(message)
        self.unreached = unreached and not answer_lost
        self.answer_lost = answer_lost


# A callback's kind by its class: ``isinstance`` against a runtime-checkable Protocol walks the protocol's attributes
# at every call (tens of µs in Python 3.11), and a wave asks it several times an approval.
_KINDS: dict[type, tuple[bool, bool]] = {}


def is_bounded(callback: ApprovalCallback) -> TypeGuard[BoundedCallback]:
    """Whether ``callback`` is a ``BoundedCallback`` (can be told how long it may take)."""
    return _kinds(callback)[0]


def is_batch(callback: ApprovalCallback) -> TypeGuard[BatchCallback]:
    """Whether ``callback`` is a ``BatchCallback`` (sends several approvals of one resource in one request)."""
    return _kinds(callback)[1]


def _kinds(callback: ApprovalCallback) -> tuple[bool, bool]:
    kind = type(callback)
    if (known := _KINDS.get(kind)) is None:
        known = _KINDS[kind] = (isinstance(callback, BoundedCallback), isinstance(callback, BatchCallback))
    return known
