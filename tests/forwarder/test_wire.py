"""The forwarder's records (contracts/wire.py) are generated from the contracts' pydantic models: the same documents
accepted and refused, the same envelopes written and read, the same reasons given."""

from __future__ import annotations

import json
import re
import string
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from contracts import approval, document, envelope, wire
from contracts.checks import Invalid, Record


def _both(record: type[Record], model: type[BaseModel], data: Any) -> tuple[Any, Any]:
    """What each side makes of ``data``: its JSON form, or "refused"."""
    try:
        ours: Any = record.from_mapping(data).to_mapping()
    except Invalid:
        ours = "refused"
    try:
        theirs: Any = model.model_validate(data).model_dump(mode="json", by_alias=True)
    except ValidationError:
        theirs = "refused"
    return ours, theirs


_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " -:", max_size=140)
_EVENT = st.fixed_dictionaries(
    {
        "EventId": _TEXT,
        "EventType": st.sampled_from(["Reboot", "Redeploy", "Freeze", "Preempt", "Terminate", "", "X" * 65]),
        "EventStatus": st.sampled_from(["Scheduled", "Started", "Canceled"]),
    },
    optional={
        "Resources": st.lists(_TEXT, max_size=3) | st.just("web_0"),
        "NotBefore": st.just("Mon, 19 Sep 2016 18:29:47 GMT") | st.just(""),
        "DurationInSeconds": st.integers(-1, 10**6) | st.just("9") | st.just(1.5),
        "Description": _TEXT,
        "Unknown": st.integers() | _TEXT,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {"DocumentIncarnation": st.integers(0, 2**40) | st.just(None)},
        optional={"Events": st.lists(_EVENT, max_size=3), "Extra": _TEXT},
    )
)
def test_documents_are_accepted_refused_and_kept_alike(data: dict[str, Any]) -> None:
    ours, theirs = _both(wire.ScheduledEventsDocument, document.ScheduledEventsDocument, data)
    assert ours == theirs


_HEARTBEAT = {"kind": "heartbeat", "vm": {"name": "x", "vmId": "y", "resourceId": "z"}, "sequence": 0,
              "observedAt": "2026-11-26T07:00:00Z", "forwarder": "0.1.0"}  # fmt: skip
_HOOK = {"eventId": "A", "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.0}
_LAX_FIELDS: dict[str, tuple[type[Record], type[BaseModel], dict[str, Any], tuple[str, ...]]] = {
    "int": (wire.Envelope, envelope.Envelope, _HEARTBEAT, ("sequence",)),
    "incarnation": (wire.ScheduledEventsDocument, document.ScheduledEventsDocument, {}, ("DocumentIncarnation",)),
    "float": (wire.Envelope, envelope.Envelope, {**_HEARTBEAT, "kind": "hook", "hook": _HOOK},
              ("hook", "durationSeconds")),
    "bool": (wire.Envelope, envelope.Envelope, {**_HEARTBEAT, "health": {}}, ("health", "listenerConnected")),
    "time": (wire.Envelope, envelope.Envelope, _HEARTBEAT, ("observedAt",)),
}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[("int", v) for v in (3.0, -0.0, "3", " 4 ", "4.0", "1_000", "+5", True, 4.5, "4.5", "0x10", "1e3", 1e20)],
        *[("incarnation", v) for v in (3.0, "7", 2**64, None)],
        *[("float", v) for v in (2, 10**400, "1.5", " 2 ", "1e2", "1_0", True, "Infinity", "nan", "0x1")],
        *[("bool", v) for v in (1, 0, 1.0, "true", "YES", "off", "t", "n", 2, 0.5, "2", " true ")],
        *[("time", v) for v in (1764140400, 1764140400.5, 1764140400000, "1764140400", "2026-11-26 07:00:00z",
                                "2026-11-26T07:00Z", "2026-11-26T07:00:00,25+0100", "20261126T070000Z",
                                "2026-W48-4T07:00:00Z", "2026-11-26T07", True)],
    ],
)  # fmt: skip
def test_what_the_models_read_in_json_mode_the_forwarder_reads_alike(field: str, value: Any) -> None:
    """pydantic reads JSON laxly (``3.0`` or ``"3"`` for an int, ``"yes"`` for a bool, a number for a time): what
    the coordinator's model accepts, the VM accepts as the same value; what it refuses, the VM refuses, naming the
    field."""
    record, model, base, path = _LAX_FIELDS[field]
    data = json.loads(json.dumps(base))
    holder = data if len(path) == 1 else data[path[0]]
    holder[path[-1]] = value
    written = json.dumps(data)
    try:
        theirs: Any = model.model_validate_json(written).model_dump(mode="json", by_alias=True)
    except ValidationError:
        with pytest.raises(Invalid, match=rf"^{re.escape('.'.join(path))}: "):
            record.from_json_bytes(written)
        return
    ours = record.from_json_bytes(written).to_mapping()
    assert ours == theirs
    read, written_back = ours, theirs
    for key in path:
        read, written_back = read[key], written_back[key]
    assert type(read) is type(written_back)  # 3, not 3.0


