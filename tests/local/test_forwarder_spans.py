"""Local mode records the forwarders' spans where the local collector reads them: one JSON-lines file per VM under
``<work folder>/telemetry``, with each change's detection and send, and the listeners' approvals."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.local.conftest import Runner, compact_scenario


@pytest.mark.slow
def test_each_forwarder_writes_its_spans_to_the_telemetry_folder(run_pipeline: Runner) -> None:
    outcome = run_pipeline(compact_scenario())
    assert outcome.summary.ok, outcome.summary.failures
    telemetry = outcome.stack.workdir / "telemetry"
    files = sorted(path.name for path in telemetry.glob("*.jsonl"))
    assert files == ["spans-spot-0.jsonl", "spans-web_0.jsonl", "spans-web_1.jsonl"]
    spans: list[dict[str, Any]] = []
    for path in telemetry.glob("spans-*.jsonl"):
        vm = path.name.removeprefix("spans-").removesuffix(".jsonl")
        mine = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        detections = [s for s in mine if s["name"] == "forwarder.detect"]
        assert detections, f"{vm} recorded no detection"
        assert {s["attributes"]["vm.name"] for s in detections} == {vm}
        sends = {s["parentSpanId"] for s in mine if s["name"] == "forwarder.send"}
        assert {s["spanId"] for s in detections} <= sends, f"a change of {vm} was never sent"
        spans += mine
    approvals = [s for s in spans if s["name"] == "listener.approve"]
    approved = {s["attributes"]["scheduled_events.event_id"] for s in approvals}
    assert outcome.stack.imds is not None
    assert approved >= {a["EventId"] for a in outcome.stack.imds.approvals()}  # every approval IMDS accepted
    assert {s["attributes"]["scheduled_events.outcome"] for s in approvals} >= {"approved"}
