"""The local pipeline's parts, started and stopped together: Azurite, the Event Hubs, Relay and IMDS emulators,
one forwarder process per simulated VM, and the function host (``local.runner``) in front of ``function_app``.

Everything lives under one work folder (``.local/`` by default): per-VM state, spool and hooks, logs, the history
database, Teams cards. ``LocalStack`` is a context manager; leaving it stops every child process it started.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from emulators.azurite import Azurite, AzuriteEndpoints
from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario
from emulators.relay import RelayEmulator
from local.runner import FunctionHost, IngestFunction
from local.scenario import delayed

log = logging.getLogger("local.stack")

REPO_ROOT = Path(__file__).resolve().parent.parent
HUB = "scheduled-events"
PARTITIONS = 4
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
        self._close_log()

    def stop(self, *, timeout: float = 10.0) -> int | None:
        """SIGTERM (the forwarder finishes its send and exits), SIGKILL after ``timeout``."""
        process = self._process
        if process is None:
            return None
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

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.workdir = options.workdir.resolve()
        self.azurite: Azurite | None = None
        self.storage: AzuriteEndpoints | None = None
        self.eventhubs: EventHubsEmulator | None = None
        self.relay: RelayEmulator | None = None
        self.imds: ImdsEmulator | None = None
        self.host: FunctionHost | None = None
        self.forwarders: dict[str, ForwarderProcess] = {}
        self._saved_env: dict[str, str | None] = {}
        self._lock: IO[str] | None = None

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
        self.eventhubs = EventHubsEmulator(hubs={HUB: PARTITIONS})
        self.eventhubs.start()
        if self.options.relay:
            self.relay = RelayEmulator()
            self.relay.start()
        scenario = delayed(self.options.scenario, seconds=self.options.lead_in * self.options.time_scale)
        self.imds = ImdsEmulator(
            scenario=scenario, time_scale=self.options.time_scale, throttle_rps=self.options.throttle_rps
        )
        self.imds.start()
        self._configure_coordinator()
        self.host = self._function_host()
        self.host.start()
        for vm in self.imds.vms():
            self.forwarders[vm.name] = self._forwarder(vm.name)
            self.forwarders[vm.name].start()

    def stop(self) -> None:
        for forwarder in self.forwarders.values():
            with contextlib.suppress(Exception):
                forwarder.stop(timeout=5)
        if self.host is not None:
            with contextlib.suppress(Exception):
                self.host.stop()
            self.host = None
        _reset_function_app()
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
        for name in ("vms", "cards", "logs", "history.sqlite", "history.sqlite-wal", "history.sqlite-shm"):
            target = self.workdir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.cards_dir.mkdir(parents=True, exist_ok=True)

    # ---- the coordinator (function_app) ----------------------------------------------------------------------
    def _configure_coordinator(self) -> None:
        assert self.storage is not None
        assert self.imds is not None
        env = {
            "COORDINATOR_STORAGE_CONNECTION_STRING": self.storage.connection_string,
            "COORDINATOR_HISTORY_SQLITE_PATH": str(self.history_path),
            "COORDINATOR_CARDS_FOLDER": str(self.cards_dir),
            "COORDINATOR_ALLOW_ANONYMOUS_APPROVAL": "true",
            "COORDINATOR_PUBLIC_BASE_URL": "http://127.0.0.1:7071",
            "EVENTHUB_NAME": HUB,
            "EVENTHUB_CONSUMER_GROUP": "$Default",
        }
        if self.relay is not None:
            env["COORDINATOR_RELAY_ENDPOINT"] = self.relay.base_url
            # The coordinator's DefaultAzureCredential takes the managed-identity (IMDS) flow against the IMDS
            # emulator; the token it mints is an Entra-shaped JWT the Relay emulator verifies.
            env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = self.imds.url
        else:
            env["COORDINATOR_IMDS_EMULATOR_URL"] = self.imds.url
        if self.options.policy_path is not None:
            env["COORDINATOR_POLICY_PATH"] = str(self.options.policy_path.resolve())
        env.update(self.options.coordinator_env)
        for name in _IDENTITY_VARIABLES:
            self._set_env(name, None)
        for name, value in env.items():
            self._set_env(name, value)
        _reset_function_app()

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

    def _function_host(self) -> FunctionHost:
        import function_app  # noqa: PLC0415 -- imported after the app settings are in the environment

        assert self.eventhubs is not None
        assert self.storage is not None
        ingest: IngestFunction = function_app.ingest_envelopes
        if self.options.ingest_wrapper is not None:
            ingest = self.options.ingest_wrapper(ingest)
        return FunctionHost(
            eventhub_connection_string=self.eventhubs.connection_string(),
            eventhub_name=HUB,
            storage_connection_string=self.storage.connection_string,
            ingest=ingest,
            timer=function_app.reevaluate,
            timer_interval=self.options.timer_interval,
        )

    # ---- forwarders ------------------------------------------------------------------------------------------
    def _forwarder(self, name: str) -> ForwarderProcess:
        assert self.imds is not None
        assert self.eventhubs is not None
        options = self.options
        home = self.vm_dir(name)
        (home / "state").mkdir(parents=True, exist_ok=True)
        hooks = home / "hooks"
        if options.prepare_hooks:
            prepare = hooks / "prepare.d" / "10-drain"
            prepare.parent.mkdir(parents=True, exist_ok=True)
            prepare.write_text(PREPARE_HOOK, encoding="utf-8")
            prepare.chmod(0o755)
        command = [
            sys.executable,
            "-m",
            "forwarder",
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
            "--eventhub-name",
            HUB,
            "--hooks-dir",
            str(hooks),
            "--hook-timeout",
            "30",
            "--log-level",
            options.forwarder_log_level,
        ]
        if self.relay is not None:
            command += ["--relay-enabled", "--relay-endpoint", self.relay.base_url.replace("http://", "ws://", 1)]
        env = {
            k: v for k, v in os.environ.items() if k not in _IDENTITY_VARIABLES and not k.startswith("SE_FORWARDER_")
        }
        env = {k: v for k, v in env.items() if not k.startswith("COORDINATOR_")}
        # The key travels in the environment, not on the command line where `ps` would show it.
        env["SE_FORWARDER_EVENTHUB_CONNECTION_STRING"] = self.eventhubs.connection_string()
        env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = self.imds.url_for(name)
        env["PYTHONPATH"] = str(REPO_ROOT)
        return ForwarderProcess(name=name, command=command, env=env, log_path=self.logs_dir / f"forwarder-{name}.log")

    def iter_forwarders(self) -> Iterator[ForwarderProcess]:
        yield from self.forwarders.values()


def _reset_function_app() -> None:
    """A new Functions worker process would read the app settings afresh; so does the next stack in this process."""
    module = sys.modules.get("function_app")
    if module is None:
        return
    module.settings.cache_clear()
    coordinator = module.coordinator
    if coordinator.cache_info().currsize:
        with contextlib.suppress(Exception):
            coordinator().history.close()
    coordinator.cache_clear()
