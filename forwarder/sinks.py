"""Where spooled envelopes go: Event Hubs in production (forwarder/eventhub.py), a JSON-lines file or stdout for
dry runs.

`Sink` is the narrowest seam of the send path: the sender hands it envelopes (already JSON) in order, and it
either delivers all of them or raises. Retrying is not its job; the sender owns retries and backoff.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol

from forwarder.durable_state import SpooledEnvelope

log = logging.getLogger("forwarder.sinks")


class SinkError(Exception):
    """Delivery failed for now (network, auth, throttling): keep the envelopes and try again later."""


class UndeliverableEnvelope(SinkError):
    """This one envelope can never be delivered (e.g. larger than the hub accepts): set it aside."""

    def __init__(self, message: str, *, item: SpooledEnvelope) -> None:
        super().__init__(message)
        self.item = item


class Sink(Protocol):
    def send(self, items: Sequence[SpooledEnvelope], *, partition_key: str) -> None:
        """Deliver all items in order under one partition key, or raise SinkError."""

    def close(self) -> None: ...


class JsonLinesSink:
    """One envelope per line, to a file (appended) or to a stream such as stdout: dry runs and local demos."""

    def __init__(self, *, path: Path | None = None, stream: IO[str] | None = None) -> None:
        if (path is None) == (stream is None):
            raise ValueError("JsonLinesSink needs exactly one of path= or stream=")
        self._owned = path is not None
        self._out: IO[str] = path.open("a", encoding="utf-8") if path is not None else stream or sys.stdout

    def send(self, items: Sequence[SpooledEnvelope], *, partition_key: str) -> None:
        try:
            for item in items:
                self._out.write(item.body.decode("utf-8") + "\n")
            self._out.flush()
        except OSError as exc:
            raise SinkError(f"writing envelopes failed: {exc}") from exc

    def close(self) -> None:
        if self._owned:
            self._out.close()