def _vm(**changes: Any) -> wire.VmIdentity:
    values: dict[str, Any] = {
        "name": "web_0",
        "vmId": "0f1e2d3c",
        "resourceId": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/web_0",
        "zone": "2",
        "tags": {"scheduled-events": "manual", "ünïcode": "välue"},
    }
    return wire.VmIdentity(**{**values, **changes})


def _envelopes() -> list[wire.Envelope]:
    observed = datetime(2026, 11, 26, 7, 0, 1, 123456, tzinfo=UTC)
    doc = wire.ScheduledEventsDocument.from_mapping(
        {
            "DocumentIncarnation": 4,
            "Events": [
                {"EventId": "A", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["web_0"], "New": 1}
            ],
            "Future": {"x": [1, 2]},
        }
    )
    steps = [
        wire.HookStep(hook="10-drain", outcome="succeeded", durationSeconds=0.25, exitCode=0),
        wire.HookStep(hook="20-check", outcome="timed-out", durationSeconds=120.0, outputTail="late"),
    ]
    report = wire.HookReport(
        eventId="A", phase="prepare", outcome="timed-out", hook="20-check", durationSeconds=120.25, steps=steps
    )
    health = wire.ForwarderHealth(
        lastGoodPollAt=observed - timedelta(seconds=1),
        pollErrors=3,
        listenerConnected=False,
        stateFullSince=observed.astimezone(timezone(timedelta(hours=2))),
    )
    proof = wire.Attestation(encoding="pkcs7", signature="TUlJQg==")
    common: dict[str, Any] = {"vm": _vm(), "observedAt": observed, "forwarder": "0.1.0", "stateId": "abc.123"}
    return [
        wire.Envelope(kind="incarnation", sequence=1, document=doc, attestation=proof, **common),
        wire.Envelope(kind="hook", sequence=2, hook=report, **common),
        wire.Envelope.from_mapping(
            {"kind": "heartbeat", "sequence": 3, "health": health, "counters": {"polls": 7}, **common}
        ),
    ]


@pytest.mark.parametrize("sent", _envelopes(), ids=lambda e: e.kind)
def test_an_envelope_the_forwarder_writes_is_the_one_the_coordinator_reads(sent: wire.Envelope) -> None:
    """Byte for byte: the coordinator's model reads it and writes the same bytes back (unknown fields kept)."""
    written = sent.to_json_bytes()
    read = envelope.Envelope.from_json_bytes(written)
    assert read.to_json_bytes() == written
    assert read.vm.partition_key == sent.vm.partition_key
    assert read.vm.hybrid_connection_name == sent.vm.hybrid_connection_name


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"kind": "incarnation"}, "needs 'document'"),
        ({"kind": "hook"}, "needs 'hook'"),
        ({"kind": "census"}, "Input should be"),
        ({"schema": "scheduled-events.envelope/2"}, "scheduled-events.envelope/2"),
        ({"schema": "something-else/1"}, "something-else/1"),
        ({"observedAt": "2026-11-26T07:00:00"}, "UTC offset"),
        ({"sequence": -1}, "greater than or equal to 0"),
        ({"stateId": "a/b"}, "should match pattern"),
        ({"vm": {"name": "x", "vmId": "y", "resourceId": "z", "tags": {f"t{i}": "" for i in range(51)}}}, "at most 50"),
        (
            {"vm": {"name": "x", "vmId": "y", "resourceId": "z", "tags": {"t": "v" * 257}}},
            "vm.tags.t: String should have at most 256",
        ),
        (
            {"vm": {"name": "x", "vmId": "y", "resourceId": "z", "tags": {"": "v"}}},
            r"vm.tags..\[key\]: String should have at least 1 ",
        ),
        (
            {"vm": {"name": "x", "vmId": "y", "resourceId": "z", "tags": {"n" * 513: ""}}},
            r"n.\[key\]: String should have at most 512 ",
        ),
    ],
)
def test_what_the_coordinator_refuses_the_forwarder_never_writes(changes: dict[str, Any], needle: str) -> None:
    data = {
        "kind": "heartbeat",
        "vm": _vm().to_mapping(),
        "observedAt": "2026-11-26T07:00:00Z",
        "sequence": 0,
        "forwarder": "0.1.0",
        **changes,
    }
    with pytest.raises(ValidationError):
        envelope.Envelope.from_mapping(data)
    with pytest.raises(Invalid, match=needle):
        wire.Envelope.from_mapping(data)


