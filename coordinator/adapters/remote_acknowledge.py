"""The second approval callback: acknowledge events through the Maintenance resource provider's REST API (stable
api-version 2025-11-01).

Takes an ``ApprovalRequest`` and the VM it is for; gives an ``ApprovalResult`` or raises ``ApprovalDeliveryError``.
``POST {resource}/providers/Microsoft.Maintenance/scheduledevents/{eventId}/acknowledge?api-version=2025-11-01``
(``ScheduledEvents_Acknowledge``) on Azure Resource Manager, with an Entra ID token for https://management.azure.com
(the coordinator's managed identity). ``{resource}`` is the VM's scale set when it has one (the Event Grid
``subject`` of a scale set VM's event names the scale set), else the VM itself. The spec's example answers 200
``{"value": "Successfully Approved"}``.

Several events of one resource go in one request (``send_many``): the list form ``POST
{resource}/providers/Microsoft.Maintenance/scheduledevents`` with ``{"value": [eventIds]}``
(``ScheduledEvents_AcknowledgeList``), 200 as above, or an error whose ``error.details`` names each event that
failed (``target``, ``code``, ``message``). An event a failed list names is failed with its own code; one it does
not name is acknowledged again alone, since the spec does not say whether an error answer approved the others
(acknowledging twice is harmless: the event is approved already); a refusal that names none (403, 404, 400…)
sends each alone, so the list form is never worse than single acknowledges.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from urllib.parse import quote

import requests
from azure.core.credentials import TokenCredential
from pydantic import BaseModel, ConfigDict, ValidationError

from contracts import bounded_json
from contracts.approval import NOT_AFTER_TOLERANCE, ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters import deadline
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.domain.arm_ids import scale_set_id
from coordinator.domain.retry import Backoff

API_VERSION = "2025-11-01"
ARM_SCOPE = "https://management.azure.com/.default"
ARM_ENDPOINT = "https://management.azure.com"
# ARM's error answer is a small JSON object; a larger one is quoted, not parsed.
MAX_ERROR_BYTES = 64 * 1024
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
    return scale_set_id(vm.resourceId, vm.vmScaleSetName) or vm.resourceId


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


class _EventError(BaseModel):
    """One event's failure in a list acknowledge's error (``ScheduledEventsAcknowledgeErrorDetails``)."""

    model_config = ConfigDict(extra="ignore")
    target: str = ""
    code: str = ""
    message: str = ""


class _ListErrorDetails(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = ""
    message: str = ""
    details: list[_EventError] = []


class _ListError(BaseModel):
    """A list acknowledge's error answer (``ScheduledEventsListAcknowledgeError``)."""

    model_config = ConfigDict(extra="ignore")
    error: _ListErrorDetails = _ListErrorDetails()


def _event_errors(response: requests.Response) -> dict[str, _EventError]:
    """The per-event errors of a list acknowledge's error answer, by upper-cased EventId (empty when it names none
    or is not that shape)."""
    try:
        parsed = _ListError.model_validate(bounded_json.loads(response.content, max_bytes=MAX_ERROR_BYTES))
    except (ValueError, ValidationError):  # bounded_json.JsonRefused is a ValueError
        return {}
    return {item.target.upper(): item for item in parsed.error.details if item.target}


@dataclass
class _Answer:
    """How a POST ended: ``response`` (2xx, or a refusal not worth retrying), else ``problem`` once the retries
    ran out."""

    response: requests.Response | None
    problem: str = ""
    attempts: int = 0


def _arm_error(response: requests.Response) -> str:
    """ARM's error shape {"error": {"code", "message"}}, or the first characters of whatever came back."""
    try:
        error = bounded_json.loads(response.content, max_bytes=MAX_ERROR_BYTES).get("error", {})
        return f"{str(error.get('code', ''))[:100]}: {str(error.get('message', ''))[:400]}"
    except (ValueError, AttributeError):  # bounded_json.JsonRefused is a ValueError
        return response.text[:300]


