"""The second approval callback (preview): acknowledge an event through the Maintenance resource provider's REST API.

Takes an ``ApprovalRequest`` and the VM it is for; gives an ``ApprovalResult`` or raises ``ApprovalDeliveryError``.
``POST {resource}/providers/Microsoft.Maintenance/scheduledevents/{eventId}/acknowledge?api-version=2023-10-01-preview``
on Azure Resource Manager, with an Entra ID token for https://management.azure.com (the coordinator's managed
identity). ``{resource}`` is the VM's scale set when it has one (the Event Grid ``subject`` of a scale set VM's event
names the scale set), else the VM itself. The spec's example answers 200 ``{"value": "Successfully Approved"}``.

Unlike the Relay path, no VM checks anything: the platform accepts the acknowledge for whatever event id it names
(docs/security.md says what that trades away). A 200/202 is, like IMDS's 200, not proof: success is still the event
seen Started or gone. 429 and 5xx are retried within the request's deadline, honouring Retry-After, with the
project's backoff; any other 4xx is reported at once with ARM's error code and message (404: no such event on
that resource; 403: the identity lacks the role; 409: the event cannot be acknowledged now).

No VM checks the request's ``notAfter`` on this path, so the sender does: no attempt starts later than the
listener's refusal would (``NOT_AFTER_TOLERANCE`` before it), by the coordinator's clock.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from urllib.parse import quote

import requests
from azure.core.credentials import TokenCredential

from contracts import bounded_json
from contracts.approval import NOT_AFTER_TOLERANCE, ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters import deadline
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.domain.retry import backoff_delay

API_VERSION = "2023-10-01-preview"
ARM_SCOPE = "https://management.azure.com/.default"
ARM_ENDPOINT = "https://management.azure.com"
# ARM's error answer is a small JSON object; a larger one is quoted, not parsed.
MAX_ERROR_BYTES = 64 * 1024
_UNIFORM_INSTANCE = re.compile(
    r"^(?P<scale_set>/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Compute/"
    r"virtualMachineScaleSets/[^/]+)/virtualMachines/[^/]+$",
    re.IGNORECASE,
)
_RESOURCE_GROUP = re.compile(r"^/subscriptions/[^/]+/resourceGroups/[^/]+", re.IGNORECASE)
# What each refusal means for an operator, beside ARM's own code and message.
_MEANING = {
    401: "ARM refused the coordinator's token (wrong audience or expired)",
    403: "the coordinator's identity lacks the scheduled-event acknowledge role on this resource (infra/)",
    404: "no such scheduled event on this resource (gone already, or the resource id is not the event's)",
    409: "the event cannot be acknowledged in its present state",
}


def acknowledge_target(vm: VmIdentity) -> str:
    """The ARM resource an event of this VM is acknowledged on: its scale set when it has one (a Uniform instance's
    id ends in ``/virtualMachineScaleSets/{set}/virtualMachines/{n}``; a Flexible one's is a plain VM id with
    vmScaleSetName set), else the VM."""
    uniform = _UNIFORM_INSTANCE.match(vm.resourceId)
    if uniform:
        return uniform.group("scale_set")
    group = _RESOURCE_GROUP.match(vm.resourceId)
    if vm.vmScaleSetName and group:
        return f"{group.group(0)}/providers/Microsoft.Compute/virtualMachineScaleSets/{vm.vmScaleSetName}"
    return vm.resourceId


def _retry_after(response: requests.Response) -> float | None:
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


def _arm_error(response: requests.Response) -> str:
    """ARM's error shape {"error": {"code", "message"}}, or the first characters of whatever came back."""
    try:
        error = bounded_json.loads(response.content, max_bytes=MAX_ERROR_BYTES).get("error", {})
        return f"{str(error.get('code', ''))[:100]}: {str(error.get('message', ''))[:400]}"
    except (ValueError, AttributeError):  # bounded_json.JsonRefused is a ValueError
        return response.text[:300]


