"""What the daemon's worker threads share, built once by the daemon (forwarder/daemon.py) and given to each: the
poll loop's ``Poller`` and ``ImpactMeter``, the ``HookWorker`` and the ``Sender``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forwarder.durable_state import Store
from forwarder.telemetry import Tracer


@dataclass(frozen=True)
class WorkerParts:
    """``store``: the VM's durable state (spool, ledgers); ``tracer``: the workers' spans; ``counters``: what the
    heartbeat reports, each key written by one thread only; ``spooled``: called once something new is in the spool
    (it wakes the sender)."""

    store: Store
    tracer: Tracer
    counters: dict[str, int]
    spooled: Callable[[], None]
