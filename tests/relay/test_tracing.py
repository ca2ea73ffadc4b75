"""The listener's spans, over the Relay emulator and the IMDS emulator: an approval request's W3C `traceparent`
header (the coordinator's) makes `listener.approve` a child of it, with `listener.imds_get` and, when IMDS is asked
to start the event, `listener.start_requests` under it; without the header the listener still answers, in a trace
of its own."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from emulators.relay.auth import create_sas_token
from forwarder.approver import Approver
from forwarder.telemetry import Telemetry
from tests.relay.conftest import SEND_KEY, VM_A0, Vm, approval, imds_client, scheduled_event

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def post(relay: RelayEmulator, vm: Vm, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    hc = vm.identity.hybrid_connection_name
    token = create_sas_token(relay.resource_uri(hc), key_name="send", key=SEND_KEY)
    response = requests.post(
        f"{relay.base_url}/{hc}/approve",
        data=body,
        headers={"ServiceBusAuthorization": token, "Content-Type": "application/json", **headers},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.fixture
def traced(imds: ImdsEmulator, start_vm: Callable[..., Vm], tmp_path: Path) -> tuple[Vm, Path]:
    """VM_A0 with its listener up, its approver writing its spans to a file: the VM, and that file."""
    spans_file = tmp_path / "spans.jsonl"
    telemetry = Telemetry(spans_file=spans_file)
    handler = Approver(imds=imds_client(imds, VM_A0), vm_name=VM_A0, tracer=telemetry.tracer)
    return start_vm(VM_A0, auth="sas", handler=handler), spans_file


def spans(path: Path) -> dict[str, list[dict[str, Any]]]:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        span = json.loads(line)
        by_name.setdefault(span["name"], []).append(span)
    return by_name


def assert_children(recorded: dict[str, list[dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    [approve] = recorded["listener.approve"]
    for name in names:
        [child] = recorded[name]
        assert child["traceId"] == approve["traceId"]
        assert child["parentSpanId"] == approve["spanId"]
        assert approve["startTimeUnixNano"] <= child["startTimeUnixNano"] <= child["endTimeUnixNano"]
        assert child["endTimeUnixNano"] <= approve["endTimeUnixNano"]
    return approve


def test_an_approval_joins_the_callers_trace(imds: ImdsEmulator, relay: RelayEmulator, traced: tuple[Vm, Path]) -> None:
    vm, spans_file = traced
    event_id = scheduled_event(imds, VM_A0)
    request = approval(event_id)
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "tracestate": "coordinator=1"}
    assert post(relay, vm, request.model_dump_json().encode(), headers)["outcome"] == "approved"
    assert [a["EventId"] for a in imds.approvals()] == [event_id]

    recorded = spans(spans_file)
    approve = assert_children(recorded, ["listener.imds_get", "listener.start_requests"])
    assert approve["traceId"] == TRACE_ID
    assert approve["parentSpanId"] == CALLER_SPAN
    assert approve["attributes"]["scheduled_events.event_id"] == event_id
    assert approve["attributes"]["scheduled_events.decision_id"] == request.decisionId
    assert approve["attributes"]["scheduled_events.outcome"] == "approved"
    assert recorded["listener.start_requests"][0]["attributes"]["scheduled_events.event_id"] == event_id


def test_without_a_traceparent_the_listener_approves_in_a_trace_of_its_own(
    imds: ImdsEmulator, relay: RelayEmulator, traced: tuple[Vm, Path]
) -> None:
    vm, spans_file = traced
    event_id = scheduled_event(imds, VM_A0)
    assert post(relay, vm, approval(event_id).model_dump_json().encode(), {})["outcome"] == "approved"
    assert [a["EventId"] for a in imds.approvals()] == [event_id]
    approve = assert_children(spans(spans_file), ["listener.imds_get", "listener.start_requests"])
    assert approve["parentSpanId"] == ""
    assert len(approve["traceId"]) == 32
    assert approve["traceId"] != "0" * 32


def test_a_refusal_is_traced_without_a_start_requests_span(
    imds: ImdsEmulator, relay: RelayEmulator, traced: tuple[Vm, Path]
) -> None:
    vm, spans_file = traced
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
    assert post(relay, vm, approval("no-such-event").model_dump_json().encode(), headers)["outcome"] == "not-found"
    recorded = spans(spans_file)
    approve = assert_children(recorded, ["listener.imds_get"])
    assert "listener.start_requests" not in recorded
    assert approve["attributes"]["scheduled_events.outcome"] == "not-found"
    assert imds.approvals() == []