def test_an_approval_request_the_coordinator_writes_is_read_alike() -> None:
    event = document.ScheduledEvent(
        EventId="A",
        EventType="Reboot",
        EventStatus="Scheduled",
        Resources=["web_0"],
        NotBefore="Mon, 19 Sep 2016 18:29:47 GMT",
    )
    now = datetime(2026, 11, 26, 7, tzinfo=UTC)
    sent = approval.ApprovalRequest(
        eventId="A",
        decisionId="d-1",
        rule="approve-within-budget",
        issuedAt=now,
        expiresAt=now + timedelta(seconds=30),
        notAfter=now + timedelta(seconds=20),
        facts=approval.ApprovalFacts.of(event, hooks_required=["web_0"]),
        policyVersion="abc",
    )
    read = wire.ApprovalRequest.from_json_bytes(sent.model_dump_json())
    assert read.to_mapping() == json.loads(sent.model_dump_json()) | {
        "issuedAt": "2026-11-26T07:00:00Z",
        "expiresAt": "2026-11-26T07:00:30Z",
        "notAfter": "2026-11-26T07:00:20Z",
    }
    assert read.deadline == sent.deadline
    assert read.facts is not None
    assert read.facts.differences(wire.ScheduledEvent.from_mapping(event.model_dump())) == []
    answer = wire.ApprovalResult(outcome="approved", eventId="A", decisionId="d-1", documentIncarnation=3)
    assert approval.ApprovalResult.model_validate_json(answer.to_json_bytes()).model_dump_json().encode() == (
        answer.to_json_bytes()
    )


def test_the_forwarder_process_loads_no_pydantic_and_no_azure_sdk() -> None:
    """What the import rule (pyproject: forwarder-tiny) says, seen in a real interpreter: the daemon's imports and
    the listener's (loaded at its first connect) bring neither in."""
    import subprocess
    import sys

    code = (
        "import sys, forwarder.cli, forwarder.eventhub, forwarder.approver, forwarder.relay_listener;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'pydantic_core', 'azure', 'requests'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("impact", "measuredSeconds"), float("inf"), "impact.measuredSeconds: Input should be a finite number"),
        (("impact", "measuredSeconds"), float("nan"), "impact.measuredSeconds: Input should be a finite number"),
        (("impact", "measuredSeconds"), 1e308, "impact.measuredSeconds: Input should be less than or equal to 604800"),
        (("impact", "wallGapSeconds"), -604_801, "impact.wallGapSeconds: Input should be greater than or equal to"),
        (("impact", "announcedSeconds"), 2**40, "impact.announcedSeconds: Input should be less than or equal to"),
        (("hook", "budgetUsed"), float("inf"), "hook.budgetUsed: Input should be a finite number"),
        (("hook", "durationSeconds"), 604_800.5, "hook.durationSeconds: Input should be less than or equal to"),
    ],
)
def test_seconds_are_finite_and_at_most_a_week_on_both_sides(path: tuple[str, str], value: float, needle: str) -> None:
    """What the coordinator refuses at its door (``Infinity`` was taken, and its row was not JSON), the forwarder
    never writes: both name the field."""
    at = "2026-11-26T07:00:00Z"
    payloads: dict[str, dict[str, Any]] = {
        "impact": {"eventId": "A", "eventType": "Freeze", "measure": "pause", "measuredSeconds": 5.0, "start": at,
                   "end": at},
        "hook": {"eventId": "A", "phase": "prepare", "outcome": "succeeded", "durationSeconds": 1.0},
    }  # fmt: skip
    kind, field = path
    data = {
        "kind": kind,
        "vm": _vm().to_mapping(),
        "observedAt": at,
        "sequence": 0,
        "forwarder": "0.1.0",
        kind: {**payloads[kind], field: value},
    }
    wire.Envelope.from_mapping({**data, kind: payloads[kind]})  # the same report within bounds is taken
    with pytest.raises(ValidationError, match=needle.split(": ", 1)[1]):
        envelope.Envelope.from_mapping(data)
    with pytest.raises(Invalid, match=needle):
        wire.Envelope.from_mapping(data)
