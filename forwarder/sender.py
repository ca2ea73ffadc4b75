"""The sender thread: spooled envelopes to the sink, in spool order, for as long as the daemon runs.

Takes: the store (its spool), the sink, the tracer, the daemon's stop event and its counters. Gives: `Sender.run` for
the thread, and `wake()` for whoever spooled something. A failed send keeps the envelopes in the spool and backs off
(`forwarder.retry.Backoff`): an outage shows up as a growing spool, never as a lost envelope; a full disk as
heartbeats sent from memory. On stop it flushes for at most `SHUTDOWN_FLUSH_SECONDS`; what is left is sent after the
restart. With an attestor (forwarder/attestor.py), each envelope goes out with the attested document current at the
send, and nothing goes out before there is one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import replace

from contracts.wire import Attestation, VmIdentity
from forwarder.attestor import Attestor
from forwarder.durable_state import SpooledEnvelope, StoreFull
from forwarder.logs import FailureLog, fields
from forwarder.retry import Backoff
from forwarder.sinks import Sink, SinkError, UndeliverableEnvelope
from forwarder.telemetry import send_spans
from forwarder.worker_parts import WorkerParts

log = logging.getLogger("forwarder")

SHUTDOWN_FLUSH_SECONDS = 5.0
# While there is no attested document to send with (at start, or IMDS refusing it), look again this often.
ATTESTATION_WAIT_SECONDS = 1.0


def attach(item: SpooledEnvelope, attestation: Attestation) -> SpooledEnvelope:
    """The envelope as it goes on the wire: with the attested document (added here, not in the spool, so that a
    replay carries a document valid when it is sent)."""
    body = json.loads(item.body)
    body["attestation"] = attestation.to_mapping()
    return replace(item, body=json.dumps(body, separators=(",", ":")).encode())


class Sender:
    """Sends the spool through the sink. `counters` is the daemon's: this thread counts `sent` and `send_failures`.

    While the state directory is full it also sends what could not be spooled (`hold`: heartbeats under a
    sequence of the store's reserve), in sequence order with the spool, and remembers what it sent but could not
    delete from the spool, so that it is neither lost nor sent over and over."""

    def __init__(
        self,
        parts: WorkerParts,
        *,
        sink: Sink,
        batch_max: int,
        stop: threading.Event,
        attestor: Attestor | None = None,
    ) -> None:
        self._parts = parts
        self._attestor = attestor
        self._unattested = FailureLog("waiting for an IMDS attested document before sending", logger=log)
        self._sink = sink
        self._batch_max = batch_max
        self._stop = stop
        self._wake = threading.Event()
        self._failures = FailureLog("sending to the sink", logger=log)
        self._lock = threading.Lock()
        self._held: list[SpooledEnvelope] = []
        self._sent: dict[int, SpooledEnvelope] = {}

    def wake(self) -> None:
        """Something was spooled (or the daemon is stopping): look at the spool now."""
        self._wake.set()

    def _waiting_for_attestation(self, attestation: Attestation | None) -> bool:
        """Whether envelopes wait: an attestor is configured and has no document yet (logged once, then each
        minute, and when it ends)."""
        if self._attestor is not None and attestation is None:
            self._unattested.failed(RuntimeError("no attested document yet (see the attested document's log)"))
            # Ask now rather than wait for the poll loop: the start-up heartbeat goes out before the first poll,
            # which may take two minutes while IMDS wakes Scheduled Events up.
            self._attestor.tick()
            return True
        self._unattested.succeeded()
        return False

    def _send(self, items: list[SpooledEnvelope], identity: VmIdentity, attestation: Attestation | None) -> None:
        with send_spans(self._parts.tracer, items, vm_name=identity.name) as outgoing:
            wire = outgoing if attestation is None else [attach(item, attestation) for item in outgoing]
            self._sink.send(wire, partition_key=identity.partition_key)

    def hold(self, item: SpooledEnvelope) -> None:
        """Sends ``item`` from memory, after every spooled envelope of a lower sequence."""
        with self._lock:
            self._held.append(item)
        self.wake()

    def _next_batch(self) -> list[SpooledEnvelope]:
        """The lowest sequences of the spool (less what was sent already) and of the held envelopes."""
        if self._sent:
            try:
                self._parts.store.ack(list(self._sent.values()))
                self._sent.clear()
            except StoreFull:
                pass  # still full: skipped below, deleted once there is room
        spooled = [i for i in self._parts.store.peek(self._batch_max + len(self._sent)) if i.id not in self._sent]
        with self._lock:
            held = list(self._held)
        return sorted([*spooled[: self._batch_max], *held], key=lambda item: item.sequence)[: self._batch_max]

    def _done(self, items: list[SpooledEnvelope]) -> None:
        """Sent: out of the spool (or remembered, while the disk is full) and out of memory."""
        spooled = [item for item in items if item.id >= 0]
        with self._lock:
            self._held = [item for item in self._held if item not in items]
        try:
            self._parts.store.ack(spooled)
        except StoreFull:
            self._sent.update((item.id, item) for item in spooled)

    def run(self, identity: VmIdentity) -> None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        deadline: float | None = None
        while True:
            if self._stop.is_set() and deadline is None:
                deadline = time.monotonic() + SHUTDOWN_FLUSH_SECONDS
            if deadline is not None and time.monotonic() >= deadline:
                break
            items = self._next_batch()
            if not items:
                if self._stop.is_set():
                    break
                self._wake.wait()
                self._wake.clear()
                continue
            attestation = self._attestor.current() if self._attestor is not None else None
            if self._waiting_for_attestation(attestation):
                if deadline is not None:
                    break
                self._stop.wait(ATTESTATION_WAIT_SECONDS)
                continue
            try:
                self._send(items, identity, attestation)
            except UndeliverableEnvelope as exc:
                log.error(
                    "envelope can never be delivered; set aside",
                    extra=fields(reason=str(exc), sequence=exc.item.sequence),
                )
                with contextlib.suppress(StoreFull):  # counted and logged here when the disk is full
                    self._parts.store.reject(
                        f"undeliverable envelope: {exc}", exc.item.body, counter="undeliverable_envelopes"
                    )
                self._done([exc.item])
            except Exception as exc:  # SinkError, and whatever else an SDK or credential raises: keep spooling
                self._parts.counters["send_failures"] += 1
                self._failures.failed(
                    exc, spool_depth=self._parts.store.depth(), unexpected=not isinstance(exc, SinkError)
                )
                if deadline is not None:
                    break
                self._wake.clear()
                self._stop.wait(backoff.next_delay())
            else:
                self._done(items)
                self._parts.counters["sent"] += len(items)
                self._failures.succeeded()
                backoff.reset()
        depth = self._parts.store.depth()
        if depth:
            log.warning(
                "stopping with unsent envelopes; they are kept and sent after the restart", extra=fields(unsent=depth)
            )
