"""forwarder.envelopes: a report rendered as the envelope the spool sends, under the sequence it is given then."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from contracts.checks import Invalid
from contracts.wire import Envelope, ScheduledEventsDocument, VmIdentity
from forwarder import __version__
from forwarder.envelopes import envelope_of

VM = VmIdentity.from_mapping(
    {
        "name": "web_3",
        "vmId": "5c08b38e-4d57-4c23-ac45-aef2f3a0c1f4",
        "resourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/"
        "virtualMachines/3",
        "vmScaleSetName": "web",
    }
)
SEEN = datetime(2026, 11, 30, 5, 0, tzinfo=UTC)


def test_the_report_goes_under_its_key_with_the_sequence_given_at_spooling() -> None:
    document = ScheduledEventsDocument.from_mapping({"DocumentIncarnation": 4, "Events": []})
    build = envelope_of("incarnation", VM, "state-1", SEEN, document=document)

    first, later = json.loads(build(7)), Envelope.from_mapping(json.loads(build(8)))

    assert (first["kind"], first["sequence"], first["stateId"], first["forwarder"]) == (
        "incarnation",
        7,
        "state-1",
        __version__,
    )
    assert first["document"]["DocumentIncarnation"] == 4
    assert (later.sequence, later.vm.name, later.observedAt) == (8, "web_3", SEEN)


def test_a_report_the_envelope_cannot_carry_is_refused_when_built() -> None:
    with pytest.raises(Invalid):
        envelope_of("impact", VM, "state-1", SEEN, impact={"eventId": 5})(1)
