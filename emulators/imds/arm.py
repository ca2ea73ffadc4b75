"""The IMDS emulator's ARM face: the Maintenance RP's scheduled-event acknowledge (preview), for the coordinator's
remote-acknowledge callback (coordinator/adapters/remote_acknowledge.py).

Takes ``POST {vm or scale set id}/providers/Microsoft.Maintenance/scheduledevents/{eventId}/acknowledge
?api-version=2023-10-01-preview`` with ``Authorization: Bearer <token>``; gives what ARM gives, in ARM's error shape
``{"error": {"code", "message"}}``: 401 without a valid token, 403 for a token of another audience (the brief's
choice; real ARM may answer 401 ``InvalidAuthenticationTokenAudience``, unverified), 404 for an event that the
resource's VMs do not see, 200 ``{"value": "Successfully Approved"}`` (the spec's example) otherwise. The event is
then approved in the emulator's state exactly as one of the resource's VMs POSTing StartRequests would, so its
lifecycle proceeds. Injected ARM faults (``ArmFault``: 429 with Retry-After, 5xx, 403, 409…) answer the next
acknowledges first, after the token check.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from emulators.imds.models import VmSpec
from emulators.tokens import TokenError, verify_token

ARM_AUDIENCE = "https://management.azure.com"
API_VERSIONS = ("2023-10-01-preview",)
ACKNOWLEDGE = re.compile(
    r"^(?P<resource>/subscriptions/(?P<subscription>[^/]+)/resourcegroups/(?P<group>[^/]+)/providers/"
    r"microsoft\.compute/(?P<kind>virtualmachines|virtualmachinescalesets)/(?P<name>[^/]+))"
    r"/providers/microsoft\.maintenance/scheduledevents/(?P<event>[^/]+)/acknowledge$",
    re.IGNORECASE,
)
_FAULT_CODES = {
    403: "AuthorizationFailed",
    404: "NotFound",
    409: "Conflict",
    429: "TooManyRequests",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


class ArmFault(BaseModel):
    """Answer the next ``count`` acknowledges with ``status`` (and Retry-After, when given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: int = Field(ge=400, le=599)
    count: int = Field(default=1, ge=1, le=1000)
    retryAfterSeconds: int | None = Field(default=None, ge=0, le=3600)


@dataclass
class ArmAnswer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def arm_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> ArmAnswer:
    return ArmAnswer(status, {"error": {"code": code, "message": message}}, headers or {})


class ArmFaults:
    """The queue of injected ARM answers (the caller holds the emulator's lock)."""

    def __init__(self) -> None:
        self._queue: deque[ArmFault] = deque()
        self.answered = 0

    def add(self, fault: ArmFault) -> None:
        self._queue.extend([fault.model_copy(update={"count": 1})] * fault.count)

    def take(self) -> ArmAnswer | None:
        if not self._queue:
            return None
        fault = self._queue.popleft()
        self.answered += 1
        headers = {"Retry-After": str(fault.retryAfterSeconds)} if fault.retryAfterSeconds is not None else {}
        code = _FAULT_CODES.get(fault.status, "InjectedFault")
        return arm_error(fault.status, code, f"injected by the emulator ({fault.status})", headers)

    def pending(self) -> int:
        return len(self._queue)


def check_token(authorization: str | None) -> ArmAnswer | None:
    """None when the bearer token is valid and for ARM; else the refusal."""
    if not authorization or not authorization.startswith("Bearer "):
        return arm_error(401, "AuthenticationFailed", "Authentication failed. The 'Authorization' header is missing.")
    token = authorization.removeprefix("Bearer ").strip()
    try:
        verify_token(token, audience=ARM_AUDIENCE)
    except TokenError as error:
        try:
            verify_token(token, audience=_audience_of(token))
        except TokenError:
            return arm_error(401, "InvalidAuthenticationToken", f"The access token is invalid: {error}")
        return arm_error(
            403,
            "InvalidAuthenticationTokenAudience",
            f"The access token has been obtained for the wrong audience or resource '{_audience_of(token)}'; "
            f"it should be {ARM_AUDIENCE}",
        )
    return None


def _audience_of(token: str) -> str:
    import jwt  # noqa: PLC0415 -- only to read a refused token's audience

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return ""
    return str(claims.get("aud", ""))


def vms_of(resource: re.Match[str], vms: dict[str, VmSpec]) -> list[str]:
    """The emulated VMs the acknowledge names: the VM itself, or every VM of the scale set."""
    subscription, group = resource.group("subscription").lower(), resource.group("group").lower()
    name = resource.group("name").lower()
    found = []
    for vm in vms.values():
        if vm.subscriptionId.lower() != subscription or vm.resourceGroupName.lower() != group:
            continue
        if resource.group("kind").lower() == "virtualmachinescalesets":
            if vm.vmScaleSetName.lower() == name:
                found.append(vm.name)
        elif vm.resourceId.lower() == resource.group("resource").lower() or vm.name.lower() == name:
            found.append(vm.name)
    return found