class RemoteAcknowledgeSender:
    """``ApprovalCallback`` through ARM, with ``send_many`` for several events of one resource. Keyword-only options:

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
        self._backoff = Backoff(*backoff, rng or random.Random())  # noqa: S311 -- jitter, not security
        self._session = deadline.session()

    def url(self, event_id: str, vm: VmIdentity) -> str:
        return f"{self.list_url(vm)}/{quote(event_id, safe='')}/acknowledge?api-version={API_VERSION}"

    def list_url(self, vm: VmIdentity) -> str:
        """The list form's URL without its query (``url`` builds on it)."""
        return f"{self._endpoint}{quote(acknowledge_target(vm))}/providers/Microsoft.Maintenance/scheduledevents"

    def batch_key(self, vm: VmIdentity) -> str:
        """What events must share to go in one list acknowledge: the resource they are acknowledged on."""
        return acknowledge_target(vm).lower()

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return self.send_within(request, vm=vm, seconds=self._deadline)

    def send_within(self, request: ApprovalRequest, *, vm: VmIdentity, seconds: float) -> ApprovalResult:
        """``send`` that ends within ``seconds`` (or its own deadline, whichever is first): a run's share of the
        approval's time, the rest of which the delivery queue has (coordinator/pipeline/act.py)."""
        left = self._left(request)
        if left <= 0:
            raise ApprovalDeliveryError(_expired(request))
        give_up = time.monotonic() + min(self._deadline, left, seconds)
        answer = self._post(self.url(request.eventId, vm), {}, give_up, f"acknowledge of {request.eventId[:128]}")
        return self._single_result(request, vm, answer)

    def send_many(
        self, items: Sequence[tuple[ApprovalRequest, VmIdentity]], *, seconds: float
    ) -> list[ApprovalResult | ApprovalDeliveryError]:
        """Several approvals of one resource (one ``batch_key``) in one list acknowledge, each with its own outcome
        in the order given, within ``seconds``. One that is past its notAfter is not sent."""
        if len({self.batch_key(vm) for _, vm in items}) > 1:
            raise ValueError("send_many takes the events of one resource; group them by batch_key")
        outcomes: list[ApprovalResult | ApprovalDeliveryError | None] = [None] * len(items)
        live: list[int] = []
        for index, (request, _vm) in enumerate(items):
            if self._left(request) <= 0:
                outcomes[index] = ApprovalDeliveryError(_expired(request))
            else:
                live.append(index)
        if len(live) == 1:
            request, vm = items[live[0]]
            outcomes[live[0]] = self._alone(request, vm, seconds)
        elif live:
            self._send_list([(index, *items[index]) for index in live], seconds, outcomes)
        return [outcome if outcome is not None else ApprovalDeliveryError("not sent") for outcome in outcomes]

    def _send_list(
        self,
        items: list[tuple[int, ApprovalRequest, VmIdentity]],
        seconds: float,
        outcomes: list[ApprovalResult | ApprovalDeliveryError | None],
    ) -> None:
        started = time.monotonic()
        give_up = started + min(self._deadline, seconds, *(self._left(request) for _, request, _ in items))
        vm = items[0][2]
        ids = [request.eventId for _, request, _ in items]
        answer = self._post(
            f"{self.list_url(vm)}?api-version={API_VERSION}",
            {"value": ids},
            give_up,
            f"list acknowledge of {len(ids)} events",
        )
        response = answer.response
        if response is None:
            for index, request, _ in items:
                outcomes[index] = ApprovalDeliveryError(
                    f"remote acknowledge of {request.eventId} (a list of {len(ids)}): {answer.problem} after "
                    f"{answer.attempts} attempts; retried later"
                )
            return
        if response.status_code in (200, 202):
            for index, request, _ in items:
                outcomes[index] = _approved(request, vm, f"ARM {response.status_code}, a list of {len(ids)} events")
            return
        # A refusal naming no event (the list form not allowed where the single one is, e.g. a role that holds
        # only the acknowledge action): each event goes alone, so the list is never worse than single acknowledges.
        failed = _event_errors(response)
        for index, request, item_vm in items:
            error = failed.get(request.eventId.upper())
            if error is not None:
                outcomes[index] = ApprovalDeliveryError(
                    f"remote acknowledge of {request.eventId} refused in a list of {len(ids)} (ARM "
                    f"{response.status_code}): {error.code[:100]}: {error.message[:400]}"
                )
                continue
            # Not named among the list's errors: acknowledged alone, within what is left of the time.
            outcomes[index] = self._alone(request, item_vm, seconds - (time.monotonic() - started))

    def _alone(
        self, request: ApprovalRequest, vm: VmIdentity, seconds: float
    ) -> ApprovalResult | ApprovalDeliveryError:
        try:
            return self.send_within(request, vm=vm, seconds=max(0.1, seconds))
        except ApprovalDeliveryError as error:
            return error

    def _left(self, request: ApprovalRequest) -> float:
        """Seconds until a listener would refuse the request: no attempt starts later, by the coordinator's clock."""
        return (request.deadline - self._tolerance - self._clock()).total_seconds()

    def _single_result(self, request: ApprovalRequest, vm: VmIdentity, answer: _Answer) -> ApprovalResult:
        response = answer.response
        if response is None:
            raise ApprovalDeliveryError(
                f"remote acknowledge of {request.eventId}: {answer.problem} after {answer.attempts} attempts; "
                "retried later"
            )
        if response.status_code in (200, 202):
            return _approved(request, vm, f"ARM {response.status_code}")
        raise ApprovalDeliveryError(f"remote acknowledge of {request.eventId} refused: {_refusal(response)}")

    def _post(self, url: str, body: dict[str, list[str]], give_up: float, label: str) -> _Answer:
        """POSTs until a 2xx or a refusal not worth retrying (returned), or until ``give_up`` (monotonic): 429 and
        5xx are retried, waiting at least Retry-After and the project's backoff."""
        attempt = 0
        while True:
            token = self._credential.get_token(ARM_SCOPE).token
            # Each attempt's total deadline (its answer's every byte included), never past the send's.
            attempt_deadline = max(0.1, min(self._attempt_timeout, give_up - time.monotonic()))
            try:
                with deadline.deadline(attempt_deadline, label):
                    response = self._session.post(
                        url, headers={"Authorization": f"Bearer {token}"}, json=body, timeout=attempt_deadline
                    )
            except (requests.RequestException, deadline.DeadlineExceeded) as error:
                problem = f"ARM unreachable: {type(error).__name__}: {str(error)[:300]}"
                wait: float | None = None
            else:
                if response.status_code != 429 and response.status_code < 500:
                    return _Answer(response, attempts=attempt + 1)
                problem = f"ARM {response.status_code}: {_arm_error(response)}"
                wait = _retry_after(response)
            delay = self._backoff.delay(attempt)
            delay = max(delay, wait or 0.0)
            attempt += 1
            if time.monotonic() + delay > give_up:
                return _Answer(None, problem, attempt)
            time.sleep(delay)


def _expired(request: ApprovalRequest) -> str:
    return (
        f"remote acknowledge of {request.eventId} not sent: it expired at {request.deadline.isoformat()} "
        f"({request.notAfterReason or 'its deadline'}); decided again when retried"
    )


def _approved(request: ApprovalRequest, vm: VmIdentity, how: str) -> ApprovalResult:
    return ApprovalResult(
        outcome="approved",
        eventId=request.eventId,
        decisionId=request.decisionId,
        reason=(
            f"acknowledged through the Maintenance RP ({how}) on {acknowledge_target(vm)}; no VM checked the facts; "
            "confirmed when seen Started or gone"
        ),
    )


def _refusal(response: requests.Response) -> str:
    meaning = _MEANING.get(response.status_code, "refused")
    return f"ARM {response.status_code} ({meaning}): {_arm_error(response)}"
