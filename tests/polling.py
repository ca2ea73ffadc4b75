"""Waiting, in a test, for what another thread or process does: a check polled until it holds, within a bound.
A check's value is often ``x and y`` (false, or what the test reads next): typed Any."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll(check: Callable[[], Any], *, timeout: float, interval: float = 0.02) -> Any:
    """``check()`` every ``interval`` s until its value is true, for ``timeout`` s at most: that value, or (the time
    up) the value of one last call."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    return check()


def wait_for(
    check: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> Any:
    """``poll``'s true value; the time up, the test fails naming ``what`` and the last value."""
    value = poll(check, timeout=timeout, interval=interval)
    if not value:
        raise AssertionError(f"timed out after {timeout} s waiting for {what} (last value {value!r})")
    return value
