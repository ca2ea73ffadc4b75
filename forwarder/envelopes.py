"""The incarnation, hook and impact envelopes as this forwarder spools them: each built only once the store gives it
its sequence (``Store.enqueue``), stamped with the VM, when it was observed, this forwarder's version and its state.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from contracts.wire import Envelope, EnvelopeKind, HookReport, ImpactReport, ScheduledEventsDocument, VmIdentity
from forwarder import __version__
from forwarder.durable_state import Store


def envelope_builder(
    store: Store,
    identity: VmIdentity,
    kind: EnvelopeKind,
    observed: datetime,
    *,
    document: ScheduledEventsDocument | None = None,
    hook: HookReport | None = None,
    impact: ImpactReport | None = None,
) -> Callable[[int], bytes]:
    """The envelope's bytes under a sequence; the state id is read when it is built (the spool's transaction)."""

    def build(sequence: int) -> bytes:
        return Envelope(
            kind=kind,
            vm=identity,
            observedAt=observed,
            sequence=sequence,
            forwarder=__version__,
            stateId=store.state_id,
            document=document,
            hook=hook,
            impact=impact,
        ).to_json_bytes()

    return build
