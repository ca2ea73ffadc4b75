"""A drill's ARM calls, through the project's one ARM pipeline (coordinator/adapters/arm.py: retries, token,
deadline): the reads a plan rests on, and the calls it makes, each long-running one polled to its end.

Takes an ``ArmClient`` (azure-identity's credential, ARM's endpoint); gives the scale set and its instances parsed
at the boundary (ops/drill/plan.py's models), and per call an ``Outcome``: ARM's status, the operation's end state
and how long it took, or ARM's error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from azure.core.rest import HttpRequest, HttpResponse
from pydantic import ValidationError

from coordinator import ArmClient
from ops.drill.plan import COMPUTE_API_VERSION, Call, DrillInputError, Instance, ScaleSet

# Polls of an operation are at least this far apart and at most this (ARM's Retry-After within these bounds).
POLL_MIN_SECONDS = 0.2
POLL_MAX_SECONDS = 30.0
# Terminal states of an Azure-AsyncOperation (ARM's long-running operations guideline).
TERMINAL = frozenset({"succeeded", "failed", "canceled"})


@dataclass(frozen=True)
class Outcome:
    call: Call
    status: int
    # The operation's end state (Succeeded, Failed, Canceled), "Accepted" for a 204/200 with nothing to poll,
    # "TimedOut" when polling gave up, "" when ARM refused the call.
    state: str
    seconds: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.state in ("Succeeded", "Accepted")


def _json(response: HttpResponse) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _error(response: HttpResponse) -> str:
    body = _json(response)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return f"ARM {response.status_code} {str(error.get('code', ''))[:100]}: {str(error.get('message', ''))[:400]}"
    return f"ARM {response.status_code}: {response.text()[:300]}"


def read_scale_set(client: ArmClient, scale_set_id: str) -> ScaleSet:
    response = client.send(HttpRequest("GET", f"{scale_set_id}?api-version={COMPUTE_API_VERSION}"))
    if response.status_code != 200:
        raise DrillInputError(f"reading scale set {scale_set_id}: {_error(response)}")
    try:
        return ScaleSet.model_validate(_json(response))
    except ValidationError as error:
        raise DrillInputError(f"reading scale set {scale_set_id}: not a scale set: {error}") from error


def read_instances(client: ArmClient, scale_set: ScaleSet) -> list[Instance]:
    """A Uniform scale set's instances, or a Flexible one's members (the resource group's VMs that name it)."""
    if scale_set.uniform:
        url = f"{scale_set.id}/virtualMachines?api-version={COMPUTE_API_VERSION}"
    else:
        group = scale_set.id.split("/providers/", 1)[0]
        url = f"{group}/providers/Microsoft.Compute/virtualMachines?api-version={COMPUTE_API_VERSION}"
    items: list[dict[str, Any]] = []
    next_url: str | None = url
    while next_url:
        response = client.send(HttpRequest("GET", next_url))
        if response.status_code != 200:
            raise DrillInputError(f"listing the VMs of {scale_set.id}: {_error(response)}")
        page = _json(response)
        if not isinstance(page, dict):
            raise DrillInputError(f"listing the VMs of {scale_set.id}: not a list")
        items.extend(item for item in page.get("value", []) if isinstance(item, dict))
        next_url = page.get("nextLink") or None
    if not scale_set.uniform:
        items = [
            item
            for item in items
            if str(((item.get("properties") or {}).get("virtualMachineScaleSet") or {}).get("id", "")).lower()
            == scale_set.id.lower()
        ]
    try:
        return [Instance.model_validate(item) for item in items]
    except ValidationError as error:
        raise DrillInputError(f"listing the VMs of {scale_set.id}: {error}") from error


def execute(
    client: ArmClient,
    call: Call,
    *,
    timeout: float,
    wait: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_poll: Callable[[str], None] | None = None,
) -> Outcome:
    """Makes the call; a 202 is polled through its Azure-AsyncOperation (else Location) until it ends or
    ``timeout`` seconds passed (``wait=False``: not polled)."""
    started = clock()
    response = client.send(HttpRequest(call.method, call.url, json=call.body if call.body is not None else None))
    if response.status_code not in (200, 202, 204):
        return Outcome(call, response.status_code, "", clock() - started, _error(response))
    operation = response.headers.get("Azure-AsyncOperation") or response.headers.get("Location")
    if response.status_code != 202 or not operation or not wait:
        return Outcome(call, response.status_code, "Accepted", clock() - started)
    delay = _retry_after(response)
    while True:
        if clock() + delay - started > timeout:
            return Outcome(call, 202, "TimedOut", clock() - started, f"not over after {timeout:g} s: {operation}")
        sleep(delay)
        poll = client.send(HttpRequest("GET", operation))
        if poll.status_code not in (200, 202):
            return Outcome(call, 202, "", clock() - started, f"polling {operation}: {_error(poll)}")
        state = _state(poll, location=not response.headers.get("Azure-AsyncOperation"))
        if on_poll is not None:
            on_poll(state)
        if state.lower() in TERMINAL:
            body = _json(poll)
            error = body.get("error") if isinstance(body, dict) else None
            message = f"{error.get('code', '')}: {error.get('message', '')}" if isinstance(error, dict) else ""
            return Outcome(call, 202, state, clock() - started, message)
        delay = _retry_after(poll)


def _state(poll: HttpResponse, *, location: bool) -> str:
    """An Azure-AsyncOperation's ``status``; a Location's answer is 202 until done, then 200."""
    if location:
        return "InProgress" if poll.status_code == 202 else "Succeeded"
    body = _json(poll)
    return str(body.get("status", "InProgress")) if isinstance(body, dict) else "InProgress"


def _retry_after(response: HttpResponse) -> float:
    value = (response.headers.get("Retry-After") or "").strip()
    seconds = float(value) if value.isdigit() else POLL_MIN_SECONDS
    return min(POLL_MAX_SECONDS, max(POLL_MIN_SECONDS, seconds))
