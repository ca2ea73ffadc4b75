"""The local pipeline's parts, started and stopped together: Azurite, the Event Hubs, Relay and IMDS emulators,
one forwarder process per simulated VM, and the function host (``local.runner``) in front of ``function_app``, with
its HTTP routes for people (``local.http_host``) behind the stand-in of App Service Authentication
(``local.easy_auth``).

Everything lives under one work folder (``.local/`` by default): per-VM state, spool and hooks, logs, the history
database, Teams cards. ``LocalStack`` is a context manager; leaving it stops every child process it started. Its
parts' setup: ``local.coordinator_setup`` (app settings), ``local.forwarders``, ``local.platform_watch``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType, TracebackType
from typing import IO, Any, Self

from coordinator import DELIVERY_QUEUE
from emulators.app_identity import AppIdentity
from emulators.azurite import Azurite, AzuriteEndpoints
from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.event_grid import EventGridPublisher
from emulators.imds.local_steps import LOCAL_STEP_ACTIONS
from emulators.imds.vm_models import VmSpec
from emulators.relay import RelayEmulator
from local.coordinator_setup import (
    QUEUE_SAS_LIFETIME,
    AppSettings,
    approve_directly,
    coordinator_policy,
    coordinator_settings,
    function_app_module,
    imds_root,
    in_process_hosts,
    reset_function_app,
)
from local.easy_auth import EasyAuthStandIn
from local.forwarders import ForwarderProcess, forwarder_command, forwarder_env, install_hooks
from local.gates import GateServer
from local.health_pages import HealthPages
from local.host_process import CoordinatorProcess
from local.http_host import FunctionsHttpHost, LocalHttpServer
from local.identities import FleetIdentities, coordinator_identity
from local.platform import REBOOT_SECONDS, Platform, write_boot_time
from local.platform_watch import PlatformWatch
from local.queue_trigger import StorageQueue
from local.runner import FunctionHost
from local.scenario import delayed, deletes_take_time
from local.stack_options import StackOptions
from local.workdir import take_workdir

log = logging.getLogger("local.stack")

REPO_ROOT = Path(__file__).resolve().parent.parent
HUB = "scheduled-events"
PARTITIONS = 4
# Event Grid's own hub (infra/modules/eventhubs.bicep): the platform's events, which no VM can send (ingest.py).
PLATFORM_HUB = "scheduled-events-platform"
PLATFORM_PARTITIONS = 2
# The coordinator retires a removed VM after this many of the forwarders' heartbeat intervals of silence, as in
# Azure (180 s = three 60 s heartbeats).
RETIRE_GRACE_HEARTBEATS = 3


def _quietly(stop: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        stop()


# Real seconds a forwarder process takes from its start to its first poll, with this machine's margin.
RESTART_SECONDS = 4.0


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
        # The coordinator's own managed identity (App Service's endpoint), not a VM's.
        self.app_identity: AppIdentity | None = None
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
        self._settings = AppSettings()
        self._lock: IO[str] | None = None
        # What the stack did as the platform: VMs whose forwarder it killed because IMDS removed them (name ->
        # monotonic time) and forwarder states it wiped (name, monotonic time), for the summary and the tests.
        self.removed: dict[str, float] = {}
        self.wiped: list[tuple[str, float]] = []
        self._forwarders_lock = threading.Lock()
        self._watcher: PlatformWatch | None = None
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
        """The parts in the order each needs the ones before it; the watch over the platform last."""
        folders = (self.logs_dir, self.cards_dir, self.telemetry_dir)
        self._lock = take_workdir(self.workdir, telemetry_dir=self.telemetry_dir, folders=folders)
        scenario = self._start_emulators()
        # The emulator plays step `at` (Azure seconds, lead-in included) at started + at / time_scale; so does the
        # stack the steps that are its business.
        started = time.monotonic()
        self.health_pages = HealthPages(self.options.scenario.healthPages)
        local_steps = [
            (started + step.at / self.options.time_scale, index, step)
            for index, step in enumerate(scenario.steps)
            if any(getattr(step, action) is not None for action in LOCAL_STEP_ACTIONS)
        ]
        self._start_front_and_hosts()
        self._start_event_grid()
        self._start_forwarders()
        self._watcher = PlatformWatch(self, local_steps)
        self._watcher.start()

    def _start_emulators(self) -> Scenario:
        """Azurite, the Event Hubs and Relay emulators, and the IMDS emulator playing the scenario (returned as it
        plays it: lead-in and delete times added)."""
        self.azurite = Azurite()
        self.storage = self.azurite.start()
        # "Azure Event Hubs Data Sender" held by the fleet's VMs (those the IMDS emulator knows, added ones too), as
        # the Bicep assigns it to the fleet's identity: no other identity sends to the hub.
        self.eventhubs = EventHubsEmulator(
            hubs={HUB: PARTITIONS, PLATFORM_HUB: PLATFORM_PARTITIONS}, data_senders=FleetIdentities(lambda: self.imds)
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
        self.app_identity = AppIdentity(coordinator_identity(scenario))
        self.app_identity.start()
        return scenario

    def _start_front_and_hosts(self) -> None:
        """The people's front door and the coordinator's hosts, in this process or in one of their own."""
        # Bound before the coordinator is configured: its public URL (the cards' approval links) is this address.
        self.front = LocalHttpServer(
            EasyAuthStandIn(FunctionsHttpHost(function_app_module), self.options.people), port=self.options.http_port
        )
        self._configure_coordinator()
        if self.options.coordinator_process is not None:
            self.coordinator_process = CoordinatorProcess.for_stack(self, self.options.coordinator_process)
            self.coordinator_process.start()
        else:
            assert self.eventhubs is not None
            assert self.delivery_queue is not None
            assert self.poison_queue is not None
            self.host, self.platform_host = in_process_hosts(
                eventhub_connection_string=self.eventhubs.connection_string(),
                queues=(self.delivery_queue, self.poison_queue),
                timer_interval=self.options.timer_interval,
                ingest_wrapper=self.options.ingest_wrapper,
            )
            self.host.start()
            self.platform_host.start()
            self.front.start()

    def _start_event_grid(self) -> None:
        assert self.imds is not None
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

    def _start_forwarders(self) -> None:
        assert self.imds is not None
        for vm in self.imds.vms():
            if vm.agentless:
                continue  # no forwarder on it: Event Grid tells the coordinator of its events
            self.forwarders[vm.name] = self._forwarder(vm)
            self.forwarders[vm.name].start()
            self.platform.record("forwarder-start", vm=vm.name)

    def boot_time_file(self, name: str) -> Path:
        """The VM's /proc/stat as its forwarder reads it (``--boot-time-file``): the platform writes a new boot time
        when it reboots the VM."""
        return self.vm_dir(name) / "boot-stat"

    def remove_vm(self, name: str) -> None:
        """The VM is deleted: its forwarder dies with it (SIGKILL: nothing of it runs on)."""
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
        if self._watcher is not None:
            self._watcher.stop()
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
        # Each part whatever the stop before it raised: a stack interrupted while it started has parts not started.
        _quietly(self.stop_platform)
        if self.coordinator_process is not None:
            _quietly(self.coordinator_process.stop)
        if self.front is not None:
            _quietly(self.front.stop)
            self.front = None
        if self.event_grid is not None:
            _quietly(self.event_grid.stop)
        _quietly(self._stop_pages)
        for forwarder in self.forwarders.values():
            _quietly(functools.partial(forwarder.stop, timeout=5))
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
        reset_function_app()
        if self._direct_swap is not None:
            module, original = self._direct_swap
            setattr(module, "coordinator", original)  # noqa: B010 -- a module attribute the type checker cannot see
            self._direct_swap = None
        for queue in (self.delivery_queue, self.poison_queue):
            if queue is not None:
                _quietly(queue.close)
        self.delivery_queue = self.poison_queue = None
        for part in (self.imds, self.app_identity, self.relay, self.eventhubs, self.azurite):
            if part is not None:
                _quietly(part.stop)
        self.imds = self.app_identity = self.relay = self.eventhubs = None
        self.azurite = None
        self._settings.restore()
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def _configure_coordinator(self) -> None:
        assert self.storage is not None
        assert self.imds is not None
        assert self.front is not None
        assert self.app_identity is not None
        sas = self.storage.queue_sas(expiry=datetime.now(UTC) + QUEUE_SAS_LIFETIME)
        url = f"{self.storage.queue_endpoint}/{DELIVERY_QUEUE}"
        self.delivery_queue = StorageQueue(queue_url=url, sas=sas)
        self.poison_queue = StorageQueue(queue_url=f"{url}-poison", sas=sas)
        for queue in (self.delivery_queue, self.poison_queue):
            queue.create()
        policy, self.gates = coordinator_policy(self.options.policy, self.health_pages, self.workdir)
        env = coordinator_settings(
            storage_connection_string=self.storage.connection_string,
            history_path=self.history_path,
            cards_dir=self.cards_dir,
            public_url=self.front.base_url,
            hubs=(HUB, PLATFORM_HUB),
            scenario=self.options.scenario,
            arm_endpoint=self.imds.arm_url,
            imds_url=self.imds.url,
            identity=self.app_identity.environment(),
            retire_grace_seconds=self.retire_grace_seconds,
            trust_anchors=imds_root(self.imds.url, self.workdir),
            delivery_queue=(url, sas),
            relay_url=self.relay.base_url if self.relay is not None else None,
            policy_path=policy,
        )
        env.update(self.options.coordinator_env)
        self._settings.apply(env)
        reset_function_app()
        if self.relay is None:
            self._direct_swap = approve_directly(self.workdir, self.imds.url)

    def _forwarder(self, vm: VmSpec) -> ForwarderProcess:
        assert self.imds is not None
        assert self.eventhubs is not None
        home = self.vm_dir(vm.name)
        (home / "state").mkdir(parents=True, exist_ok=True)
        write_boot_time(self.boot_time_file(vm.name), time.time() - 3600)  # booted an hour ago
        install_hooks(vm, home / "hooks", prepare_hooks=self.options.prepare_hooks)
        command = forwarder_command(
            vm,
            home=home,
            imds_url=self.imds.url_for(vm.name),
            eventhub_namespace=self.eventhubs.rest_namespace,
            eventhub_name=HUB,
            relay_url=self.relay.ws_url if self.relay is not None else None,
            options=self.options,
            spans_file=self.telemetry_dir / f"spans-{vm.name}.jsonl",
            boot_time_file=self.boot_time_file(vm.name),
        )
        log_path = self.logs_dir / f"forwarder-{vm.name}.log"
        return ForwarderProcess(name=vm.name, command=command, env=forwarder_env(), log_path=log_path)

    def iter_forwarders(self) -> Iterator[ForwarderProcess]:
        yield from self.forwarders.values()
