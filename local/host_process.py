"""The coordinator's own process, seen from the local stack (``StackOptions.coordinator_process``): ``python -m
local.host`` (local/host.py) started with the stack's environment (the app settings ``LocalStack`` set) and a spec
file, killed with SIGKILL as a crash ends a Functions instance, and started again as a new instance, which resumes
from the Event Hubs checkpoints and the state the dead one committed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Protocol

from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from local.child import ChildProcess
from local.host import REPO_ROOT, HostProcessOptions, HostSpec
from local.http_host import LocalHttpServer
from local.stack_options import StackOptions

log = logging.getLogger("local.host_process")

SPEC_FILE = "coordinator-host.json"


class HostedStack(Protocol):
    """What the coordinator's process is built from: the stack's options, emulators, front door and folders
    (``local.stack.LocalStack``)."""

    options: StackOptions
    eventhubs: EventHubsEmulator | None
    front: LocalHttpServer | None
    imds: ImdsEmulator | None
    relay: RelayEmulator | None
    workdir: Path

    @property
    def logs_dir(self) -> Path: ...


class CoordinatorProcess(ChildProcess):
    """``python -m local.host SPEC``: the function host of ``function_app`` in a child process of its own, serving the
    people's routes on the listening socket ``http_fd`` (held by the stack, so requests wait in its backlog while no
    instance runs). Its output goes to ``log_path``, each instance appending."""

    def __init__(self, spec: HostSpec, *, spec_path: Path, log_path: Path) -> None:
        super().__init__(log_path)
        self.spec = spec
        self.spec_path = spec_path
        spec.write(spec_path)
        self.starts = 0
        self.kills = 0

    @classmethod
    def for_stack(cls, stack: HostedStack, options: HostProcessOptions) -> CoordinatorProcess:
        """The stack's host as a process: its hubs, timer, people and approval path (the Relay, else straight into
        the IMDS emulator); the app settings are those ``stack`` put in this process's environment."""
        if stack.options.ingest_wrapper is not None:
            raise ValueError("an ingest wrapper runs in the stack's process: not with coordinator_process")
        assert stack.eventhubs is not None
        assert stack.front is not None
        assert stack.imds is not None
        spec = HostSpec(
            eventhub_connection_string=stack.eventhubs.connection_string(),
            timer_interval=stack.options.timer_interval,
            http_fd=stack.front.fileno(),
            people=stack.options.people,
            options=options,
            direct_imds_url=None if stack.relay is not None else stack.imds.url,
            vms_dir=str(stack.workdir / "vms"),
        )
        return cls(spec, spec_path=stack.workdir / SPEC_FILE, log_path=stack.logs_dir / "coordinator.log")

    def start(self) -> None:
        """A new instance (nothing when one runs)."""
        if self.running:
            return
        self._close_log()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT)
        process = self._spawn(
            [sys.executable, "-m", "local.host", str(self.spec_path)], env, pass_fds=(self.spec.http_fd,)
        )
        self.starts += 1
        log.info("coordinator host started (pid %d)", process.pid)

    def kill(self) -> None:
        """SIGKILL, as a crash, an OOM kill or a recycled instance: nothing of the host runs on, no tail finishes."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.kill()
        process.wait(timeout=10)
        self.kills += 1
        log.info("coordinator host killed (pid %d)", process.pid)

    def stop(self, *, timeout: float = 30.0) -> int | None:
        """SIGTERM (the triggers stop and the batches' tails finish), SIGKILL after ``timeout``."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("coordinator host %d did not stop within %g s: killed", process.pid, timeout)
                process.kill()
                process.wait(timeout=10)
        self._close_log()
        return process.returncode
