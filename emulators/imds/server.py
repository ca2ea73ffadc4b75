"""The IMDS emulator's HTTP face: Scheduled Events, instance metadata, managed-identity tokens, control API.

A stdlib ThreadingHTTPServer on 127.0.0.1; every request takes one lock around the pure state
(`emulators.imds.state.EmulatorState`), so the state machine stays single-threaded. Sleeps for injected faults
happen outside the lock.

A VM that a Terminate deleted or a Preempt evicted has no IMDS any more: the server reads each of its requests
and closes the connection without a response, so its clients see a connection error, never a status.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

from pydantic import BaseModel, ValidationError

from emulators.imds.arm import (
    ACKNOWLEDGE,
    ACKNOWLEDGE_LIST,
    API_VERSIONS,
    COMPUTE_API_VERSIONS,
    DEFAULT_PAGE_SIZE,
    LIST_API_VERSIONS,
    ArmAnswer,
    ArmFault,
    ArmFaults,
    ArmLists,
    ScheduledEventsIdList,
    arm_error,
    check_token,
    list_answer,
    vms_of,
)
from emulators.imds.attested import (
    DEFAULT_VALIDITY_SECONDS,
    ISSUER_PATH,
    ROOT_PATH,
    AttestedDocuments,
    CertificateAuthority,
    NonceError,
)
from emulators.imds.clock import Clock, SystemClock
from emulators.imds.drills import INSTANCE_EVICTION, OPERATION, SCALE_SET, SCALE_SET_ACTION, VM_EVICTION, Drills
from emulators.imds.faults import DEFAULT_THROTTLE_RPS, Endpoint, FaultDecision, FaultPlan
from emulators.imds.models import (
    EventCreate,
    FaultSpec,
    Scenario,
    StartRequestsBody,
    VmSpec,
    describe_validation_error,
)
from emulators.imds.state import DEFAULT_STARTED_MIN_SECONDS, EmulatorInputError, EmulatorState
from emulators.imds.versions import (
    ATTESTED_VERSIONS,
    IDENTITY_VERSIONS,
    INSTANCE_VERSIONS,
    SCHEDULED_EVENTS_VERSIONS,
    newest,
)
from emulators.tokens import mint_token

VM_HEADER = "X-Emulator-VM"
_VM_PREFIX = re.compile(r"^/vm/(?P<name>[^/]+)(?P<rest>/.*)?$")
_CANCEL = re.compile(r"^/_emulator/events/(?P<id>[^/]+)/cancel$")
_VM_CONTROL = re.compile(r"^/_emulator/vms/(?P<name>[^/]+)$")
_MAX_BODY = 64 * 1024
TOKEN_LIFETIME_SECONDS = 3600
_JSON = "application/json; charset=utf-8"
_M = TypeVar("_M", bound=BaseModel)


class _Reply(Exception):
    """Ends a request with a status, a JSON body (none for 204) and headers: the error shapes of the real service,
    and ARM's answers that carry headers (a long-running operation's ``Azure-AsyncOperation``)."""

    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or {}


class _NoAnswer(Exception):
    """Ends a request with no response at all: the connection is closed (the VM is gone)."""


def _bad_request(message: str) -> _Reply:
    return _Reply(400, {"error": f"Bad request. {message}"})


class ImdsEmulator:
    """An in-process IMDS for tests and the local runner.

    >>> with ImdsEmulator(scenario=Scenario.from_file("emulators/scenarios/documented-example.yaml"),
    ...                   time_scale=60) as imds:
    ...     requests.get(imds.url + "/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"})
    """

    def __init__(
        self,
        *,
        scenario: Scenario | None = None,
        time_scale: float = 1.0,
        port: int = 0,
        clock: Clock | None = None,
        started_min_seconds: float = DEFAULT_STARTED_MIN_SECONDS,
        throttle_rps: float = DEFAULT_THROTTLE_RPS,
        authority: CertificateAuthority | None = None,
        attested_validity_seconds: float = DEFAULT_VALIDITY_SECONDS,
        attested_cache_seconds: float = 0.0,
        arm_page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self.scenario = scenario or Scenario.default()
        self._authority = authority
        self._attested_options = (attested_validity_seconds, attested_cache_seconds)
        self._attested: AttestedDocuments | None = None
        self.time_scale = time_scale
        self.clock: Clock = clock or SystemClock()
        self.faults = FaultPlan(throttle_rps=throttle_rps, time_scale=time_scale)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.state = EmulatorState(
            self.scenario,
            start=self.clock.now(),
            time_scale=time_scale,
            started_min_seconds=started_min_seconds,
            on_fault=self.faults.add,
        )
        # Azure VM names are case-insensitive (a client may lower-case the URL: Microsoft's JavaScript
        # @azure/identity does); the scenario refuses two names that differ only in case.
        self._vm_names = {name.lower(): name for name in self.state.vms}
        self.requests_served: Counter[str] = Counter()
        # The ARM face (emulators/imds/arm.py): injected answers, and what was acknowledged through it.
        self.arm_faults = ArmFaults()
        self.arm_acknowledged: list[dict[str, Any]] = []
        self.arm_requests = 0
        # The Compute lists the census reads (arm.list_answer): pages of this many items; reads answered.
        self.arm_page_size = arm_page_size
        self.arm_reads = 0
        self._lists: tuple[tuple[int, int, int], ArmLists] | None = None
        # The Compute RP's operations drills trigger (emulators/imds/drills.py).
        self.drills = Drills()
        self.requests_unanswered: Counter[str] = Counter()  # per removed VM
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> str:
        if self._server is not None:
            return self.url
        server = ThreadingHTTPServer(("127.0.0.1", self._port), _Handler)
        with self._lock:
            self.state.begin(self.clock.now())  # scenario offsets count from start(), not construction
        server.daemon_threads = True
        server.emulator = self  # type: ignore[attr-defined]
        self._server = server
        self._stopping.clear()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.name = f"imds-emulator-{self.port}"
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self._stopping.set()  # wakes requests hung by a fault
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ImdsEmulator:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the emulator is not started; call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, vm_name: str) -> str:
        """Base URL that makes every IMDS request come from this VM (use it as a client's IMDS endpoint)."""
        if vm_name not in self.state.vms:
            raise KeyError(f"no emulated VM {vm_name!r}; known: {list(self.state.vms)}")
        return f"{self.url}/vm/{quote(vm_name, safe='')}"

    def scheduled_events_url(self, vm_name: str | None = None, *, api_version: str = "2020-07-01") -> str:
        base = self.url_for(vm_name) if vm_name is not None else self.url
        return f"{base}/metadata/scheduledevents?api-version={api_version}"

    def identity_environment(self, vm_name: str) -> dict[str, str]:
        """Environment that points azure-identity's ManagedIdentityCredential at this VM's token endpoint."""
        return {"AZURE_POD_IDENTITY_AUTHORITY_HOST": self.url_for(vm_name)}

    # ---- control (Python) ------------------------------------------------------------------------------------

    @property
    def attested(self) -> AttestedDocuments:
        """The attested endpoint's signer (emulators/imds/attested.py), made on first use: its certificate names
        this emulator's issuer URL, so it exists only once the port is known."""
        with self._lock:
            if self._attested is None:
                validity, cache = self._attested_options
                self._attested = AttestedDocuments(
                    issuer_url=self.url + ISSUER_PATH,
                    authority=self._authority,
                    validity_seconds=validity,
                    cache_seconds=cache,
                )
            return self._attested

    @property
    def root_pem(self) -> bytes:
        """The root a verifier trusts for this emulator's attested documents (also served at ROOT_PATH)."""
        return self.attested.authority.root_pem

    def create_event(self, spec: EventCreate | dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Schedules an event; returns its global summary (with EventId). Fields as in EventCreate, e.g.
        ``create_event(EventType="Freeze", Resources=["WestNO_0"], NoticeSeconds=60)``."""
        parsed = _parse(EventCreate, spec if spec is not None else fields, source="event")
        with self._lock:
            return self.state.create_event(parsed, self.clock.now()).summary()

    def cancel_event(self, event_id: str) -> dict[str, Any]:
        with self._lock:
            return self.state.cancel_event(event_id, self.clock.now()).summary()

    def inject_fault(self, spec: FaultSpec | dict[str, Any] | None = None, **fields: Any) -> None:
        parsed = _parse(FaultSpec, spec if spec is not None else fields, source="fault")
        with self._lock:
            self.state.apply_fault(parsed, self.clock.now())

    def document(self, vm_name: str | None = None, *, api_version: str = "2020-07-01") -> dict[str, Any]:
        """The document a VM would read now (not counted as a request, never faulted)."""
        with self._lock:
            return self.state.document(vm_name or self.first_vm, api_version, self.clock.now())

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.state.event_summaries(self.clock.now())

    def approvals(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.state.approval_summaries(self.clock.now())

    def truth(self) -> dict[str, Any]:
        """What happened, as an oracle reads it: every event with its states and times (``transitions``), every
        accepted approval with its VM, time and path (``via``: imds or arm), and every VM's every document content
        with when it began and when a client first and last read it whole (``incarnations``)."""
        with self._lock:
            now = self.clock.now()
            return {
                "events": self.state.event_summaries(now),
                "approvals": self.state.approval_summaries(now),
                "incarnations": self.state.incarnation_summaries(now),
                "removedVms": self.state.removal_summaries(now),
            }

    def vms(self) -> list[VmSpec]:
        return list(self.state.vms.values())

    def update_vm(self, name: str, **changes: Any) -> VmSpec:
        """Changes what Azure knows of a VM (its tags, zone, fault or update domain, placement group…): its instance
        metadata and the ARM face's lists both say the new values from now on (a tag edited in the portal, a VM
        redeployed elsewhere). Its name, ids and scale set stay."""
        with self._lock:
            return self.state.update_vm(name, changes)

    def add_vm(self, spec: VmSpec | dict[str, Any]) -> VmSpec:
        """A VM that joins now (a scale-out): IMDS answers for it and the ARM face lists it."""
        parsed = _parse(VmSpec, spec, source="VM")
        with self._lock:
            self.state.add_vm(parsed)
            self._vm_names[parsed.name.lower()] = parsed.name
        return parsed

    def removed_vms(self) -> dict[str, dict[str, Any]]:
        """VMs gone for good, each with the event that removed it and when: ``{vm: {EventId, EventType, at}}``."""
        with self._lock:
            return self.state.removal_summaries(self.clock.now())

    @property
    def first_vm(self) -> str:
        return next(iter(self.state.vms))

    # ---- request handling (called by _Handler) -------------------------------------------------------------

    def _handle(self, handler: _Handler, method: str) -> tuple[int, bytes, str]:
        parts = urlsplit(handler.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        path = parts.path.rstrip("/") or "/"
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
                raise _NoAnswer
        endpoint = _endpoint_of(path)
        if endpoint is None:
            raise _Reply(404, {"error": "Not found"})
        if handler.headers.get("X-Forwarded-For") is not None:
            raise _bad_request("Requests with an X-Forwarded-For header are not accepted")
        if (handler.headers.get("Metadata") or "").lower() != "true":
            raise _bad_request("Required metadata header not specified")
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
            return status, text[: max(1, len(text) // 2)].encode(), _JSON
        return status, b"" if body is None else json.dumps(body).encode(), _JSON

    def _carry_out(self, decision: FaultDecision) -> None:
        if decision.throttled:
            raise _Reply(429, {"error": "Too many requests"})
        for seconds in (decision.delay_seconds, decision.hang_seconds):
            if seconds > 0 and self._stopping.wait(seconds):
                raise _Reply(503, {"error": "Service unavailable"})
        if decision.error_status is not None:
            raise _Reply(decision.error_status, {"error": "Internal server error"})

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
            raise _Reply(404, {"error": f"No emulated VM named {name!r}; known: {list(self.state.vms)}"})
        return known, path

    @staticmethod
    def _api_version(query: dict[str, list[str]], known: tuple[str, ...]) -> str:
        versions = query.get("api-version")
        if not versions or not versions[0]:
            raise _Reply(
                400,
                {
                    "error": "Bad request. api-version was not specified in the request. "
                    "For more information refer to aka.ms/azureimds",
                    "newest-versions": newest(known),
                },
            )
        if versions[0] not in known:
            raise _Reply(
                400,
                {
                    "error": "Bad request. api-version is invalid or was not specified in the request. "
                    "For more information refer to aka.ms/azureimds",
                    "newest-versions": newest(known),
                },
            )
        return versions[0]

    def _scheduled_events(
        self, method: str, vm_name: str, query: dict[str, list[str]], handler: _Handler, *, whole: bool
    ) -> tuple[int, dict[str, Any] | None]:
        version = self._api_version(query, SCHEDULED_EVENTS_VERSIONS)
        if method == "GET":
            with self._lock:
                # A garbled answer (malformed-json fault) is not a document the client could read.
                return 200, self.state.document(vm_name, version, self.clock.now(), served=whole)
        if method != "POST":
            raise _Reply(405, {"error": "Method not allowed"})
        raw = handler.read_body()
        try:
            body = StartRequestsBody.model_validate_json(raw)
        except ValidationError as error:
            raise _bad_request(describe_validation_error(error, source="StartRequests body")) from error
        with self._lock:
            try:
                self.state.approve(vm_name, body, self.clock.now())
            except EmulatorInputError as error:
                raise _bad_request(str(error)) from error
        return 200, None

    def _instance(
        self, method: str, vm_name: str, path: str, query: dict[str, list[str]], decision: FaultDecision
    ) -> tuple[int, bytes, str]:
        if method != "GET":
            raise _Reply(405, {"error": "Method not allowed"})
        self._api_version(query, INSTANCE_VERSIONS)
        vm = self.state.vms[vm_name]
        node: Any = {"compute": vm.compute(), "network": _network(vm)}
        for key in path.removeprefix("/metadata/instance").strip("/").split("/"):
            if not key:
                continue
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise _Reply(404, {"error": "Not found"})
        output = (query.get("format") or ["json"])[0]
        if not isinstance(node, dict | list):
            if output != "text":
                raise _bad_request("Query parameter 'format=text' is required for leaf nodes")
            return 200, str(node).encode(), "text/plain; charset=utf-8"
        text = json.dumps(node)
        if decision.malformed:
            text = text[: max(1, len(text) // 2)]
        return 200, text.encode(), _JSON

    def _emulator_routes(self, method: str, path: str, handler: _Handler) -> tuple[int, bytes, str]:
        """The emulator's own routes: the ARM face's control, the attested documents' PKI, the control API."""
        if path.startswith("/_emulator/arm"):
            status, arm = self._arm_control(method, path, handler)
            return status, json.dumps(arm).encode(), _JSON
        if path.startswith("/_emulator/pki/"):
            return self._pki(method, path)
        return self._control(method, path, handler)

    def _pki(self, method: str, path: str) -> tuple[int, bytes, str]:
        if method != "GET":
            raise _Reply(405, {"error": "Method not allowed"})
        if path == ISSUER_PATH:
            # What the signing certificate's CA Issuers URL names (DER, as Microsoft's PKI serves .crt files).
            return 200, self.attested.authority.issuer_der, "application/pkix-cert"
        if path == ROOT_PATH:
            return 200, self.root_pem, "application/x-pem-file"
        raise _Reply(404, {"error": f"no PKI route {path}"})

    def _attested_document(self, method: str, vm_name: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            raise _Reply(405, {"error": "Method not allowed"})
        self._api_version(query, ATTESTED_VERSIONS)
        nonces = query.get("nonce")
        if nonces is not None and len(nonces) > 1:
            raise _bad_request("Requests with duplicate query parameter names are not accepted")
        with self._lock:
            vm = self.state.vms[vm_name].compute()
            now = self.clock.now()
        try:
            return 200, self.attested.document(vm, nonce=nonces[0] if nonces else None, now=now)
        except NonceError as error:
            raise _bad_request(str(error)) from error

    def _token(self, method: str, vm_name: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        if method != "GET":
            raise _Reply(405, {"error": "Method not allowed"})
        self._api_version(query, IDENTITY_VERSIONS)
        resource = (query.get("resource") or [""])[0]
        if not resource:
            raise _Reply(
                400, {"error": "invalid_request", "error_description": "Required audience parameter not specified"}
            )
        vm = self.state.vms[vm_name]
        for parameter, expected in (("client_id", vm.client_id), ("msi_res_id", vm.resourceId)):
            given = (query.get(parameter) or [""])[0]
            if given and given.lower() != expected.lower():
                raise _Reply(400, {"error": "invalid_request", "error_description": "Identity not found"})
        token, expires_on = mint_token(
            audience=resource, identity_resource_id=vm.resourceId, lifetime_seconds=TOKEN_LIFETIME_SECONDS
        )
        now = int(time.time())
        return 200, {
            "access_token": token,
            "client_id": vm.client_id,
            "expires_in": str(expires_on - now),
            "expires_on": str(expires_on),
            "ext_expires_in": str(expires_on - now),
            "not_before": str(now),
            "resource": resource,
            "token_type": "Bearer",
        }

    def inject_arm_fault(self, spec: ArmFault | dict[str, Any] | None = None, **fields: Any) -> None:
        """The next acknowledges through the ARM face answer this (e.g. ``status=429, retryAfterSeconds=1``)."""
        fault = _parse(ArmFault, spec if spec is not None else fields, source="ARM fault")
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
            }

    def _arm_checks(
        self, method: str, query: dict[str, list[str]], handler: _Handler, versions: tuple[str, ...]
    ) -> None:
        """What every ARM POST answers before it acts: the method, the api-version, the token, then an injected
        fault (which raises)."""
        with self._lock:
            self.arm_requests += 1
        if method != "POST":
            raise _Reply(405, arm_error(405, "MethodNotAllowed", f"{method} is not allowed here").body)
        version = (query.get("api-version") or [""])[0]
        if version not in versions:
            answer = arm_error(
                400, "InvalidApiVersionParameter", f"api-version {version!r} is not one of {list(versions)}"
            )
            raise _Reply(answer.status, answer.body)
        refusal = check_token(handler.headers.get("Authorization"))
        if refusal is not None:
            raise _Reply(refusal.status, refusal.body, refusal.headers)

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
        self, method: str, acknowledge: re.Match[str], query: dict[str, list[str]], handler: _Handler
    ) -> tuple[int, bytes, str]:
        """The Maintenance RP's acknowledge of one event (``ScheduledEvents_Acknowledge``)."""
        self._arm_checks(method, query, handler, API_VERSIONS)
        with self._lock:
            fault = self.arm_faults.take()
            if fault is not None:
                raise _Reply(fault.status, fault.body, fault.headers)
            problem = self._acknowledge_one(acknowledge.group("event"), acknowledge, self.clock.now())
        if problem is not None:
            raise _Reply(404, arm_error(404, "NotFound", problem).body)
        return 200, json.dumps({"value": "Successfully Approved"}).encode(), _JSON

    def _acknowledge_list(
        self, method: str, resource: re.Match[str], query: dict[str, list[str]], handler: _Handler
    ) -> tuple[int, bytes, str]:
        """The list form (``ScheduledEvents_AcknowledgeList``): every event it can acknowledge is; those it cannot
        are named in the error's ``details``."""
        self._arm_checks(method, query, handler, LIST_API_VERSIONS)
        try:
            ids = ScheduledEventsIdList.model_validate(_json_body(handler)).value
        except (ValidationError, EmulatorInputError) as error:
            raise _Reply(
                400, arm_error(400, "InvalidRequestContent", f"the body is not a ScheduledEventsIdList: {error}").body
            ) from error
        with self._lock:
            fault = self.arm_faults.take()
            if fault is not None:
                raise _Reply(fault.status, fault.body, fault.headers)
            now = self.clock.now()
            failed = [
                {"target": event_id, "code": "NotFound", "message": problem}
                for event_id in dict.fromkeys(ids)
                if (problem := self._acknowledge_one(event_id, resource, now)) is not None
            ]
        if failed:
            message = f"{len(failed)} of {len(set(ids))} scheduled events could not be acknowledged"
            raise _Reply(400, {"error": {"code": "BadRequest", "message": message, "details": failed}})
        return 200, json.dumps({"value": "Successfully Approved"}).encode(), _JSON

    def _arm(self, method: str, path: str, query: dict[str, list[str]], handler: _Handler) -> tuple[int, bytes, str]:
        """The ARM face: the acknowledge, else the Compute RP's lists of scale sets and VMs (arm.list_answer), from
        the VMs that exist now."""
        acknowledge = ACKNOWLEDGE.match(path)
        if acknowledge is not None:
            return self._acknowledge(method, acknowledge, query, handler)
        listed_events = ACKNOWLEDGE_LIST.match(path)
        if listed_events is not None:
            return self._acknowledge_list(method, listed_events, query, handler)
        drill = self._drill(method, path, query, handler)
        if drill is not None:
            # Through _Reply, the one way an answer carries headers (a long-running operation's among them).
            raise _Reply(drill.status, drill.body, drill.headers)
        if method != "GET":
            raise _Reply(405, arm_error(405, "MethodNotAllowed", f"{method} is not allowed here").body)
        version = (query.get("api-version") or [""])[0]
        if version not in COMPUTE_API_VERSIONS:
            wrong = arm_error(
                400, "InvalidApiVersionParameter", f"api-version {version!r} is not one of {list(COMPUTE_API_VERSIONS)}"
            )
            raise _Reply(wrong.status, wrong.body)
        refusal = check_token(handler.headers.get("Authorization"))
        if refusal is not None:
            raise _Reply(refusal.status, refusal.body, refusal.headers)
        with self._lock:
            fault = self.arm_faults.take("read")
            if fault is not None:
                raise _Reply(fault.status, fault.body, fault.headers)
            self.state.advance(self.clock.now())  # a delete that fell due has removed its VMs from the lists
            listed = list_answer(path, query, self._arm_lists(), base_url=self.url, page_size=self.arm_page_size)
            if listed is None:
                raise _Reply(404, arm_error(404, "InvalidResourceType", f"no ARM route {path}").body)
            self.arm_reads += 1
        if listed.status != 200:
            raise _Reply(listed.status, listed.body, listed.headers)
        return listed.status, json.dumps(listed.body).encode(), _JSON

    def _arm_lists(self) -> ArmLists:
        """The VMs that exist now, indexed for the lists; made again only when a VM was added, changed or removed
        (the caller holds the lock)."""
        version = (len(self.state.vms), len(self.state.removed), self.state.vm_changes)
        if self._lists is None or self._lists[0] != version:
            live = (vm for name, vm in self.state.vms.items() if name not in self.state.removed)
            self._lists = (version, ArmLists(live))
        return self._lists[1]

    def _drill(  # noqa: PLR0911 -- one return per route and per refusal
        self, method: str, path: str, query: dict[str, list[str]], handler: _Handler
    ) -> ArmAnswer | None:
        """The Compute RP's operations a drill triggers, their status and the scale set they read
        (emulators/imds/drills.py); None for any other route."""
        action = SCALE_SET_ACTION.match(path)
        eviction = INSTANCE_EVICTION.match(path) or VM_EVICTION.match(path)
        operation = OPERATION.match(path)
        scale_set = SCALE_SET.match(path)
        if action is None and eviction is None and operation is None and scale_set is None:
            return None
        wanted = "POST" if action is not None or eviction is not None else "GET"
        if method != wanted:
            return arm_error(405, "MethodNotAllowed", f"{method} is not allowed here")
        version = (query.get("api-version") or [""])[0]
        if version not in COMPUTE_API_VERSIONS:
            return arm_error(
                400, "InvalidApiVersionParameter", f"api-version {version!r} is not one of {list(COMPUTE_API_VERSIONS)}"
            )
        refusal = check_token(handler.headers.get("Authorization"))
        if refusal is not None:
            return refusal
        body = _json_body(handler) if action is not None else None
        with self._lock:
            self.arm_requests += 1
            now = self.clock.now()
            self.state.advance(now)
            if action is not None:
                return self.drills.act(action, body, self.state, now, base_url=self.url, version=version)
            if eviction is not None:
                return self.drills.evict(eviction, self.state, now)
            if operation is not None:
                monitor = (query.get("monitor") or [""])[0].lower() == "true"
                return self.drills.status(operation, self.state, now, monitor=monitor)
            assert scale_set is not None
            return self.drills.scale_set(scale_set, self.state)

    def _arm_control(self, method: str, path: str, handler: _Handler) -> tuple[int, dict[str, Any]]:
        if path == "/_emulator/arm" and method == "GET":
            return 200, self.arm_status()
        if path == "/_emulator/arm/faults" and method == "POST":
            self.inject_arm_fault(_parse(ArmFault, _json_body(handler), source="ARM fault"))
            return 201, self.arm_status()
        raise _Reply(404, {"error": f"no control route {method} {path}"})

    def _vm_control(self, method: str, path: str, handler: _Handler, now: datetime) -> tuple[int, Any] | None:
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
            return 201, self.add_vm(_json_body(handler)).model_dump()
        match = _VM_CONTROL.match(path)
        if match is None or method != "PUT":
            return None
        changes = _json_body(handler)
        if not isinstance(changes, dict):
            raise EmulatorInputError("the body is the VM's fields to change, as a JSON object")
        return 200, self.update_vm(match.group("name"), **changes).model_dump()

    def _fault_listing(self) -> dict[str, Any]:
        with self._lock:
            return {"faults": self.faults.pending(), "throttleRps": self.faults.throttle_rps}

    def _control(self, method: str, path: str, handler: _Handler) -> tuple[int, bytes, str]:
        now = self.clock.now()
        result: Any
        status = 200
        try:
            if path == "/_emulator/events" and method == "POST":
                spec = _parse(EventCreate, _json_body(handler), source="event")
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
                self.inject_fault(_parse(FaultSpec, _json_body(handler), source="fault"))
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
                raise _Reply(404, {"error": f"no control route {method} {path}"})
        except (EmulatorInputError, ValueError) as error:
            raise _Reply(400, {"error": str(error)}) from error
        return status, json.dumps(result).encode(), _JSON


def _endpoint_of(path: str) -> Endpoint | None:
    if path == "/metadata/scheduledevents":
        return "scheduledevents"
    if path == "/metadata/instance" or path.startswith("/metadata/instance/"):
        return "instance"
    if path == "/metadata/identity/oauth2/token":
        return "identity"
    if path == "/metadata/attested/document":
        return "attested"
    return None


def _network(vm: VmSpec) -> dict[str, Any]:
    octet = sum(vm.vmId.encode()) % 250 + 4
    return {
        "interface": [
            {
                "ipv4": {
                    "ipAddress": [{"privateIpAddress": f"10.0.0.{octet}", "publicIpAddress": ""}],
                    "subnet": [{"address": "10.0.0.0", "prefix": "24"}],
                },
                "ipv6": {"ipAddress": []},
                "macAddress": f"000D3A{octet:06X}",
            }
        ]
    }


def _parse(model: type[_M], data: Any, *, source: str) -> _M:
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise EmulatorInputError(describe_validation_error(error, source=source)) from error


def _json_body(handler: _Handler) -> Any:
    raw = handler.read_body()
    try:
        return json.loads(raw or b"null")
    except json.JSONDecodeError as error:
        raise EmulatorInputError(f"request body is not JSON: {error}") from error


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; without this, Nagle + delayed ACK add ~40 ms per response.
    disable_nagle_algorithm = True
    server_version = "Microsoft-IIS/10.0"  # what IMDS answers with; some clients log it
    sys_version = ""

    def read_body(self) -> bytes:
        return self._body

    def _take_body(self) -> None:
        # Read the whole body before anything can answer early (a fault, a refused header): a body left unread
        # on a keep-alive connection would be parsed as the next request.
        self._body = b""
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self.close_connection = True
            raise _bad_request(f"body of {length} bytes is larger than {_MAX_BODY}")
        if length:
            self._body = self.rfile.read(length)

    def _dispatch(self, method: str) -> None:
        emulator: ImdsEmulator = self.server.emulator  # type: ignore[attr-defined]
        headers: dict[str, str] = {}
        try:
            self._take_body()
            status, body, content_type = emulator._handle(self, method)
        except _NoAnswer:
            self.close_connection = True
            return
        except _Reply as reply:
            status, content_type = reply.status, _JSON
            body = b"" if status == 204 else json.dumps(reply.body).encode()
            headers = reply.headers
        except EmulatorInputError as error:
            status, body, content_type = 400, json.dumps({"error": str(error)}).encode(), _JSON
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: Any) -> None:
        # Silence the per-request stderr lines; the control API and /_emulator/vms carry the counts.
        return
