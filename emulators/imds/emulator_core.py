"""The IMDS emulator's state behind one lock, its lifecycle (a ThreadingHTTPServer on 127.0.0.1) and its Python
control API; the faces that answer HTTP requests build on it (``vm_face``, ``arm_face``, ``control_api``)."""

from __future__ import annotations

import threading
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import quote

from emulators.imds.arm import (
    DEFAULT_PAGE_SIZE,
    ArmFaults,
    ArmLists,
)
from emulators.imds.attested import (
    DEFAULT_VALIDITY_SECONDS,
    ISSUER_PATH,
    AttestedDocuments,
    CertificateAuthority,
)
from emulators.imds.clock import Clock, SystemClock
from emulators.imds.drills import Drills
from emulators.imds.faults import DEFAULT_THROTTLE_RPS, FaultPlan
from emulators.imds.lifecycle import DEFAULT_STARTED_MIN_SECONDS
from emulators.imds.models import EventCreate, FaultSpec, Scenario
from emulators.imds.state import EmulatorState
from emulators.imds.vm_models import VmSpec
from emulators.imds.wire import RequestHandler, parse_model
from emulators.served import Served, close, serve_in_thread
from emulators.tls import TlsHTTPServer, local_tls


class EmulatorCore(Served):
    """The emulator's state and every face's shared parts; every request takes ``_lock`` around the pure state
    (``EmulatorState``), so the state machine stays single-threaded."""

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
        # The ARM face on a port of its own over TLS, as ARM serves it (IMDS itself is plain HTTP, as in Azure).
        self._arm_port = 0
        self._arm_server: TlsHTTPServer | None = None
        self._arm_thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> str:
        if self._server is not None:
            return self.url
        server = ThreadingHTTPServer(("127.0.0.1", self._port), RequestHandler)
        with self._lock:
            self.state.begin(self.clock.now())  # scenario offsets count from start(), not construction
        self._server = server
        self._stopping.clear()
        self._thread = self._serve(server, base_url=self.url, name=f"imds-emulator-{self.port}")
        arm = TlsHTTPServer(("127.0.0.1", self._arm_port), RequestHandler, context=local_tls().server_context())
        self._arm_server = arm
        self._arm_port = arm.server_address[1]
        arm.arm_only = True  # type: ignore[attr-defined]
        self._arm_thread = self._serve(arm, base_url=self.arm_url, name=f"imds-arm-{self._arm_port}")
        return self.url

    def _serve(self, server: ThreadingHTTPServer, *, base_url: str, name: str) -> threading.Thread:
        server.emulator = self  # type: ignore[attr-defined]
        server.base_url = base_url  # type: ignore[attr-defined]
        return serve_in_thread(server, name=name)

    def stop(self) -> None:
        self._stopping.set()  # wakes requests hung by a fault
        for server in (self._server, self._arm_server):
            close(server)
        self._server = self._arm_server = None
        for thread in (self._thread, self._arm_thread):
            if thread is not None:
                thread.join(timeout=5)
        self._thread = self._arm_thread = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the emulator is not started; call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def arm_url(self) -> str:
        """The ARM face's root over TLS (the local CA's certificate, emulators/tls.py): what the coordinator's ARM
        clients (census, acknowledge, drills) take as ARM's endpoint."""
        if self._arm_server is None:
            raise RuntimeError("the emulator is not started; call start() first")
        return f"https://127.0.0.1:{self._arm_port}"

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
        parsed = parse_model(EventCreate, spec if spec is not None else fields, source="event")
        with self._lock:
            return self.state.create_event(parsed, self.clock.now()).summary()

    def cancel_event(self, event_id: str) -> dict[str, Any]:
        with self._lock:
            return self.state.cancel_event(event_id, self.clock.now()).summary()

    def inject_fault(self, spec: FaultSpec | dict[str, Any] | None = None, **fields: Any) -> None:
        parsed = parse_model(FaultSpec, spec if spec is not None else fields, source="fault")
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
        parsed = parse_model(VmSpec, spec, source="VM")
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
