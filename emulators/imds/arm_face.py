"""The IMDS emulator's ARM face: the Maintenance RP's acknowledge (one event, or a list), the Compute RP's lists the
census reads, the operations a drill triggers, a scale set's automatic repairs, and the answers injected for them
(emulators/imds/arm.py, drills.py and repairs.py hold the pure parts)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from emulators.imds.arm import (
    ACKNOWLEDGE,
    ACKNOWLEDGE_LIST,
    API_VERSIONS,
    COMPUTE_API_VERSIONS,
    LIST_API_VERSIONS,
    ArmAnswer,
    ArmFault,
    ArmLists,
    ScheduledEventsIdList,
    arm_error,
    list_answer,
    refusal,
    vms_of,
)
from emulators.imds.drills import (
    INSTANCE_EVICTION,
    OPERATION,
    SCALE_SET,
    SCALE_SET_ACTION,
    SCALE_SET_INSTANCE_VIEW,
    SET_ORCHESTRATION_SERVICE_STATE,
    VM_EVICTION,
)
from emulators.imds.emulator_core import EmulatorCore
from emulators.imds.models import (
    StartRequestsBody,
)
from emulators.imds.records import EmulatorInputError
from emulators.imds.repairs import ServiceState, parse_input
from emulators.imds.wire import JSON, Reply, RequestHandler, json_body, parse_model


class ArmFace(EmulatorCore):
    """``/subscriptions/...`` requests, and ``/_emulator/arm`` (what the face answered, faults to inject)."""

    def inject_arm_fault(self, spec: ArmFault | dict[str, Any] | None = None, **fields: Any) -> None:
        """The next acknowledges through the ARM face answer this (e.g. ``status=429, retryAfterSeconds=1``)."""
        fault = parse_model(ArmFault, spec if spec is not None else fields, source="ARM fault")
        with self._lock:
            self.arm_faults.add(fault)

    def arm_status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.arm_requests,
                "reads": self.arm_reads,
                "acknowledged": list(self.arm_acknowledged),
                "faultsPending": self.arm_faults.pending(),
                "faultsAnswered": self.arm_faults.answered,
                "automaticRepairs": self._automatic_repairs(),
                "orchestrationServiceCalls": [dict(call) for call in self.drills.repairs.log],
            }

    def _automatic_repairs(self) -> dict[str, ServiceState]:
        """Each scale set's AutomaticRepairs service now, by name (the caller holds the lock)."""
        specs = self.state.scenario.scaleSets
        names = sorted({members[0].vmScaleSetName for members in self._arm_lists().scale_sets.values()})
        return {name: self.drills.repairs.service_state(name, specs.get(name)) for name in names}

    def _arm_checks(
        self, method: str, query: dict[str, list[str]], handler: RequestHandler, versions: tuple[str, ...]
    ) -> None:
        """What every ARM POST answers before it acts: the method, the api-version, the token, then an injected
        fault (which raises)."""
        with self._lock:
            self.arm_requests += 1
        _end_with(refusal(method, "POST", query, handler.headers.get("Authorization"), versions))

    def _acknowledge_one(self, event_id: str, resource: re.Match[str], now: datetime) -> str | None:
        """Approves the event as a StartRequests from one of the resource's VMs that sees it would (the caller holds
        the lock); else the reason it cannot (ARM's 404)."""
        vm_name = self.state.acknowledging_vm(event_id, vms_of(resource, self.state.vms), now)
        if vm_name is None:
            return (
                f"Scheduled event {event_id} was not found on {resource.group('resource')} "
                "(unknown, concluded, or not an event of this resource)"
            )
        body = StartRequestsBody.model_validate({"StartRequests": [{"EventId": event_id}]})
        self.state.approve(vm_name, body, now, via="arm")
        self.arm_acknowledged.append(
            {"EventId": event_id.upper(), "resource": resource.group("resource"), "vm": vm_name}
        )
        return None

    def _acknowledge(
        self, method: str, acknowledge: re.Match[str], query: dict[str, list[str]], handler: RequestHandler
    ) -> tuple[int, bytes, str]:
        """The Maintenance RP's acknowledge of one event (``ScheduledEvents_Acknowledge``)."""
        self._arm_checks(method, query, handler, API_VERSIONS)
        with self._lock:
            _end_with(self.arm_faults.take())
            problem = self._acknowledge_one(acknowledge.group("event"), acknowledge, self.clock.now())
        if problem is not None:
            raise Reply(404, arm_error(404, "NotFound", problem).body)
        return 200, json.dumps({"value": "Successfully Approved"}).encode(), JSON

    def _acknowledge_list(
        self, method: str, resource: re.Match[str], query: dict[str, list[str]], handler: RequestHandler
    ) -> tuple[int, bytes, str]:
        """The list form (``ScheduledEvents_AcknowledgeList``): every event it can acknowledge is; those it cannot
        are named in the error's ``details``."""
        self._arm_checks(method, query, handler, LIST_API_VERSIONS)
        try:
            ids = ScheduledEventsIdList.model_validate(json_body(handler)).value
        except (ValidationError, EmulatorInputError) as error:
            raise Reply(
                400, arm_error(400, "InvalidRequestContent", f"the body is not a ScheduledEventsIdList: {error}").body
            ) from error
        with self._lock:
            _end_with(self.arm_faults.take())
            now = self.clock.now()
            failed = [
                {"target": event_id, "code": "NotFound", "message": problem}
                for event_id in dict.fromkeys(ids)
                if (problem := self._acknowledge_one(event_id, resource, now)) is not None
            ]
        if failed:
            message = f"{len(failed)} of {len(set(ids))} scheduled events could not be acknowledged"
            raise Reply(400, {"error": {"code": "BadRequest", "message": message, "details": failed}})
        return 200, json.dumps({"value": "Successfully Approved"}).encode(), JSON

    def _arm(
        self, method: str, path: str, query: dict[str, list[str]], handler: RequestHandler
    ) -> tuple[int, bytes, str]:
        """The ARM face: the acknowledge, else the Compute RP's lists of scale sets and VMs (arm.list_answer), from
        the VMs that exist now."""
        acknowledge = ACKNOWLEDGE.match(path)
        if acknowledge is not None:
            return self._acknowledge(method, acknowledge, query, handler)
        listed_events = ACKNOWLEDGE_LIST.match(path)
        if listed_events is not None:
            return self._acknowledge_list(method, listed_events, query, handler)
        _end_with(self._repairs(method, path, query, handler))
        _end_with(self._drill(method, path, query, handler))
        _end_with(refusal(method, "GET", query, handler.headers.get("Authorization"), COMPUTE_API_VERSIONS))
        with self._lock:
            _end_with(self.arm_faults.take("read"))
            self.state.advance(self.clock.now())  # a delete that fell due has removed its VMs from the lists
            listed = list_answer(
                path, query, self._arm_lists(), base_url=_base_url(handler), page_size=self.arm_page_size
            )
            if listed is None:
                raise Reply(404, arm_error(404, "InvalidResourceType", f"no ARM route {path}").body)
            self.arm_reads += 1
        if listed.status != 200:
            raise Reply(listed.status, listed.body, listed.headers)
        return listed.status, json.dumps(listed.body).encode(), JSON

    def _arm_lists(self) -> ArmLists:
        """The VMs that exist now, indexed for the lists; made again only when a VM was added, changed or removed
        (the caller holds the lock)."""
        version = (len(self.state.vms), len(self.state.removed), self.state.vm_changes)
        if self._lists is None or self._lists[0] != version:
            live = (vm for name, vm in self.state.vms.items() if name not in self.state.removed)
            self._lists = (version, ArmLists(live))
        return self._lists[1]

    def _drill(self, method: str, path: str, query: dict[str, list[str]], handler: RequestHandler) -> ArmAnswer | None:
        """The Compute RP's operations a drill triggers, their status and the scale set they read
        (emulators/imds/drills.py); None for any other route."""
        action = SCALE_SET_ACTION.match(path)
        eviction = INSTANCE_EVICTION.match(path) or VM_EVICTION.match(path)
        operation = OPERATION.match(path)
        scale_set = SCALE_SET.match(path)
        if action is None and eviction is None and operation is None and scale_set is None:
            return None
        wanted = "POST" if action is not None or eviction is not None else "GET"
        refused = refusal(method, wanted, query, handler.headers.get("Authorization"), COMPUTE_API_VERSIONS)
        if refused is not None:
            return refused
        version = query["api-version"][0]
        body = json_body(handler) if action is not None else None
        with self._lock:
            self.arm_requests += 1
            now = self.clock.now()
            self.state.advance(now)
            if action is not None:
                return self.drills.act(action, body, self.state, now, base_url=_base_url(handler), version=version)
            if eviction is not None:
                return self.drills.evict(eviction, self.state, now)
            if operation is not None:
                monitor = (query.get("monitor") or [""])[0].lower() == "true"
                return self.drills.status(operation, self.state, now, monitor=monitor)
            assert scale_set is not None
            return self.drills.scale_set(scale_set, self.state)

    def _repairs(
        self, method: str, path: str, query: dict[str, list[str]], handler: RequestHandler
    ) -> ArmAnswer | None:
        """A scale set's automatic repairs (emulators/imds/repairs.py): ``setOrchestrationServiceState`` (injected
        faults ``target: write``) and the instance view (``target: read``); None for any other route."""
        setting = SET_ORCHESTRATION_SERVICE_STATE.match(path)
        viewing = SCALE_SET_INSTANCE_VIEW.match(path)
        if setting is None and viewing is None:
            return None
        wanted = "POST" if setting is not None else "GET"
        refused = refusal(method, wanted, query, handler.headers.get("Authorization"), COMPUTE_API_VERSIONS)
        if refused is not None:
            return refused
        if viewing is not None:
            with self._lock:
                self.arm_requests += 1
                self.state.advance(self.clock.now())
                return self.arm_faults.take("read") or self.drills.instance_view(viewing, self.state)
        assert setting is not None
        try:
            body = parse_input(json_body(handler))
        except EmulatorInputError as error:
            body = arm_error(400, "InvalidRequestContent", str(error))
        with self._lock:
            self.arm_requests += 1
            if isinstance(body, ArmAnswer):
                return body
            fault = self.arm_faults.take("write")
            if fault is not None:
                return fault
            now = self.clock.now()
            self.state.advance(now)
            return self.drills.set_orchestration_service_state(
                setting, body, self.state, now, base_url=_base_url(handler), version=query["api-version"][0]
            )

    def _arm_control(self, method: str, path: str, handler: RequestHandler) -> tuple[int, dict[str, Any]]:
        if path == "/_emulator/arm" and method == "GET":
            return 200, self.arm_status()
        if path == "/_emulator/arm/faults" and method == "POST":
            self.inject_arm_fault(parse_model(ArmFault, json_body(handler), source="ARM fault"))
            return 201, self.arm_status()
        raise Reply(404, {"error": f"no control route {method} {path}"})


def _base_url(handler: RequestHandler) -> str:
    """The root the request came in on (the ARM face's https:// port, or the plain one): its links stay on it."""
    base: str = handler.server.base_url  # type: ignore[attr-defined]
    return base


def _end_with(answer: ArmAnswer | None) -> None:
    """Ends the request with ``answer``, if there is one: through Reply, the one way an answer carries its headers
    (a long-running operation's, a fault's Retry-After)."""
    if answer is not None:
        raise Reply(answer.status, answer.body, answer.headers)