class RemoteAcknowledgeSender:
    """``ApprovalCallback`` through ARM. Keyword-only options:

    :keyword credential: a ``TokenCredential`` (the coordinator's managed identity).
    :keyword endpoint: ARM's base URL (the IMDS emulator's locally).
    :keyword deadline_seconds: how long one ``send`` may keep retrying 429/5xx.
    :keyword backoff: (initial, maximum) seconds of the project's backoff between retries.
    """

    def __init__(
        self,
        *,
        credential: TokenCredential,
        endpoint: str = ARM_ENDPOINT,
        deadline_seconds: float = 8.0,
        attempt_timeout: float = 5.0,
        backoff: tuple[float, float] = (0.5, 4.0),
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        not_after_tolerance: timedelta = NOT_AFTER_TOLERANCE,
    ) -> None:
        self._credential = credential
        self._clock = clock
        self._tolerance = not_after_tolerance  # as the listener's (relay_sender.py)
        self._endpoint = endpoint.rstrip("/")
        self._deadline = deadline_seconds
        self._attempt_timeout = attempt_timeout
        self._backoff = backoff
        self._rng = rng or random.Random()  # noqa: S311 -- jitter, not security
        self._session = deadline.session()

    def url(self, event_id: str, vm: VmIdentity) -> str:
        target = acknowledge_target(vm)
        return (
            f"{self._endpoint}{quote(target)}/providers/Microsoft.Maintenance/scheduledevents/"
            f"{quote(event_id, safe='')}/acknowledge?api-version={API_VERSION}"
        )

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return self.send_within(request, vm=vm, seconds=self._deadline)

    def send_within(self, request: ApprovalRequest, *, vm: VmIdentity, seconds: float) -> ApprovalResult:
        """``send`` that ends within ``seconds`` (or its own deadline, whichever is first): a run's share of the
        approval's time, the rest of which the delivery queue has (coordinator/pipeline/act.py)."""
        url = self.url(request.eventId, vm)
        # Retries end at the send's own deadline, its run's seconds or where a listener would refuse the request,
        # whichever is first.
        left = (request.deadline - self._tolerance - self._clock()).total_seconds()
        if left <= 0:
            raise ApprovalDeliveryError(
                f"remote acknowledge of {request.eventId} not sent: it expired at {request.deadline.isoformat()} "
                f"({request.notAfterReason or 'its deadline'}); decided again when retried"
            )
        give_up = time.monotonic() + min(self._deadline, left, seconds)
        attempt = 0
        while True:
            token = self._credential.get_token(ARM_SCOPE).token
            # Each attempt's total deadline (its answer's every byte included), never past the send's.
            attempt_deadline = max(0.1, min(self._attempt_timeout, give_up - time.monotonic()))
            try:
                with deadline.deadline(attempt_deadline, f"acknowledge of {request.eventId[:128]}"):
                    response = self._session.post(
                        url, headers={"Authorization": f"Bearer {token}"}, json={}, timeout=attempt_deadline
                    )
            except (requests.RequestException, deadline.DeadlineExceeded) as error:
                problem = f"ARM unreachable: {type(error).__name__}: {str(error)[:300]}"
                wait: float | None = None
            else:
                if response.status_code in (200, 202):
                    return ApprovalResult(
                        outcome="approved",
                        eventId=request.eventId,
                        decisionId=request.decisionId,
                        reason=(
                            f"acknowledged through the Maintenance RP (ARM {response.status_code}) on "
                            f"{acknowledge_target(vm)}; no VM checked the facts; confirmed when seen Started or gone"
                        ),
                    )
                if response.status_code != 429 and response.status_code < 500:
                    meaning = _MEANING.get(response.status_code, "refused")
                    raise ApprovalDeliveryError(
                        f"remote acknowledge of {request.eventId} refused: ARM {response.status_code} "
                        f"({meaning}): {_arm_error(response)}"
                    )
                problem = f"ARM {response.status_code}: {_arm_error(response)}"
                wait = _retry_after(response)
            delay = backoff_delay(attempt, initial=self._backoff[0], maximum=self._backoff[1], rng=self._rng)
            delay = max(delay, wait or 0.0)
            attempt += 1
            if time.monotonic() + delay > give_up:
                raise ApprovalDeliveryError(
                    f"remote acknowledge of {request.eventId}: {problem} after {attempt} attempts; retried later"
                )
            time.sleep(delay)
