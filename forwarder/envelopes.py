"""The envelope of one report, as the spool renders it: ``Store.enqueue`` gives it its sequence inside the
transaction that spools it, so each kind's report (a document, a hook phase, an impact) is wrapped in the fields every
envelope carries only then (forwarder/heartbeat.py builds its own: its health is read at that moment too)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from contracts.wire import Envelope, EnvelopeKind, VmIdentity
from forwarder import __version__

__all__ = ["envelope_of"]


def envelope_of(
    kind: EnvelopeKind, vm: VmIdentity, state_id: str, observed: datetime, **report: Any
) -> Callable[[int], bytes]:
    """``build(sequence)`` for ``Store.enqueue``: the envelope of ``kind`` for this VM's state, seen at
    ``observed``, with ``report`` under its own key (``document``, ``hook`` or ``impact``)."""

    def build(sequence: int) -> bytes:
        fields = {"kind": kind, "vm": vm, "observedAt": observed, "sequence": sequence, "forwarder": __version__}
        return Envelope.from_mapping({**fields, "stateId": state_id, **report}).to_json_bytes()

    return build
