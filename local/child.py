"""What the stack's child processes (a forwarder, the coordinator's host) share: a process of this project's own
code, in a session of its own, its output appended to a log file."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from local.host import REPO_ROOT


# Ctrl-C (or a SIGTERM to the runner) raised inside Popen, after its fork and before it returns, leaves a child running
# that nothing holds, so nothing stops it (a fresh-clone CI run: the fleet demo's last forwarder ran on after "every
# child process was stopped"). With ``interrupt_on``'s handler, the interrupt waits until the child is held.
class _Starting:
    """How many children are being started now, and the signal that came meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.deferred: int | None = None

    def __enter__(self) -> None:
        with self.lock:
            self.count += 1

    def __exit__(self, *_: object) -> None:
        with self.lock:
            self.count -= 1
            fire = self.deferred if not self.count else None
            if fire is not None:
                self.deferred = None
        if fire is not None:
            signal.raise_signal(fire)  # now that the child is held: the handler raises in the main thread


_starting = _Starting()


def interrupt_on(*signals: signal.Signals) -> None:
    """Each of ``signals`` raises KeyboardInterrupt in the main thread, as Ctrl-C does, except while a child is being
    started: then once it is held (``ChildProcess._spawn``), so that the runner's stop stops it too."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        if _starting.count:  # read without the lock: the handler may run while the main thread holds it
            _starting.deferred = signum
            return
        raise KeyboardInterrupt(f"signal {signum}")

    for one in signals:
        signal.signal(one, handler)


class ChildProcess:
    """One child at a time: ``_spawn`` starts it, ``_close_log`` closes its log once it has ended."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _spawn(
        self, command: list[str], env: dict[str, str], *, pass_fds: Sequence[int] = ()
    ) -> subprocess.Popen[bytes]:
        self._log = self.log_path.open("ab")
        with _starting:
            # The command is this interpreter running the project's own module; nothing from outside reaches it.
            self._process = subprocess.Popen(  # noqa: S603
                command,
                env=env,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                pass_fds=pass_fds,
                start_new_session=True,  # Ctrl-C reaches the runner, which stops its children in order
            )
        return self._process

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
