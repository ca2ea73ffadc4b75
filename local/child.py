"""What the stack's child processes (a forwarder, the coordinator's host) share: a process of this project's own
code, in a session of its own, its output appended to a log file."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from local.host import REPO_ROOT


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
