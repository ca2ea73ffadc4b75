"""What a heartbeat says: that this forwarder runs, its counters, and its health (`ForwarderHealth`).

A forwarder that runs but cannot read IMDS misses every event, and only its heartbeat can say so. Takes: the poll
loop's record of its polls (`PollHealth`, written by the poll loop only), the daemon's counters, the store (spool
depth, what it dropped or set aside) and whether the relay listener is connected. Gives: `spool_heartbeat`, which
builds the `heartbeat` envelope and spools it; the daemon decides when (at start, then every `heartbeat_interval`).
"""

from __future__ import annotations

from datetime import UTC, datetime

from contracts.wire import Envelope, ForwarderHealth, VmIdentity
from forwarder import __version__
from forwarder.durable_state import SpooledEnvelope, Store, StoreFull
from forwarder.imds import ImdsError

# ForwarderHealth.lastPollError's bound.
POLL_ERROR_CHARS = 256


class PollHealth:
    """The polls as heartbeats report them: the last good one, the failures since, the last failure."""

    def __init__(self) -> None:
        self.last_good_poll: datetime | None = None
        self.consecutive_errors = 0
        self.last_error = ""

    def succeeded(self) -> None:
        self.last_good_poll = datetime.now(UTC)
        self.consecutive_errors = 0

    def failed(self, error: ImdsError) -> None:
        self.consecutive_errors += 1
        # IMDS errors name the status and the reason, never a credential (the poll sends none).
        self.last_error = f"{type(error).__name__}: {error}"[:POLL_ERROR_CHARS]


def spool_heartbeat(
    store: Store,
    identity: VmIdentity,
    *,
    counters: dict[str, int],
    polls: PollHealth,
    listener_connected: bool | None,
) -> SpooledEnvelope | None:
    """Spool one heartbeat. `counters` are the daemon's (the store adds its own); `listener_connected` is None
    when no relay listener is configured. When the state directory is full, the heartbeat is built under a
    sequence of the store's reserve and given back, to be sent from memory (None when the reserve is used up);
    it says since when the directory is full."""
    stored = store.counters()
    depth = store.depth()
    carried = {"invalid_documents": 0, "invalid_events": 0, **stored, **counters, "spool_depth": depth}
    observed = datetime.now(UTC)

    def build(sequence: int) -> bytes:
        # The store's own health as it is when the heartbeat is built: after a failed write, that failure too.
        health = ForwarderHealth(
            lastGoodPollAt=polls.last_good_poll,
            pollErrors=counters["imds_errors"],
            consecutivePollErrors=polls.consecutive_errors,
            lastPollError=polls.last_error,
            spoolDepth=depth,
            dropped=stored.get("spool_dropped", 0),
            sendErrors=counters["send_failures"],
            listenerConnected=listener_connected,
            stateFullSince=store.full_since,
            stateWriteErrors=store.write_errors,
            lastStateError=store.last_error,
        )
        # Unknown envelope fields are kept by contract; the counters let the coordinator see a sick VM.
        return Envelope.from_mapping(
            {
                "kind": "heartbeat",
                "vm": identity,
                "observedAt": observed,
                "sequence": sequence,
                "forwarder": __version__,
                "stateId": store.state_id,
                "counters": carried,
                "health": health,
            }
        ).to_json_bytes()

    try:
        store.enqueue("heartbeat", build)
    except StoreFull:
        sequence = store.take_unspooled()
        return None if sequence is None else SpooledEnvelope(-1, sequence, "heartbeat", build(sequence))
    return None
