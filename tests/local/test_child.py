"""Ctrl-C while the local stack starts: an interrupt while a child process is being started waits until it is held
(local/child.py), and what was not started yet stops without raising (local/platform_watch.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from local.child import ChildProcess, interrupt_on
from local.platform_watch import PlatformWatch, WatchedStack


class Sleeper(ChildProcess):
    def start(self) -> None:
        self._spawn([sys.executable, "-c", "import time; time.sleep(60)"], {})

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(10)
        self._close_log()


@pytest.fixture
def interrupts() -> Iterator[None]:
    before = signal.getsignal(signal.SIGUSR1)
    interrupt_on(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_an_interrupt_that_comes_while_a_child_starts_is_raised_once_the_child_is_held(
    interrupts: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = subprocess.Popen

    def popen_then_interrupted(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = real(*args, **kwargs)
        signal.raise_signal(signal.SIGUSR1)  # Ctrl-C after the fork, before Popen returns
        return process

    monkeypatch.setattr(subprocess, "Popen", popen_then_interrupted)
    sleeper = Sleeper(tmp_path / "log")
    try:
        with pytest.raises(KeyboardInterrupt):
            sleeper.start()
        assert sleeper.running, "the child started is held, so the runner's stop can stop it"
    finally:
        sleeper.stop()
    assert not sleeper.running


def test_an_interrupt_at_any_other_time_is_raised_at_once(interrupts: None) -> None:
    with pytest.raises(KeyboardInterrupt, match="signal"):
        signal.raise_signal(signal.SIGUSR1)


def test_a_platform_watch_interrupted_before_it_started_stops_without_raising() -> None:
    # Ctrl-C while the watch's thread was starting: the stack's stop raised "cannot join thread before it is
    # started" and left every forwarder running (a fresh-clone CI run at 87f9d4b).
    watch = PlatformWatch(cast(WatchedStack, None), [])
    watch.stop()
    watch.stop()
