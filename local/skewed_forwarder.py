"""``python -m local.skewed_forwarder SECONDS ARGS…``: the forwarder (``python -m forwarder ARGS…``) on a VM whose
clock is SECONDS off (negative: slow). Local-only: the stack starts it for a scenario VM with ``clockSkewSeconds``.

What the skew reaches is what a drifted VM clock reaches in what the forwarder reports: the time it stamps on what
it reads and sends (``observedAt`` of every envelope, its heartbeats, hook reports and the last good poll). Tokens
and the listener keep the real time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime, timedelta, tzinfo
from typing import Self

from forwarder import heartbeat, hook_worker, poller
from forwarder.cli import main as forwarder_main


def skewed(seconds: float) -> type[datetime]:
    """``datetime`` whose ``now`` is ``seconds`` off: what the modules that stamp envelopes see as the class."""
    offset = timedelta(seconds=seconds)

    class Skewed(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> Self:
            return super().now(tz) + offset

    return Skewed


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m local.skewed_forwarder SECONDS FORWARDER-ARGS...", file=sys.stderr)
        return 2
    clock = skewed(float(argv[0]))
    for module in (poller, heartbeat, hook_worker):
        setattr(module, "datetime", clock)  # noqa: B010 -- the module's clock, replaced
    return forwarder_main(list(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
