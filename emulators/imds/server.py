"""The IMDS emulator's HTTP face: Scheduled Events, instance metadata, managed-identity tokens, control API.

A stdlib ThreadingHTTPServer on 127.0.0.1; every request takes one lock around the pure state
(`emulators.imds.state.EmulatorState`), so the state machine stays single-threaded. Sleeps for injected faults
happen outside the lock.

A VM that a Terminate deleted or a Preempt evicted has no IMDS any more: the server reads each of its requests
and closes the connection without a response, so its clients see a connection error, never a status.

Each face lives in its own module (``vm_face``, ``arm_face``, ``control_api``, on ``emulator_core``); here a request
is routed to its face.
"""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs, urlsplit

from emulators.imds.arm_face import ArmFace
from emulators.imds.control_api import ControlApi
from emulators.imds.vm_face import VmFace, endpoint_of
from emulators.imds.wire import JSON, NoAnswer, Reply, RequestHandler, bad_request

VM_HEADER = "X-Emulator-VM"
# What the ARM face's own (TLS) port serves: ARM's routes and its control.
ARM_FACE = ("/subscriptions/", "/_emulator/arm")
_VM_PREFIX = re.compile(r"^/vm/(?P<name>[^/]+)(?P<rest>/.*)?$")

__all__ = ["VM_HEADER", "ImdsEmulator"]


class ImdsEmulator(VmFace, ArmFace, ControlApi):
    """An in-process IMDS for tests and the local runner.

    >>> with ImdsEmulator(scenario=Scenario.from_file("emulators/scenarios/documented-example.yaml"),
    ...                   time_scale=60) as imds:
    ...     requests.get(imds.url + "/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"})
    """

    # ---- request handling (called by RequestHandler) ----------------------------------------------------------

    def handle_request(self, handler: RequestHandler, method: str) -> tuple[int, bytes, str]:
        parts = urlsplit(handler.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        path = parts.path.rstrip("/") or "/"
        arm_face = getattr(handler.server, "arm_only", False)
        if arm_face != path.lower().startswith(ARM_FACE):
            where = f"IMDS is at {self.url}" if arm_face else f"ARM is served over TLS at {self.arm_url}"
            raise Reply(404, {"error": f"no route {path} here: {where}"})
        vm_name, path = self._resolve_vm(path, handler.headers.get(VM_HEADER))
        if path.startswith("/_emulator"):
            return self._emulator_routes(method, path, handler)
        if path.lower().startswith("/subscriptions/"):
            return self._arm(method, path, query, handler)
        with self._lock:
            now = self.clock.now()
            self.state.advance(now)  # scenario steps that fell due (deletes, faults) apply to this very request
            if vm_name in self.state.removed:
                self.requests_unanswered[vm_name] += 1
                raise NoAnswer
        endpoint = endpoint_of(path)
        if endpoint is None:
            raise Reply(404, {"error": "Not found"})
        if handler.headers.get("X-Forwarded-For") is not None:
            raise bad_request("Requests with an X-Forwarded-For header are not accepted")
        if (handler.headers.get("Metadata") or "").lower() != "true":
            raise bad_request("Required metadata header not specified")
        with self._lock:
            decision = self.faults.decide(vm=vm_name, endpoint=endpoint, now=now, all_vms=list(self.state.vms))
            self.requests_served[vm_name] += 1
        self._carry_out(decision)
        if endpoint == "scheduledevents":
            status, body = self._scheduled_events(method, vm_name, query, handler, whole=not decision.malformed)
        elif endpoint == "instance":
            return self._instance(method, vm_name, path, query, decision)
        elif endpoint == "attested":
            status, body = self._attested_document(method, vm_name, query)
        else:
            status, body = self._token(method, vm_name, query)
        if decision.malformed and status == 200 and body is not None:
            text = json.dumps(body)
            return status, text[: max(1, len(text) // 2)].encode(), JSON
        return status, b"" if body is None else json.dumps(body).encode(), JSON

    def _resolve_vm(self, path: str, header: str | None) -> tuple[str, str]:
        name = header
        match = _VM_PREFIX.match(path)
        if match:
            name = match.group("name")
            path = match.group("rest") or "/"
        if name is None:
            return self.first_vm, path
        known = self._vm_names.get(name.lower())
        if known is None:
            raise Reply(404, {"error": f"No emulated VM named {name!r}; known: {list(self.state.vms)}"})
        return known, path

    def _emulator_routes(self, method: str, path: str, handler: RequestHandler) -> tuple[int, bytes, str]:
        """The emulator's own routes: the ARM face's control, the attested documents' PKI, the control API."""
        if path.startswith("/_emulator/arm"):
            status, arm = self._arm_control(method, path, handler)
            return status, json.dumps(arm).encode(), JSON
        if path.startswith("/_emulator/pki/"):
            return self._pki(method, path)
        return self._control(method, path, handler)
