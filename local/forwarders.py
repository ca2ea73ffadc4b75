"""The forwarders of a local run: each simulated VM's ``python -m forwarder run`` process (started, killed, paused,
stopped), its command and environment, and the hooks installed in its folder."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from emulators.imds.vm_models import HookSpec, VmSpec
from emulators.tls import local_tls
from local.child import ChildProcess
from local.host import REPO_ROOT
from local.stack_options import LOCAL_CLOCK_TOLERANCE, StackOptions

PREPARE_HOOK = """#!/bin/sh
# Local-mode prepare hook: what a drain script would do before the event (here: note it and succeed).
echo "prepared $SCHEDULED_EVENT_TYPE $SCHEDULED_EVENT_ID on $VM_NAME"
"""


def hook_script(hook: HookSpec) -> str:
    """A scenario hook as a script: say what it is, sleep ``seconds`` and exit with ``exitCode``."""
    return (
        "#!/bin/sh\n"
        f"# Local-mode hook from the scenario: sleeps {hook.seconds:g} s and exits {hook.exitCode}.\n"
        f'echo "{hook.name} on $VM_NAME for $SCHEDULED_EVENT_TYPE $SCHEDULED_EVENT_ID: exit {hook.exitCode}"\n'
        f"sleep {shlex.quote(f'{hook.seconds:g}')}\n"
        f"exit {hook.exitCode}\n"
    )


# ---- forwarders ------------------------------------------------------------------------------------------
def install_hooks(vm: VmSpec, hooks: Path, *, prepare_hooks: bool) -> None:
    """The scenario's hooks of the VM (a script per hook; a force hook is run by name, by an escalation's force step);
    without ``hooks`` the single succeeding drain hook (unless the run has no prepare hooks)."""
    scripts: dict[str, dict[str, str]] = {"prepare": {}, "recover": {}, "force": {}}
    if vm.hooks is not None:
        for phase in ("prepare", "recover", "force"):
            scripts[phase] = {hook.name: hook_script(hook) for hook in getattr(vm.hooks, phase)}
    elif prepare_hooks:
        scripts["prepare"]["10-drain"] = PREPARE_HOOK
    for phase, files in scripts.items():
        for file_name, text in files.items():
            path = hooks / f"{phase}.d" / file_name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            path.chmod(0o755)


def forwarder_command(
    vm: VmSpec,
    *,
    home: Path,
    imds_url: str,
    eventhub_namespace: str,
    eventhub_name: str,
    relay_url: str | None,
    options: StackOptions,
    spans_file: Path,
    boot_time_file: Path,
) -> list[str]:
    """``python -m forwarder run`` for the VM whose folder is ``home`` (its state and hooks), as the stack runs it."""
    # A VM whose clock is off runs the forwarder through the local launcher that skews its clock.
    launcher = ["forwarder"] if not vm.clockSkewSeconds else ["local.skewed_forwarder", f"{vm.clockSkewSeconds:g}"]
    command = [
        sys.executable,
        "-m",
        *launcher,
        "run",
        "--imds-url",
        imds_url,
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
        eventhub_namespace,
        "--eventhub-name",
        eventhub_name,
        "--hooks-dir",
        str(home / "hooks"),
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
        str(spans_file),
        "--boot-time-file",
        str(boot_time_file),
    ]
    if relay_url is not None:
        command += ["--relay-enabled", "--relay-endpoint", relay_url]
    return command


def forwarder_env() -> dict[str, str]:
    """This process's environment without the forwarder's and the coordinator's settings (the command gives them),
    the coordinator's identity endpoint included: a VM cannot reach the app's (emulators/app_identity.py)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SE_FORWARDER_", "COORDINATOR_")) and k not in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER")
    }
    env["SE_FORWARDER_NOT_AFTER_TOLERANCE"] = str(LOCAL_CLOCK_TOLERANCE)  # as the coordinator's (one clock here)
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(local_tls().client_env())  # the emulators' CA, through Python's usual setting (emulators/tls.py)
    return env


class ForwarderProcess(ChildProcess):
    """``python -m forwarder run`` for one simulated VM, its state, spool and hooks under ``workdir/vms/NAME``."""

    def __init__(self, *, name: str, command: list[str], env: dict[str, str], log_path: Path) -> None:
        super().__init__(log_path)
        self.name = name
        self._command = command
        self._env = env
        self.paused = False

    def start(self) -> None:
        if self.running:
            return
        self._spawn(self._command, self._env)

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
