"""The IMDS emulator's control API (``/_emulator/...``): events created and cancelled, the approvals and the log,
VMs listed, added and changed, faults injected, listed and cleared, and the emulator's status."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from emulators.imds.emulator_core import EmulatorCore
from emulators.imds.models import (
    EventCreate,
    FaultSpec,
)
from emulators.imds.records import EmulatorInputError
from emulators.imds.wire import JSON, Reply, RequestHandler, json_body, parse_model

_CANCEL = re.compile(r"^/_emulator/events/(?P<id>[^/]+)/cancel$")
_VM_CONTROL = re.compile(r"^/_emulator/vms/(?P<name>[^/]+)$")


class ControlApi(EmulatorCore):
    """The routes tests and the local runner drive the emulator through."""

    def _vm_control(self, method: str, path: str, handler: RequestHandler, now: datetime) -> tuple[int, Any] | None:
        """``GET /_emulator/vms``, ``POST /_emulator/vms`` (a VM joins) and ``PUT /_emulator/vms/{name}`` (fields of
        a VM change); None for any other route."""
        if path == "/_emulator/vms" and method == "GET":
            with self._lock:
                result = self.state.vm_summaries(now)
            for item in result:
                item["requests"] = self.requests_served[item["name"]]
                item["requestsUnanswered"] = self.requests_unanswered[item["name"]]
            return 200, result
        if path == "/_emulator/vms" and method == "POST":
            return 201, self.add_vm(json_body(handler)).model_dump()
        match = _VM_CONTROL.match(path)
        if match is None or method != "PUT":
            return None
        changes = json_body(handler)
        if not isinstance(changes, dict):
            raise EmulatorInputError("the body is the VM's fields to change, as a JSON object")
        return 200, self.update_vm(match.group("name"), **changes).model_dump()

    def _fault_listing(self) -> dict[str, Any]:
        with self._lock:
            return {"faults": self.faults.pending(), "throttleRps": self.faults.throttle_rps}

    def _control(self, method: str, path: str, handler: RequestHandler) -> tuple[int, bytes, str]:
        now = self.clock.now()
        result: Any
        status = 200
        try:
            if path == "/_emulator/events" and method == "POST":
                spec = parse_model(EventCreate, json_body(handler), source="event")
                with self._lock:
                    result = self.state.create_event(spec, now).summary()
                status = 201
            elif path == "/_emulator/events" and method == "GET":
                result = self.events()
            elif (match := _CANCEL.match(path)) and method == "POST":
                result = self.cancel_event(match.group("id"))
            elif path in ("/_emulator/approvals", "/_emulator/log") and method == "GET":
                result = self.approvals() if path.endswith("approvals") else self.truth()
            elif (vms := self._vm_control(method, path, handler, now)) is not None:
                status, result = vms
            elif path == "/_emulator/faults" and method == "POST":
                self.inject_fault(parse_model(FaultSpec, json_body(handler), source="fault"))
                status, result = 201, self._fault_listing()
            elif path == "/_emulator/faults" and method == "GET":
                result = self._fault_listing()
            elif path == "/_emulator/faults" and method == "DELETE":
                with self._lock:
                    self.faults.clear()
                result = self._fault_listing()
            elif path == "/_emulator/status" and method == "GET":
                result = {
                    "scenario": self.scenario.name,
                    "timeScale": self.time_scale,
                    "stepErrors": list(self.state.step_errors),
                    "throttled": self.faults.throttled_count,
                    "removedVms": self.removed_vms(),
                }
            else:
                raise Reply(404, {"error": f"no control route {method} {path}"})
        except (EmulatorInputError, ValueError) as error:
            raise Reply(400, {"error": str(error)}) from error
        return status, json.dumps(result).encode(), JSON
