"""The local pipeline's parts, started and stopped together: Azurite, the Event Hubs, Relay and IMDS emulators,
one forwarder process per simulated VM, and the function host (``local.runner``) in front of ``function_app``, with
its HTTP routes for people (``local.http_host``) behind the stand-in of App Service Authentication
(``local.easy_auth``).

Everything lives under one work folder (``.local/`` by default): per-VM state, spool and hooks, logs, the history
database, Teams cards. ``LocalStack`` is a context manager; leaving it stops every child process it started.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType, TracebackType
from typing import IO, Any, Self
from urllib.parse import urlsplit, urlunsplit

import requests

from coordinator.adapters.delivery_queue import DELIVERY_QUEUE
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH
from emulators.azurite import Azurite, AzuriteEndpoints
from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.attested import ROOT_PATH
from emulators.imds.event_grid import EventGridPublisher
from emulators.imds.lifecycle import DEFAULT_STARTED_MIN_SECONDS
from emulators.imds.local_steps import LOCAL_STEP_ACTIONS, HealthPage
from emulators.imds.models import ScenarioStep
from emulators.imds.vm_models import HookSpec, VmSpec
from emulators.relay import RelayEmulator
from local.direct_callback import direct_coordinator, forwarder_hook_ledger
from local.easy_auth import DEFAULT_PEOPLE, PLATFORM_SETTINGS, EasyAuthStandIn, LocalPerson
from local.gates import GateServer, local_gate_names
from local.host import HostProcessOptions, function_hosts
from local.host_process import CoordinatorProcess
from local.http_host import FunctionsHttpHost, LocalHttpServer
from local.platform import REBOOT_SECONDS, Platform, write_boot_time
from local.queue_trigger import StorageQueue
from local.runner import FunctionHost, IngestFunction
from local.scenario import census_scopes, delayed, deletes_take_time, identity_vm, served_policy
from ops.history import LOCAL_RUN_FILE

log = logging.getLogger("local.stack")

REPO_ROOT = Path(__file__).resolve().parent.parent
HUB = "scheduled-events"
PARTITIONS = 4
# Event Grid's own hub (infra/modules/eventhubs.bicep): the platform's events, which no VM can send (ingest.py).
PLATFORM_HUB = "scheduled-events-platform"
PLATFORM_PARTITIONS = 2
# Variables that would steer azure-identity away from the VM (IMDS) managed-identity flow the forwarders use.
_IDENTITY_VARIABLES = (
    "IDENTITY_ENDPOINT",
    "IDENTITY_HEADER",
    "IMDS_ENDPOINT",
    "MSI_ENDPOINT",
    "MSI_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_CERTIFICATE_PATH",
)
PREPARE_HOOK = """#!/bin/sh
# Local-mode prepare hook: what a drain script would do before the event (here: note it and succeed).
echo "prepared $SCHEDULED_EVENT_TYPE $SCHEDULED_EVENT_ID on $VM_NAME"
"""
# How often the stack looks at the IMDS emulator for removed VMs and at the clock for wipe steps (real seconds).
PLATFORM_WATCH_INTERVAL = 0.1
# With health pages, the coordinator's policy: the run's, its gates pointed at the pages the stack serves.
POLICY_COPY = "policy.yaml"
# Seconds the coordinator and the listeners allow their clocks to disagree: one clock here (2 s in Azure).
LOCAL_CLOCK_TOLERANCE = 0.25
# The coordinator retires a removed VM after this many of the forwarders' heartbeat intervals of silence, as in
# Azure (180 s = three 60 s heartbeats).
RETIRE_GRACE_HEARTBEATS = 3
# The Azurite SAS the coordinator's delivery queue and the local queue trigger use: longer than any local run.
QUEUE_SAS_LIFETIME = timedelta(days=1)


def hook_script(hook: HookSpec) -> str:
    """A scenario hook as a script: say what it is, sleep ``seconds`` and exit with ``exitCode``."""
    return (
        "#!/bin/sh\n"
        f"# Local-mode hook from the scenario: sleeps {hook.seconds:g} s and exits {hook.exitCode}.\n"
        f'echo "{hook.name} on $VM_NAME for $SCHEDULED_EVENT_TYPE $SCHEDULED_EVENT_ID: exit {hook.exitCode}"\n'
        f"sleep {shlex.quote(f'{hook.seconds:g}')}\n"
        f"exit {hook.exitCode}\n"
    )


class HealthPages:
    """The scenario's health pages, each served on its own free loopback port: a GET of any path answers the
    page's current status, which the scenario's ``healthPage`` steps change."""

    def __init__(self, pages: dict[str, HealthPage]) -> None:
        self._status = {name: page.status for name, page in pages.items()}
        self._servers: dict[str, ThreadingHTTPServer] = {}
        self.served: dict[str, str] = {}  # the URL as the policy names it -> the URL it is served on
        for name, page in pages.items():
            server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(name))
            self._servers[name] = server
            served = urlsplit(page.url)._replace(netloc=f"127.0.0.1:{server.server_address[1]}")
            self.served[page.url] = urlunsplit(served)
            threading.Thread(target=server.serve_forever, name=f"health-page-{name}", daemon=True).start()

    def _handler(self, name: str) -> type[BaseHTTPRequestHandler]:
        status = self._status

        class Page(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status[name])
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return  # the coordinator's gate reads are not the run's output

        return Page

    def set(self, name: str, status: int) -> None:
        self._status[name] = status
        log.info("health page %s answers %d from now on", name, status)

    def stop(self) -> None:
        for server in self._servers.values():
            server.shutdown()
            server.server_close()
        self._servers.clear()


def _quietly(stop: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):
        stop()


# Real seconds a forwarder process takes from its start to its first poll, with this machine's margin.
RESTART_SECONDS = 4.0


@dataclass(frozen=True)
class StackOptions:
    """How the local pipeline runs. Times are real seconds unless named otherwise."""

    scenario: Scenario
    workdir: Path = Path(".local")
    time_scale: float = 60.0
    lead_in: float = 3.0  # real seconds before the scenario's first step: the forwarders start meanwhile
    poll_interval: float = 1.0
    heartbeat_interval: float = 5.0
    timer_interval: float = 2.0
    prepare_hooks: bool = True
    policy_path: Path | None = None
    throttle_rps: float = 5.0
    relay: bool = True
    forwarder_log_level: str = "INFO"
    coordinator_env: dict[str, str] = field(default_factory=dict)
    # Tests wrap the trigger to replay the host's misbehaviours (a batch delivered twice, two instances at once).
    ingest_wrapper: Callable[[IngestFunction], IngestFunction] | None = None
    # The people's pages (approval page, open events) on 127.0.0.1: this port (0: any free one), and who can sign
    # in at the stand-in of App Service Authentication, with which app roles.
    http_port: int = 0
    people: tuple[LocalPerson, ...] = DEFAULT_PEOPLE
    # Azure seconds a Started event stays listed at least (the docs' ~10 minutes). A run at a low time scale may
    # shorten it: at 10x the default keeps every started event in the documents for a minute of real time.
    started_min_seconds: float = DEFAULT_STARTED_MIN_SECONDS
    # The function host in a process of its own, which a test may SIGKILL and start again (local/host_process.py).
    coordinator_process: HostProcessOptions | None = None

    @property
    def policy(self) -> Path:
        """The run's approval policy: ``policy_path`` (``--policy``), else the scenario's own, else the default."""
        if self.policy_path is not None:
            return self.policy_path
        return Path(self.scenario.policy) if self.scenario.policy is not None else DEFAULT_POLICY_PATH

    @property
    def scenario_policy(self) -> bool:
        """Whether the run uses the policy the scenario names, for which its ``expect``s are written."""
        own = self.scenario.policy
        return own is not None and self.policy.resolve() == Path(own).resolve()


class WorkdirBusy(RuntimeError):
    """Another local run holds the work folder."""


class ForwarderProcess:
    """``python -m forwarder run`` for one simulated VM, its state, spool and hooks under ``workdir/vms/NAME``."""

    def __init__(self, *, name: str, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self._command = command
        self._env = env
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.paused = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        self._log = self.log_path.open("ab")
        # The command is this interpreter running the project's own module; nothing from outside reaches it.
        self._process = subprocess.Popen(  # noqa: S603
            self._command,
            env=self._env,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the runner, which stops the forwarders in order
        )

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would: no shutdown code runs."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)
        self.paused = False
        self._close_log()

    def pause(self) -> None:
        """SIGSTOP: the process is frozen (its hooks, in sessions of their own, run on)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self, *, timeout: float = 10.0) -> int | None:
        """SIGTERM (the forwarder finishes its send and exits), SIGKILL after ``timeout``."""
        process = self._process
        if process is None:
            return None
        if self.paused:
            self.resume()  # a stopped process would hold the SIGTERM until continued
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self._close_log()
        return process.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class LocalStack:
    """Starts the whole local pipeline; ``stop()`` (or leaving the ``with``) ends every part it started."""

    hub = HUB

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.workdir = options.workdir.resolve()
        self.azurite: Azurite | None = None
        self.storage: AzuriteEndpoints | None = None
        self.eventhubs: EventHubsEmulator | None = None
        self.relay: RelayEmulator | None = None
        # Without the Relay: function_app and its own coordinator builder, replaced by the direct one until stop().
        self._direct_swap: tuple[ModuleType, Callable[[], Any]] | None = None
        self.imds: ImdsEmulator | None = None
        self.host: FunctionHost | None = None
        # The second trigger, on Event Grid's own hub (function_app.ingest_platform_events).
        self.platform_host: FunctionHost | None = None
        # The HTTP triggers behind the sign-in stand-in: what a person's browser talks to.
        self.front: LocalHttpServer | None = None
        # With coordinator_process: the process running host, platform host and front instead of this one.
        self.coordinator_process: CoordinatorProcess | None = None
        self.forwarders: dict[str, ForwarderProcess] = {}
        # Publishes the agentless VMs' events as Event Grid would (None when the scenario has no agentless VM).
        self.event_grid: EventGridPublisher | None = None
        self.health_pages: HealthPages | None = None
        # The coordinator's delivery queue and its poison queue, in Azurite (local/queue_trigger.py).
        self.delivery_queue: StorageQueue | None = None
        self.poison_queue: StorageQueue | None = None
        self._saved_env: dict[str, str | None] = {}
        self._lock: IO[str] | None = None
        # What the stack did as the platform: VMs whose forwarder it killed because IMDS removed them (name ->
        # monotonic time) and forwarder states it wiped (name, monotonic time), for the summary and the tests.
        self.removed: dict[str, float] = {}
        self.wiped: list[tuple[str, float]] = []
        # The events whose start the platform played on their VMs (by ref, else EventId: a started event may be
        # renamed).
        self._started: set[str] = set()
        self._forwarders_lock = threading.Lock()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # The local steps' player (faults, hostile senders) and its log; the policy's local gate pages, if any.
        self.platform = Platform(self)
        self.gates: GateServer | None = None

    @property
    def retire_grace_seconds(self) -> int:
        return max(1, math.ceil(RETIRE_GRACE_HEARTBEATS * self.options.heartbeat_interval))

    # ---- paths -----------------------------------------------------------------------------------------------
    @property
    def history_path(self) -> Path:
        return self.workdir / "history.sqlite"

    @property
    def cards_dir(self) -> Path:
        return self.workdir / "cards"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    def vm_dir(self, name: str) -> Path:
        return self.workdir / "vms" / name

    @property
    def people_url(self) -> str:
        """Where people open the app: the approval links in the cards and ``/api/events`` start here."""
        assert self.front is not None
        return self.front.base_url

    @property
    def telemetry_dir(self) -> Path:
        """Where each forwarder appends its spans (``spans-<vm>.jsonl``); the local collector reads ``*.jsonl``."""
        return self.workdir / "telemetry"

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._prepare_workdir()
        self.azurite = Azurite()
        self.storage = self.azurite.start()
        # "Azure Event Hubs Data Sender" held by the fleet's VMs (those the IMDS emulator knows, added ones too), as
        # the Bicep assigns it to the fleet's identity: no other identity sends to the hub.
        self.eventhubs = EventHubsEmulator(
            hubs={HUB: PARTITIONS, PLATFORM_HUB: PLATFORM_PARTITIONS}, data_senders=_FleetIdentities(self)
        )
        self.eventhubs.start()
        if self.options.relay:
            self.relay = RelayEmulator()
            self.relay.start()
        scenario = delayed(self.options.scenario, seconds=self.options.lead_in * self.options.time_scale)
        scenario = deletes_take_time(scenario, time_scale=self.options.time_scale)
        self.imds = ImdsEmulator(
            scenario=scenario,
            time_scale=self.options.time_scale,
            throttle_rps=self.options.throttle_rps,
            # A started event stays listed at least while its VMs are out because of it (a Reboot's REBOOT_SECONDS, a
            # Freeze's pause of at least a second) and their forwarders start and poll again, in real seconds: else
            # a VM back from its Reboot finds its event gone and the coordinator never sees it start.
            started_min_seconds=max(
                self.options.started_min_seconds, (REBOOT_SECONDS + RESTART_SECONDS) * self.options.time_scale
            ),
        )
        self.imds.start()
        # The emulator plays step `at` (Azure seconds, lead-in included) at started + at / time_scale; so does the
        # stack the steps that are its business.
        started = time.monotonic()
        self.health_pages = HealthPages(self.options.scenario.healthPages)
        local_steps = [
            (started + step.at / self.options.time_scale, index, step)
            for index, step in enumerate(scenario.steps)
            if any(getattr(step, action) is not None for action in LOCAL_STEP_ACTIONS)
        ]
        # Bound before the coordinator is configured: its public URL (the cards' approval links) is this address.
        self.front = LocalHttpServer(
            EasyAuthStandIn(FunctionsHttpHost(_function_app), self.options.people), port=self.options.http_port
        )
        self._configure_coordinator()
        if self.options.coordinator_process is not None:
            self.coordinator_process = CoordinatorProcess.for_stack(self, self.options.coordinator_process)
            self.coordinator_process.start()
        else:
            self.host, self.platform_host = self._function_hosts()
            self.host.start()
            self.platform_host.start()
            self.front.start()
        agentless = [vm.name for vm in self.imds.vms() if vm.agentless]
        if agentless:
            assert self.eventhubs is not None
            self.event_grid = EventGridPublisher(
                self.imds,
                connection_string=self.eventhubs.connection_string(),
                eventhub_name=PLATFORM_HUB,
                vms=agentless,
            )
            self.event_grid.start()
        for vm in self.imds.vms():
            if vm.agentless:
                continue  # no forwarder on it: Event Grid tells the coordinator of its events
            self.forwarders[vm.name] = self._forwarder(vm)
            self.forwarders[vm.name].start()
            self.platform.record("forwarder-start", vm=vm.name)
        self._watcher = threading.Thread(target=self._watch, args=(local_steps,), name="local-platform", daemon=True)
        self._watcher.start()

    def _watch(self, steps: list[tuple[float, int, ScenarioStep]]) -> None:
        """Plays the platform's part on the VMs' disks and processes: a VM the IMDS emulator removed (Terminate,
        Preempt) is deleted, so its forwarder dies with it (SIGKILL: nothing of it runs on); a wipeForwarderState
        step kills the forwarder, deletes its state folder and starts it again, as a reimaged disk would; the other
        local steps (faults, hostile senders) are played by ``self.platform``."""
        pending = sorted(steps, key=lambda item: (item[0], item[1]))
        while not self._watch_stop.wait(PLATFORM_WATCH_INTERVAL):
            imds = self.imds
            if imds is None:
                return
            try:
                removed = imds.removed_vms()
            except Exception:  # the emulator is stopping
                log.debug("removed VMs not readable", exc_info=True)
                continue
            for name in sorted(set(removed) - set(self.removed)):
                self._remove(name)
            self._started_events(imds)
            now = time.monotonic()
            while pending and pending[0][0] <= now:
                _, _, step = pending.pop(0)
                if step.healthPage is not None:
                    assert self.health_pages is not None  # made before the steps are played
                    self.health_pages.set(step.healthPage.name, step.healthPage.status)
                else:
                    self.platform.play(step)

    def _started_events(self, imds: ImdsEmulator) -> None:
        """Each event IMDS started since the last look does to its VMs what the platform would (local/platform.py:
        a Freeze pauses their forwarders, a Reboot or Redeploy restarts them with a new boot time)."""
        try:
            events = imds.events()
        except Exception:  # the emulator is stopping
            log.debug("events not readable", exc_info=True)
            return
        for event in events:
            key = str(event.get("ref") or event["EventId"])
            if event.get("startedAt") and key not in self._started:
                self._started.add(key)
                self.platform.event_started(event)

    def boot_time_file(self, name: str) -> Path:
        """The VM's /proc/stat as its forwarder reads it (``--boot-time-file``): the platform writes a new boot time
        when it reboots the VM."""
        return self.vm_dir(name) / "boot-stat"

    def _remove(self, name: str) -> None:
        with self._forwarders_lock:
            forwarder = self.forwarders.get(name)
            if forwarder is not None:
                forwarder.kill()
            self.removed[name] = time.monotonic()
        self.platform.record("forwarder-kill", vm=name, reason="removed")
        log.info("VM %s removed by the platform: its forwarder was killed", name)

    def wipe_forwarder_state(self, name: str) -> None:
        """Kill ``name``'s forwarder, delete its durable state and start it again (not for a removed VM)."""
        with self._forwarders_lock:
            if name in self.removed:
                log.warning("not wiping %s: the VM was removed", name)
                return
            forwarder = self.forwarders[name]
            forwarder.kill()
            state = self.vm_dir(name) / "state"
            shutil.rmtree(state, ignore_errors=True)
            state.mkdir(parents=True, exist_ok=True)
            forwarder.start()
            self.wiped.append((name, time.monotonic()))
        self.platform.record("forwarder-start", vm=name)
        log.info("forwarder state of %s wiped; the forwarder started again", name)

    def restart_forwarder(self, name: str) -> None:
        """Starts ``name``'s forwarder again on the state it had (after a crash); not for a removed VM."""
        with self._forwarders_lock:
            if name in self.removed:
                return
            self.forwarders[name].start()
        self.platform.record("forwarder-start", vm=name)

    def stop_platform(self) -> None:
        """No more removals, wipes or faults (those still on end now): the run is being settled."""
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        self.platform.finish()

    def _stop_pages(self) -> None:
        """The pages the stack serves for the policy's gates: the scenario's health pages and the local gate pages."""
        if self.health_pages is not None:
            self.health_pages.stop()
            self.health_pages = None
        if self.gates is not None:
            self.gates.stop()
            self.gates = None

    def drain(self, timeout: float = 10.0) -> bool:
        """Waits for the tails of the batches processed so far (their answers, cards and history rows: they run after
        each batch, docs/liveness.md *The tail after the batch*); True when none is left. Whoever reads the
        history to judge a run calls it first."""
        module = sys.modules.get("function_app")
        if module is None or not module.coordinator.cache_info().currsize:
            return True
        drained: bool = module.coordinator().drain(timeout)
        return drained

    def kill_coordinator(self) -> None:
        """SIGKILL of the coordinator's process (``coordinator_process``), as a crash ends a Functions instance."""
        assert self.coordinator_process is not None, "the coordinator runs in this process"
        self.coordinator_process.kill()

    def start_coordinator(self) -> None:
        """A new coordinator process, resuming from the checkpoints and the state the last one committed."""
        assert self.coordinator_process is not None, "the coordinator runs in this process"
        self.coordinator_process.start()

    def stop(self) -> None:
        self.stop_platform()
        if self.coordinator_process is not None:
            self.coordinator_process.stop()
        if self.front is not None:
            self.front.stop()
            self.front = None
        if self.event_grid is not None:
            self.event_grid.stop()
        self._stop_pages()
        for forwarder in self.forwarders.values():
            with contextlib.suppress(Exception):
                forwarder.stop(timeout=5)
        # Side by side: each host's consumer takes about a second to close its links (twice that under load), and
        # every whole-stack test pays it at teardown.
        stopping = [
            threading.Thread(target=_quietly, args=(host.stop,), name="stop-host", daemon=True)
            for host in (self.host, self.platform_host)
            if host is not None
        ]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join(timeout=30)
        self.host = self.platform_host = None
        _reset_function_app()
        if self._direct_swap is not None:
            module, original = self._direct_swap
            setattr(module, "coordinator", original)  # noqa: B010 -- a module attribute the type checker cannot see
            self._direct_swap = None
        for queue in (self.delivery_queue, self.poison_queue):
            if queue is not None:
                queue.close()
        self.delivery_queue = self.poison_queue = None
        for part in (self.imds, self.relay, self.eventhubs, self.azurite):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()
        self.imds = self.relay = self.eventhubs = None
        self.azurite = None
        self._restore_env()
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def _prepare_workdir(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        lock = (self.workdir / ".lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise WorkdirBusy(
                f"another local run is using {self.workdir}; wait for it or pass another --workdir"
            ) from None
        self._lock = lock
        # A run starts clean: the previous run's history, cards, spools and logs would mix with this one's.
        for name in (
            "vms",
            "cards",
            "logs",
            "history.sqlite",
            "history.sqlite-wal",
            "history.sqlite-shm",
            LOCAL_RUN_FILE,
            POLICY_COPY,
        ):
            target = self.workdir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        # The previous run's spans too (only the forwarders' files: the folder is shared with the local collector).
        for spans in self.telemetry_dir.glob("spans-*.jsonl"):
            spans.unlink()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.cards_dir.mkdir(parents=True, exist_ok=True)
        self.telemetry_dir.mkdir(parents=True, exist_ok=True)

    # ---- the coordinator (function_app) ----------------------------------------------------------------------
    def _configure_coordinator(self) -> None:
        assert self.storage is not None
        assert self.imds is not None
        assert self.front is not None
        sas = self.storage.queue_sas(expiry=datetime.now(UTC) + QUEUE_SAS_LIFETIME)
        url = f"{self.storage.queue_endpoint}/{DELIVERY_QUEUE}"
        self.delivery_queue = StorageQueue(queue_url=url, sas=sas)
        self.poison_queue = StorageQueue(queue_url=f"{url}-poison", sas=sas)
        for queue in (self.delivery_queue, self.poison_queue):
            queue.create()
        env = {
            "COORDINATOR_STORAGE_CONNECTION_STRING": self.storage.connection_string,
            "COORDINATOR_HISTORY_SQLITE_PATH": str(self.history_path),
            "COORDINATOR_CARDS_FOLDER": str(self.cards_dir),
            "COORDINATOR_PUBLIC_BASE_URL": self.front.base_url,
            # People sign in at the stand-in in front of the app, which tells the app so as App Service does.
            **PLATFORM_SETTINGS,
            "EVENTHUB_NAME": HUB,
            "PLATFORM_EVENTHUB_NAME": PLATFORM_HUB,
            "EVENTHUB_CONSUMER_GROUP": "$Default",
            # The census (budgets, tag rules) from the IMDS emulator's ARM face, read with the coordinator's managed
            # identity as in Azure: the scenario's resource groups, the same VMs IMDS serves.
            "COORDINATOR_CENSUS_RESOURCE_GROUPS": ",".join(census_scopes(self.options.scenario)),
            "COORDINATOR_ARM_ENDPOINT": self.imds.url,
            # The coordinator's DefaultAzureCredential takes the managed-identity (IMDS) flow against the IMDS
            # emulator; the tokens it mints are Entra-shaped JWTs the emulators verify. Through a VM no delete
            # removes: a removed VM's token endpoint answers nothing.
            "AZURE_POD_IDENTITY_AUTHORITY_HOST": self.imds.url_for(identity_vm(self.options.scenario)),
            # Retire a removed VM after three of the local heartbeat intervals of silence, as Azure's 180 s are three
            # 60 s heartbeats: the run then sees the coordinator conclude the events of the VMs deletes removed.
            "COORDINATOR_RETIRE_GRACE_SECONDS": str(self.retire_grace_seconds),
            # Attested documents are the IMDS emulator's, so its root is the trust anchor, as Microsoft's roots are
            # in Azure; its issuing CA is fetched from the signing certificate's CA Issuers URL, on the emulator.
            "COORDINATOR_ATTESTATION_TRUST_ANCHORS": str(self._imds_root()),
            "COORDINATOR_ATTESTATION_ISSUER_URLS": self.imds.url + "/_emulator/pki/",
        }
        # Approvals not answered within a run's few seconds continue through the delivery queue, in Azurite.
        env["COORDINATOR_DELIVERY_QUEUE_URL"] = url
        env["COORDINATOR_DELIVERY_QUEUE_SAS"] = sas
        if self.relay is not None:
            env["COORDINATOR_RELAY_ENDPOINT"] = self.relay.base_url
        if any(vm.agentless for vm in self.options.scenario.vms):
            # Agentless VMs are approved through the Maintenance RP's acknowledge: the IMDS emulator's ARM face,
            # with a token from the same managed-identity endpoint.
            env["COORDINATOR_REMOTE_ACKNOWLEDGE"] = "fallback"
        env["COORDINATOR_POLICY_PATH"] = str(self._coordinator_policy())
        # Every process here reads one clock: the tolerance for clocks that disagree (2 s in Azure) would be two
        # minutes of a run at 60x, long enough to keep a compressed Terminate notice from being approved at all.
        env["COORDINATOR_CLOCK_TOLERANCE_SECONDS"] = str(LOCAL_CLOCK_TOLERANCE)
        env.update(self.options.coordinator_env)
        for name in _IDENTITY_VARIABLES:
            self._set_env(name, None)
        for name, value in env.items():
            self._set_env(name, value)
        _reset_function_app()
        if self.relay is None:
            self._approve_directly()

    def _coordinator_policy(self) -> Path:
        """The policy the coordinator reads: the run's, or a copy in the work folder whose gates probe what this stack
        serves: the scenario's health pages (``healthPages``) and the local gate pages (``http://local-gates/{name}``,
        local/gates.py)."""
        policy = self.options.policy
        text = policy.read_text(encoding="utf-8")
        served = text
        if self.health_pages is not None and self.health_pages.served:
            served = served_policy(served, self.health_pages.served)
        names = local_gate_names(served)
        if names:
            self.gates = GateServer(names)
            self.gates.start()
            served = self.gates.rewrite_policy(served)
        if served == text:
            return policy.resolve()
        copy = self.workdir / POLICY_COPY
        copy.write_text(served, encoding="utf-8")
        return copy.resolve()

    def _imds_root(self) -> Path:
        """The IMDS emulator's root certificate, as it serves it, in the work folder."""
        assert self.imds is not None
        path = self.workdir / "imds-root.pem"
        path.write_bytes(requests.get(self.imds.url + ROOT_PATH, timeout=10).content)
        return path

    def _approve_directly(self) -> None:
        """Without the Relay emulator, approvals go straight into the IMDS emulator (local/direct_callback.py), judged
        against each VM's own hook ledger in its forwarder's state, as its listener would."""
        import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

        assert self.imds is not None

        self._direct_swap = (function_app, function_app.coordinator)
        ledger = forwarder_hook_ledger(self.workdir / "vms")
        function_app.coordinator = direct_coordinator(function_app.settings, self.imds.url, hook_ledger=ledger)

    def _set_env(self, name: str, value: str | None) -> None:
        if name not in self._saved_env:
            self._saved_env[name] = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def _restore_env(self) -> None:
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()

    def _function_hosts(self) -> tuple[FunctionHost, FunctionHost]:
        """The VMs' trigger (with the timer and the delivery queue's) and Event Grid's, in this process."""
        import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

        assert self.eventhubs is not None
        assert self.delivery_queue is not None
        assert self.poison_queue is not None
        ingest: IngestFunction = function_app.ingest_envelopes
        if self.options.ingest_wrapper is not None:
            ingest = self.options.ingest_wrapper(ingest)
        return function_hosts(
            function_app,
            eventhub_connection_string=self.eventhubs.connection_string(),
            queues=(self.delivery_queue, self.poison_queue),
            timer_interval=self.options.timer_interval,
            ingest=ingest,
        )

    # ---- forwarders ------------------------------------------------------------------------------------------
    def _install_hooks(self, vm: VmSpec, hooks: Path) -> None:
        """The scenario's hooks of the VM (a script per hook); without ``hooks`` the single succeeding drain hook
        (unless the run has no prepare hooks)."""
        scripts: dict[str, dict[str, str]] = {"prepare": {}, "recover": {}}
        if vm.hooks is not None:
            for phase in ("prepare", "recover"):
                scripts[phase] = {hook.name: hook_script(hook) for hook in getattr(vm.hooks, phase)}
        elif self.options.prepare_hooks:
            scripts["prepare"]["10-drain"] = PREPARE_HOOK
        for phase, files in scripts.items():
            for file_name, text in files.items():
                path = hooks / f"{phase}.d" / file_name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
                path.chmod(0o755)

    def _forwarder(self, vm: VmSpec) -> ForwarderProcess:
        assert self.imds is not None
        assert self.eventhubs is not None
        options = self.options
        name = vm.name
        home = self.vm_dir(name)
        (home / "state").mkdir(parents=True, exist_ok=True)
        write_boot_time(self.boot_time_file(name), time.time() - 3600)  # booted an hour ago
        hooks = home / "hooks"
        self._install_hooks(vm, hooks)
        # A VM whose clock is off runs the forwarder through the local launcher that skews its clock.
        launcher = ["forwarder"] if not vm.clockSkewSeconds else ["local.skewed_forwarder", f"{vm.clockSkewSeconds:g}"]
        command = [
            sys.executable,
            "-m",
            *launcher,
            "run",
            "--imds-url",
            self.imds.url_for(name),
            "--poll-interval",
            str(options.poll_interval),
            "--imds-timeout",
            "5",
            "--imds-first-call-timeout",
            "10",
            "--state-dir",
            str(home / "state"),
            "--heartbeat-interval",
            str(options.heartbeat_interval),
            "--sink",
            "eventhub",
            # The VM's managed identity, as in Azure: Event Hubs' REST API with a token from the IMDS emulator's
            # identity endpoint, which the Event Hubs emulator checks (audience, role). No key on the VM.
            "--eventhub-namespace",
            self.eventhubs.rest_namespace,
            "--no-eventhub-use-tls",
            "--eventhub-name",
            HUB,
            "--hooks-dir",
            str(hooks),
            "--hook-timeout",
            "30",
            # The margin and grace are Azure seconds like the notices they are cut from: scaled with them.
            "--hook-deadline-margin",
            f"{5 / options.time_scale:g}",
            "--hook-kill-grace",
            f"{3 / options.time_scale:g}",
            "--log-level",
            options.forwarder_log_level,
            "--telemetry-spans-file",
            str(self.telemetry_dir / f"spans-{name}.jsonl"),
            "--boot-time-file",
            str(self.boot_time_file(name)),
        ]
        if self.relay is not None:
            command += ["--relay-enabled", "--relay-endpoint", self.relay.base_url.replace("http://", "ws://", 1)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SE_FORWARDER_", "COORDINATOR_"))}
        env["SE_FORWARDER_NOT_AFTER_TOLERANCE"] = str(LOCAL_CLOCK_TOLERANCE)  # as the coordinator's (one clock here)
        env["PYTHONPATH"] = str(REPO_ROOT)
        return ForwarderProcess(name=name, command=command, env=env, log_path=self.logs_dir / f"forwarder-{name}.log")

    def iter_forwarders(self) -> Iterator[ForwarderProcess]:
        yield from self.forwarders.values()


class _FleetIdentities:
    """The managed identities of the stack's VMs (the IMDS emulator's tokens name the VM's resource id)."""

    def __init__(self, stack: LocalStack) -> None:
        self._stack = stack

    def __contains__(self, identity: object) -> bool:
        imds = self._stack.imds
        return imds is not None and any(vm.resourceId == identity for vm in imds.vms())


def _function_app() -> ModuleType:
    import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

    return function_app


def _reset_function_app() -> None:
    """A new Functions worker process would read the app settings afresh; so does the next stack in this process."""
    module = sys.modules.get("function_app")
    if module is None:
        return
    module.settings.cache_clear()
    coordinator = module.coordinator
    if coordinator.cache_info().currsize:
        with contextlib.suppress(Exception):
            coordinator().close()  # the batches' tails end first: they write history
        with contextlib.suppress(Exception):
            coordinator().history.close()
    coordinator.cache_clear()
