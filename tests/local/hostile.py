"""Hostile envelopes for the fault tests: a real envelope (built with the forwarder's own model) and hypothesis
strategies that break it in every way a sender could — each result must be refused by the coordinator."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hypothesis import strategies as st

from contracts.document import ScheduledEventsDocument
from contracts.envelope import Envelope, VmIdentity


def template(vm: VmIdentity) -> dict[str, Any]:
    """A valid incarnation envelope for ``vm``, as JSON-ready data (from the real model)."""
    document = ScheduledEventsDocument.model_validate(
        {
            "DocumentIncarnation": 3,
            "Events": [
                {
                    "EventId": "5A0B7E0A-0000-4000-8000-00000000F022",
                    "EventType": "Freeze",
                    "ResourceType": "VirtualMachine",
                    "Resources": [vm.name],
                    "EventStatus": "Scheduled",
                    "NotBefore": "Mon, 05 Jan 2026 12:15:00 GMT",
                    "DurationInSeconds": 5,
                    "EventSource": "Platform",
                }
            ],
        }
    )
    envelope = Envelope(
        kind="incarnation",
        vm=vm,
        observedAt=datetime.now(UTC),
        sequence=10_000_000,
        forwarder="fuzz/1",
        document=document,
    )
    data: dict[str, Any] = json.loads(envelope.to_json_bytes())
    return data


_REQUIRED_TOP = ("kind", "vm", "observedAt", "sequence", "forwarder")
_REQUIRED_VM = ("name", "vmId", "resourceId")
_not_an_int = st.one_of(st.text(alphabet="abcxyz!-. ", min_size=1, max_size=12), st.lists(st.integers(), max_size=2))
_bad_time = st.one_of(
    st.just("2026-01-05T12:00:00"),  # no UTC offset
    st.text(alphabet="abc:-T ", min_size=0, max_size=20),
    st.integers(min_value=-(2**70), max_value=-(2**64)),
)


def _event_field(draw: st.DrawFn, data: dict[str, Any]) -> None:
    event = data["document"]["Events"][0]
    field = draw(st.sampled_from(["EventId", "EventStatus", "EventType", "Resources", "DurationInSeconds"]))
    if field in ("EventId", "EventType"):
        event[field] = ""
    elif field == "EventStatus":
        event[field] = draw(st.text(max_size=10).filter(lambda t: t not in ("Scheduled", "Started")))
    elif field == "Resources":
        event[field] = draw(_not_an_int.filter(lambda v: not isinstance(v, list)))
    else:
        event[field] = draw(_not_an_int)


def _payload(draw: st.DrawFn, data: dict[str, Any]) -> None:
    data.pop("document")
    data["kind"] = draw(st.sampled_from(["incarnation", "hook"]))


_bad_schema = st.one_of(
    st.integers(min_value=2, max_value=10**6).map(lambda n: f"scheduled-events.envelope/{n}"),
    st.text(max_size=30).filter(lambda t: not t.startswith("scheduled-events.envelope/")),
)
_bad_document: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.just({"Events": []}),
    st.fixed_dictionaries({"DocumentIncarnation": _not_an_int}),
    st.fixed_dictionaries({"DocumentIncarnation": st.integers(0, 9), "Events": st.text(max_size=5)}),
)
_bad_kind = st.text(max_size=20).filter(lambda t: t not in ("incarnation", "heartbeat", "hook"))

# Each breaks the envelope's data in one way (the JSON stays well-formed).
_DATA_MUTATIONS: dict[str, Callable[[st.DrawFn, dict[str, Any]], None]] = {
    "drop-top": lambda draw, data: data.pop(draw(st.sampled_from(_REQUIRED_TOP))),
    "drop-vm": lambda draw, data: data["vm"].pop(draw(st.sampled_from(_REQUIRED_VM))),
    "sequence": lambda draw, data: data.update(sequence=draw(st.one_of(st.integers(max_value=-1), _not_an_int))),
    "schema": lambda draw, data: data.update(schema=draw(_bad_schema)),
    "observed-at": lambda draw, data: data.update(observedAt=draw(_bad_time)),
    "kind": lambda draw, data: data.update(kind=draw(_bad_kind)),
    "payload": _payload,
    "document": lambda draw, data: data.update(document=draw(_bad_document)),
    "event": _event_field,
    "oversize": lambda draw, data: data["vm"].update(name="x" * draw(st.integers(min_value=257, max_value=5000))),
}
# Each replaces the bytes themselves.
_BODY_MUTATIONS: dict[str, Callable[[st.DrawFn, bytes], bytes]] = {
    "truncate": lambda draw, body: body[: draw(st.integers(min_value=1, max_value=len(body) - 1))],
    "binary": lambda draw, body: b"\xff\xfe" + draw(st.binary(max_size=64)),
    "not-object": lambda draw, body: json.dumps(
        draw(st.one_of(st.integers(), st.text(max_size=10), st.lists(st.integers(), max_size=3)))
    ).encode(),
    "empty": lambda draw, body: b"",
}


@st.composite
def hostile_message(draw: st.DrawFn, *, base: dict[str, Any], own_key: str, other_keys: list[str]) -> tuple[bytes, str]:
    """(body, partition key): one of many ways to break ``base``; every one must be dead-lettered."""
    data = json.loads(json.dumps(base))
    how = draw(st.sampled_from([*_DATA_MUTATIONS, *_BODY_MUTATIONS, "foreign-key"]))
    if how in _DATA_MUTATIONS:
        _DATA_MUTATIONS[how](draw, data)
    body = json.dumps(data).encode()
    if how in _BODY_MUTATIONS:
        body = _BODY_MUTATIONS[how](draw, body)
    # A valid envelope under another VM's partition key: a VM reports only for itself.
    key = draw(st.sampled_from(other_keys)) if how == "foreign-key" else own_key
    return body, key


def refused(body: bytes, key: str) -> bool:
    """The coordinator's door: the envelope model, and a VM reports only under its own partition key."""
    try:
        envelope = Envelope.from_json_bytes(body)
    except ValueError:
        return True
    return key.lower() != envelope.vm.partition_key
