"""A scale set's automatic repairs through Azure Resource Manager: their state and their suspension.

``GET {scale set}/instanceView`` gives ``orchestrationServices[]``: the ``AutomaticRepairs`` service's
``serviceState`` (Running, Suspended, NotRunning when the scale set has no repairs policy enabled);
``POST {scale set}/setOrchestrationServiceState`` with ``{"serviceName": "AutomaticRepairs", "action": "Suspend" |
"Resume"}`` changes it (200, or 202: accepted, done in the background; the next timer tick reads the state again).
api-version 2025-04-01, the one the Bicep deploys the scale set with. Permission: the custom role *Scheduled Events
Repairs Operator* (``virtualMachineScaleSets/read`` and ``.../setOrchestrationServiceState/action``, nothing else)
on the fleet's resource group (infra/). Errors raise ``RepairsError`` naming the scale set, the call and ARM's answer.
"""

from __future__ import annotations

import json
from typing import Literal, Protocol, get_args

from azure.core.credentials import TokenCredential
from azure.core.exceptions import AzureError
from azure.core.rest import HttpRequest, HttpResponse

from coordinator.adapters import deadline
from coordinator.adapters.arm import ArmClient, ArmOptions

__all__ = ["API_VERSION", "ArmRepairs", "RepairsClient", "RepairsError", "RepairsState"]

API_VERSION = "2025-04-01"
SERVICE = "AutomaticRepairs"
RepairsState = Literal["Running", "Suspended", "NotRunning"]


class RepairsError(Exception):
    """A call about a scale set's automatic repairs failed: which, and ARM's answer."""


class RepairsClient(Protocol):
    def state(self, scale_set: str) -> RepairsState: ...

    def set(self, scale_set: str, action: Literal["Suspend", "Resume"]) -> None: ...


class ArmRepairs:
    """``RepairsClient`` over ARM with the coordinator's identity (module docstring)."""

    def __init__(self, *, credential: TokenCredential, arm: ArmOptions | None = None) -> None:
        self._client = ArmClient(credential=credential, moniker="repairs", options=arm)

    def close(self) -> None:
        self._client.close()

    def state(self, scale_set: str) -> RepairsState:
        answer = self._call("GET", f"{scale_set}/instanceView?api-version={API_VERSION}", None, scale_set)
        try:
            services = json.loads(answer.content).get("orchestrationServices") or []
        except (ValueError, AttributeError) as error:
            raise RepairsError(f"{scale_set}: the instance view is not JSON ARM's shape: {error}") from error
        state = next((s.get("serviceState") for s in services if s.get("serviceName") == SERVICE), "NotRunning")
        for known in get_args(RepairsState):
            if state == known:
                return known  # type: ignore[no-any-return]
        raise RepairsError(f"{scale_set}: {SERVICE} is in state {state!r}, which this coordinator does not know")

    def set(self, scale_set: str, action: Literal["Suspend", "Resume"]) -> None:
        body = {"serviceName": SERVICE, "action": action}
        self._call("POST", f"{scale_set}/setOrchestrationServiceState?api-version={API_VERSION}", body, scale_set)

    def _call(self, method: str, path: str, body: object, scale_set: str) -> HttpResponse:
        request = HttpRequest(method, path, json=body) if body is not None else HttpRequest(method, path)
        call = f"{method} {path.partition('?')[0].rsplit('/', 1)[-1]}"
        try:
            response = self._client.send(request)
        except AzureError as error:  # raised only once the retry policy gave up
            raise RepairsError(f"{scale_set}: {call} failed: {error.message}") from error
        except deadline.DeadlineExceeded as error:
            raise RepairsError(f"{scale_set}: {error}") from error
        if response.status_code not in (200, 202):
            raise RepairsError(f"{scale_set}: {call} answered {response.status_code}: {response.text()[:300]}")
        return response
