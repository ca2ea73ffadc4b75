"""``python -m local.skewed_forwarder SECONDS ARGS…``: the forwarder (``python -m forwarder ARGS…``) on a VM whose
clock is SECONDS off (negative: slow). Local-only: the stack starts it for a scenario VM with ``clockSkewSeconds``.

What the skew reaches is what a drifted VM clock reaches in the forwarder: the time it stamps on what it reads and
sends (``observedAt`` of every envelope, its heartbeats and the last good poll). Tokens keep the real time, as the
token service's clock is not the VM's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from forwarder import daemon
from forwarder.cli import main as forwarder_main


def skewed(clock: Callable[[], datetime], seconds: float) -> Callable[[], datetime]:
    offset = timedelta(seconds=seconds)
    return lambda: clock() + offset


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m local.skewed_forwarder SECONDS FORWARDER-ARGS...", file=sys.stderr)
        return 2
    setattr(daemon, "_now", skewed(daemon._now, float(argv[0])))  # noqa: B010 -- the module's clock, replaced
    return forwarder_main(list(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
