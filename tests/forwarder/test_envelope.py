"""The envelope contract both sides import: round-trip, forward compatibility, clear refusals."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from contracts.envelope import SCHEMA, Envelope, VmIdentity

VM = VmIdentity(
    name="web_3",
    vmId="5C08B38E-4D57-4C23-AC45-AEF2F3A0C1F4",
    resourceId="/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/3",
    vmScaleSetName="web",
)
DOCUMENT: dict[str, Any] = {
    "DocumentIncarnation": 2,
    "Events": [
        {
            "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["web_3", "web_4"],
            "EventStatus": "Scheduled",
            "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Live migration",
            "EventSource": "Platform",
            "DurationInSeconds": 5,
        }
    ],
}


def _incarnation(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "schema": SCHEMA,
        "kind": "incarnation",
        "vm": VM.model_dump(),
        "observedAt": "2026-11-21T10:00:00Z",
        "sequence": 7,
        "forwarder": "0.1.0",
        "document": DOCUMENT,
    }
    body.update(overrides)
    return body


def test_round_trip_keeps_the_document_and_unknown_fields() -> None:
    raw = _incarnation(futureField={"x": 1})
    raw["document"] = {**DOCUMENT, "NewTopLevel": True}
    envelope = Envelope.from_json_bytes(json.dumps(raw))
    again = json.loads(envelope.to_json_bytes())
    assert again["schema"] == SCHEMA
    assert again["futureField"] == {"x": 1}
    assert again["document"]["NewTopLevel"] is True
    assert again["document"]["Events"][0] == DOCUMENT["Events"][0]
    assert envelope.observedAt == datetime(2026, 11, 21, 10, tzinfo=UTC)


def test_event_helpers_use_compute_name_and_rfc1123() -> None:
    event = Envelope.from_mapping(_incarnation()).document.Events[0]  # type: ignore[union-attr]
    assert event.concerns("web_3")
    assert not event.concerns("web_5")
    assert event.not_before() == datetime(2022, 4, 11, 22, 26, 58, tzinfo=UTC)


def test_partition_key_and_relay_name_come_from_identity() -> None:
    assert VM.partition_key == VM.resourceId.lower()
    assert VM.hybrid_connection_name == "vm-5c08b38e-4d57-4c23-ac45-aef2f3a0c1f4"


def test_newer_schema_is_refused_with_a_clear_message() -> None:
    with pytest.raises(ValidationError, match="newer than"):
        Envelope.from_mapping(_incarnation(schema="scheduled-events.envelope/2"))


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"document": None}, "needs 'document'"),
        ({"kind": "hook"}, "needs 'hook'"),
        ({"observedAt": "2026-11-21T10:00:00"}, "UTC offset"),
        ({"sequence": -1}, "greater than or equal"),
        ({"schema": "something/1"}, "not a scheduled-events envelope"),
    ],
)
def test_bad_envelopes_name_the_reason(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        Envelope.from_mapping(_incarnation(**overrides))


def test_update_domain_and_tags_are_optional_and_bounded() -> None:
    old = VmIdentity(name="vm", vmId="id", resourceId="/r")  # a v1 envelope from an older forwarder
    assert (old.platformUpdateDomain, old.tags) == ("", {})
    with pytest.raises(ValidationError, match="at most 50 items"):
        VmIdentity(name="vm", vmId="id", resourceId="/r", tags={f"t{i}": "" for i in range(51)})
    with pytest.raises(ValidationError, match="at most 256 characters"):
        VmIdentity(name="vm", vmId="id", resourceId="/r", tags={"t": "v" * 257})
    tagged = VmIdentity(name="vm", vmId="id", resourceId="/r", tags={"a": "1"})
    assert hash(tagged) == hash(VmIdentity(name="vm", vmId="id", resourceId="/R", tags={"b": "2"}))
