"""Delivers an approval to the VM's relay listener: an HTTPS POST through Azure Relay Hybrid Connections.

``POST https://{namespace}/{vm.hybrid_connection_name}/approve`` with the ``ApprovalRequest`` as JSON and a token in
the ``ServiceBusAuthorization`` header: an Entra ID access token for https://relay.azure.net (managed identity, the
production path; the raw token, no ``Bearer``) or a SAS token (``AzureNamedKeyCredential``; emulator and tests), and
the W3C ``traceparent`` of the ``coordinator.approval`` span, so that the listener's spans join the event's trace.

Retries (``coordinator.retry.backoff_delay``, full jitter) cover what a later attempt can fix: no listener
connected (502/503), the listener did not answer in time (504), the listener could not reach IMDS (503), connection
errors and timeouts. They stop at the request's deadline (its ``notAfter``, less the listener's clock tolerance:
the listener refuses it from then, contracts/approval.py) or ``max_retry_seconds`` (the coordinator's approval
deadline), whichever is first; a request already past it is not sent. The listener executes a decisionId at most
once, so a retry after a lost answer never approves twice.

"No listener" is the usual first answer, not a fault: a VM's listener connects only while its document holds an
event it could approve (forwarder/on_demand.py), and it sees the event at about the time the coordinator decides.
Those retries start at ``listener_wait_initial`` (20 ms) and are capped at ``listener_wait_maximum`` (1 s), so that a
listener that connects is found within tens of milliseconds at first and within about a second later; other failures
back off from ``backoff_initial`` up to ``backoff_maximum``. (From 200 ms, full jitter, the first retries' waits were
most of the pipeline's added p99: benchmarks/pipeline_latency.py.)

The relay's own 502 is retried the same way, but it is not "no listener": the relay gives it when the listener went
away (or broke the protocol) with the request outstanding, so the request reached it and its answer was lost
(``ApprovalDeliveryError.answer_lost``), as from a listener whose VM was deleted by the Terminate it had just
executed. Its 503 says that no listener was connected: the request reached nobody (``unreached``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import requests
from azure.core.credentials import AzureNamedKeyCredential, TokenCredential
from pydantic import ValidationError
from urllib3.exceptions import NewConnectionError

from contracts import bounded_json
from contracts.approval import NOT_AFTER_TOLERANCE, ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from contracts.sas import sas_token
from coordinator.adapters import deadline, telemetry
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.closing import Closing
from coordinator.adapters.relay_admin import namespace_for_vm
from coordinator.domain.retry import Backoff

RELAY_SCOPE = "https://relay.azure.net/.default"
# A listener's answer is a small JSON object; a larger one is not read as its refusal.
MAX_ANSWER_BYTES = 64 * 1024
APPROVE_PATH = "approve"
RETRYABLE_STATUS = frozenset({502, 503, 504})
SAS_LIFETIME_SECONDS = 300

log = logging.getLogger("coordinator.adapters.relay_sender")


@dataclass(frozen=True)
class _Retryable:
    """Why an attempt failed in a way a later one may fix; ``no_listener``: the relay itself answered 502/503
    (no listener connected yet), which is retried on the short ``listener_wait_maximum`` cap."""

    reason: str
    no_listener: bool = False
    # The request cannot have reached a listener: its connection was refused, or the relay had no listener.
    unreached: bool = False
    # The request reached a listener, which went away before it answered (the relay's 502): its answer was lost.
    lost: bool = False


class RelayApprovalSender(Closing):
    """``ApprovalCallback`` over Azure Relay.

    :keyword endpoint: namespace base URL (``https://{ns}.servicebus.windows.net``; ``http://127.0.0.1:P`` for the
        emulator), or several when the fleet is sharded over namespaces (``namespace_for_vm`` picks one).
    :keyword credential: a ``TokenCredential`` (managed identity; needs "Azure Relay Sender") or an
        ``AzureNamedKeyCredential`` (SAS rule name and key with Send).
    :keyword attempt_timeout: seconds for one attempt; the relay itself gives up on a silent listener after 60 s.
    :keyword backoff_initial, backoff_maximum: retry delays (full jitter, doubling).
    :keyword listener_wait_initial, listener_wait_maximum: the delays while the relay answers "no listener" (502/503
        from the relay itself, not the listener's own 503 when it cannot reach IMDS): short, since the listener
        connects as its VM sees the event.
    :keyword max_retry_seconds: stop retrying after this long even if the request's deadline is later.
    """

    def __init__(
        self,
        *,
        endpoint: str | Sequence[str],
        credential: TokenCredential | AzureNamedKeyCredential,
        attempt_timeout: float = 70.0,
        connect_timeout: float = 5.0,
        backoff_initial: float = 0.2,
        backoff_maximum: float = 10.0,
        listener_wait_initial: float = 0.02,
        listener_wait_maximum: float = 1.0,
        max_retry_seconds: float | None = None,
        session: requests.Session | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        rng: random.Random | None = None,
        not_after_tolerance: timedelta = NOT_AFTER_TOLERANCE,
    ) -> None:
        # How far the listener's clock may be ahead of this one: it refuses a request from this long before its
        # notAfter, so no attempt starts later (COORDINATOR_CLOCK_TOLERANCE_SECONDS, the forwarder's alike).
        self._tolerance = not_after_tolerance
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not endpoints:
            raise ValueError("RelayApprovalSender needs at least one relay endpoint")
        for item in endpoints:
            if urlsplit(item).scheme not in ("https", "http") or not urlsplit(item).hostname:
                raise ValueError(
                    f"relay endpoint {item!r} must be https://{{namespace}} (http:// only for an emulator)"
                )
        self._endpoints = [item.rstrip("/") for item in endpoints]
        self._credential = credential
        self._attempt_timeout = attempt_timeout
        self._connect_timeout = connect_timeout
        rng = rng or random.Random()  # noqa: S311 - jitter
        self._backoff = Backoff(backoff_initial, backoff_maximum, rng)
        self._listener_wait = Backoff(listener_wait_initial, listener_wait_maximum, rng)
        self._max_retry_seconds = max_retry_seconds
        self._session = session or deadline.session()
        self._clock = clock

    def close(self) -> None:
        self._session.close()

    def endpoint_for(self, vm: VmIdentity) -> str:
        return namespace_for_vm(vm, self._endpoints)

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        return self.send_within(request, vm=vm, seconds=math.inf)

    def send_within(self, request: ApprovalRequest, *, vm: VmIdentity, seconds: float) -> ApprovalResult:
        """``send`` that ends within ``seconds`` (attempts, their connects and the waits between them): a run's
        share of the approval's time, the rest of which the delivery queue has (coordinator/pipeline/act.py)."""
        endpoint = self.endpoint_for(vm)
        hybrid_connection = vm.hybrid_connection_name
        url = f"{endpoint}/{hybrid_connection}/{APPROVE_PATH}"
        body = request.model_dump_json().encode("utf-8")
        budget = min((request.deadline - self._tolerance - self._clock()).total_seconds(), seconds)
        if self._max_retry_seconds is not None:
            budget = min(budget, self._max_retry_seconds)
        if budget <= 0:
            raise ApprovalDeliveryError(
                f"approval {request.decisionId} for event {request.eventId} expired at {request.deadline.isoformat()}"
                f" (the listener refuses it from {self._tolerance.total_seconds():g} s before then) and was not "
                "sent; decided again when retried"
            )
        give_up_at = time.monotonic() + budget
        attempt = 0
        reached = False  # whether some attempt may have reached the VM's listener
        lost = ""  # the first attempt whose answer was lost (it reached the listener, which went away): why
        while True:
            attempt += 1
            remaining = give_up_at - time.monotonic()
            outcome = self._attempt(url, body, hybrid_connection, request, min(self._attempt_timeout, remaining))
            if isinstance(outcome, ApprovalResult):
                log.info(
                    "approval %s for event %s delivered to %s after %d attempt(s): %s %s",
                    request.decisionId, request.eventId, vm.name, attempt, outcome.outcome, outcome.reason,
                )  # fmt: skip
                return outcome
            failure = outcome
            reached = reached or not failure.unreached
            lost = lost or (f"attempt {attempt}: {failure.reason}" if failure.lost else "")
            delay = (self._listener_wait if failure.no_listener else self._backoff).delay(attempt - 1)
            if time.monotonic() + delay >= give_up_at:
                why = (
                    f"no listener connected within {budget:.1f} s, the request's deadline ({failure.reason})"
                    if failure.no_listener and not failure.lost
                    else failure.reason
                )
                if lost:
                    raise ApprovalDeliveryError(
                        f"approval {request.decisionId} for event {request.eventId} reached {vm.name}'s listener, "
                        f"whose answer was lost ({lost}; the relay's 502: the listener went away with the request "
                        f"outstanding), so IMDS may have accepted StartRequests; no answer after {attempt} attempts "
                        f"via {url} (last: {why})",
                        answer_lost=True,
                    )
                raise ApprovalDeliveryError(
                    f"approval {request.decisionId} for event {request.eventId} could not reach {vm.name} via "
                    f"{url} after {attempt} attempts: {why}; the caller may retry until NotBefore",
                    unreached=not reached,
                )
            log.warning(
                "approval %s for event %s: attempt %d failed (%s); retrying in %.2f s",
                request.decisionId, request.eventId, attempt, failure.reason, delay,
            )  # fmt: skip
            time.sleep(delay)

    def _attempt(
        self, url: str, body: bytes, hybrid_connection: str, request: ApprovalRequest, timeout: float
    ) -> ApprovalResult | _Retryable:
        """One POST: the listener's result, or why a retry may help; ApprovalDeliveryError when none will."""
        headers = {
            "ServiceBusAuthorization": self._token(url, hybrid_connection),
            "Content-Type": "application/json",
        }
        # W3C trace context (traceparent): the listener's spans join the event's trace (adapters/telemetry.py).
        telemetry.inject(headers)
        # ``timeout`` is the attempt's total deadline (the answer's every byte included), within the send's.
        try:
            with deadline.deadline(max(0.1, timeout), f"approval POST to {hybrid_connection}"):
                response = self._session.post(
                    url, data=body, headers=headers, timeout=(self._connect_timeout, max(0.1, timeout))
                )
        except (requests.RequestException, deadline.DeadlineExceeded) as error:
            # A connection never made (refused, no route, its connect timed out) carried nothing to anyone.
            return _Retryable(f"{type(error).__name__}: {error}", unreached=_never_connected(error))
        status = response.status_code
        if status in RETRYABLE_STATUS:
            relayed = _listener_error(response) is not None  # the listener's own 503: it could not reach IMDS
            no_listener = status in (502, 503) and not relayed
            # The relay's 503: no listener was connected. Its 502: the listener went away (or broke the protocol)
            # with the request outstanding, so it had the request: retried as briefly, but its answer was lost.
            lost = status == 502 and not relayed
            return _Retryable(
                f"HTTP {status} {_short(response.text)}",
                no_listener=no_listener,
                unreached=no_listener and not lost,
                lost=lost,
            )
        if status == 200:
            return self._result(response, request)
        error_body = _listener_error(response)
        if error_body is not None:
            # The listener itself refused the request: that is an answer, and sending it again cannot change it.
            return ApprovalResult(
                outcome="rejected",
                eventId=request.eventId,
                decisionId=request.decisionId,
                reason=f"listener answered {status}: {error_body}",
            )
        hint = {
            401: "the relay refused the sender's token: check the coordinator identity or SAS key",
            403: "the sender's identity lacks 'Azure Relay Sender' on this hybrid connection (or the SAS has no Send)",
            404: "the hybrid connection does not exist: create it with coordinator.relay_admin",
        }.get(status, "unexpected answer from the relay")
        raise ApprovalDeliveryError(f"POST {url} answered HTTP {status}: {hint}: {_short(response.text)}")

    def _token(self, url: str, hybrid_connection: str) -> str:
        if isinstance(self._credential, AzureNamedKeyCredential):
            resource = f"http://{urlsplit(url).hostname}/{hybrid_connection}"
            return sas_token(
                resource_uri=resource,
                key_name=self._credential.named_key.name,
                key=self._credential.named_key.key,
                expires_on=int(time.time()) + SAS_LIFETIME_SECONDS,
            )
        return self._credential.get_token(RELAY_SCOPE).token

    @staticmethod
    def _result(response: requests.Response, request: ApprovalRequest) -> ApprovalResult:
        try:
            result = ApprovalResult.model_validate_json(response.content)
        except ValidationError as error:
            raise ApprovalDeliveryError(
                f"the listener's answer to {request.decisionId} is not an ApprovalResult: {error.errors()[:3]}"
            ) from None
        if (result.eventId, result.decisionId) != (request.eventId, request.decisionId):
            raise ApprovalDeliveryError(
                f"the listener answered for event {result.eventId}/decision {result.decisionId}, "
                f"not {request.eventId}/{request.decisionId}"
            )
        return result


def _never_connected(error: Exception) -> bool:
    """Whether the POST failed before its connection was made (so before any byte of it was sent)."""
    if isinstance(error, requests.ConnectTimeout):
        return True
    if isinstance(error, requests.ConnectionError):
        reason = getattr(error.args[0], "reason", None) if error.args else None
        return isinstance(reason, NewConnectionError)
    return False


def _listener_error(response: requests.Response) -> str | None:
    """The reason from a listener's ``{"error": …}`` refusal; None when the answer came from the relay itself."""
    if not response.headers.get("Content-Type", "").startswith("application/json"):
        return None
    try:
        payload = bounded_json.loads(response.content, max_bytes=MAX_ANSWER_BYTES)
    except bounded_json.JsonRefused:
        return None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return str(payload["error"])
    return None


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
