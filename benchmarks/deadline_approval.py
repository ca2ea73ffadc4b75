"""python -m benchmarks.deadline_approval — how long an "approve before NotBefore" approval takes from the timer's
tick to its send: the figure behind the send margin (coordinator/domain/expiry.py, DELIVERY_TIME).

State in Azurite; ``--open`` events (default 500, one per VM) wait for a person, so that every tick re-evaluates them
as a busy fleet's tick would; then, ``--trials`` times, one more VM's Reboot is held by a closed window with
``onNotBefore: approve`` and a tick is run at 100 s before its NotBefore (the coordinator's clock moved there): the
tick decides it at the deadline and delivers it after its other work. Approvals go to the IMDS emulator through
``DirectImdsCallback``; the Relay leg to a VM's listener is measured apart (benchmarks.approval_latency,
benchmarks.cold_listener).

    .venv/bin/python -m benchmarks.deadline_approval [--open 500] [--trials 10]

Prints one JSON object: tick_to_send_ms_p50/max (from the tick's start to the send), send_ms_max (the send itself),
tick_seconds_p50 (the whole tick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import SCHEMA, VmIdentity
from coordinator import (
    Coordinator,
    FolderCardSink,
    Options,
    Parts,
    RawMessage,
    SqliteHistory,
    TableStateStore,
    parse_policy,
)
from emulators.azurite import Azurite
from emulators.imds import ImdsEmulator, Scenario
from local.direct_callback import DirectImdsCallback

POLICY = """
rules:
  - name: at-the-deadline
    match: {eventType: [Reboot]}
    action: approve-now
    window: {schedule: "0 3 1 1 *", duration: 1h}
    onNotBefore: approve
    approveBeforeSeconds: 120
  - {name: people, action: wait-for-person}
"""
NOTICE_SECONDS = 1800
TICK_AT_BEFORE_NOT_BEFORE = timedelta(seconds=100)


class Timed:
    """The approval callback, noting when each send starts and how long it takes."""

    def __init__(self, inner: DirectImdsCallback) -> None:
        self.inner = inner
        self.sends: list[tuple[float, float]] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        started = time.perf_counter()
        result = self.inner.send(request, vm=vm)
        self.sends.append((started, time.perf_counter() - started))
        return result


def report(imds: ImdsEmulator, name: str, sequence: int) -> RawMessage:
    """What the VM's forwarder sends: its identity and its IMDS document."""
    compute = imds.state.vms[name].compute()
    fields = {k: v for k, v in compute.items() if k in VmIdentity.model_fields and k != "tags"}
    identity = VmIdentity.model_validate(fields)
    document = imds.document(name)
    body = {
        "schema": SCHEMA,
        "kind": "incarnation",
        "vm": identity.model_dump(mode="json"),
        "observedAt": datetime.now(UTC).isoformat(),
        "sequence": sequence,
        "forwarder": "bench/1.0",
        "document": document,
    }
    return RawMessage(body=json.dumps(body, default=str).encode(), partition_key=identity.resourceId.lower())


def run(open_events: int, trials: int) -> dict[str, Any]:
    waiting = [f"wait_{i}" for i in range(open_events)]
    deadline = [f"dl_{i}" for i in range(trials)]
    scenario = Scenario.model_validate(
        {"name": "deadline", "vms": [{"name": n, "placementGroupId": f"pg-{n}"} for n in waiting + deadline]}
    )
    offset = [timedelta(0)]
    with tempfile.TemporaryDirectory() as tmp, Azurite() as azurite, ImdsEmulator(scenario=scenario) as imds:
        callback = Timed(DirectImdsCallback(base_url=imds.url))
        parts = Parts(
            store=TableStateStore.from_connection_string(
                azurite.connection_string, table_name="deadline" + uuid.uuid4().hex[:8]
            ),
            history=SqliteHistory(Path(tmp) / "history.sqlite"),
            alerts=FolderCardSink(Path(tmp) / "cards"),
            callback=callback,
            clock=lambda: datetime.now(UTC) + offset[0],
        )
        # The clock is moved up to half an hour ahead: the VMs' last envelopes must still count as recent.
        coordinator = Coordinator(parts, Options(heartbeat_timeout=timedelta(hours=1)), parse_policy(POLICY))
        for name in waiting:
            imds.create_event(EventType="Redeploy", Resources=[name], NoticeSeconds=NOTICE_SECONDS)
        messages = [report(imds, name, 1) for name in waiting]
        for start in range(0, len(messages), 100):
            coordinator.process_batch(messages[start : start + 100])
        coordinator.tick()  # settles the new-event cards, as the fleet's steady state has
        to_send: list[float] = []
        ticks: list[float] = []
        for name in deadline:
            offset[0] = timedelta(0)
            created = imds.create_event(EventType="Reboot", Resources=[name], NoticeSeconds=NOTICE_SECONDS)
            coordinator.process_batch([report(imds, name, 1)])  # held by the window, NotBefore half an hour away
            not_before = parsedate_to_datetime(str(created["NotBefore"]))  # IMDS's RFC 1123
            offset[0] = not_before - TICK_AT_BEFORE_NOT_BEFORE - datetime.now(UTC)
            sends = len(callback.sends)
            started = time.perf_counter()
            coordinator.tick()
            ticks.append(time.perf_counter() - started)
            if len(callback.sends) != sends + 1:
                raise SystemExit(f"the tick sent {len(callback.sends) - sends} approvals, not the one for {name}")
            to_send.append((callback.sends[-1][0] - started) * 1000)
        return {
            "open_events": open_events,
            "trials": trials,
            "tick_to_send_ms_p50": round(statistics.median(to_send), 1),
            "tick_to_send_ms_max": round(max(to_send), 1),
            "send_ms_max": round(max(s for _, s in callback.sends[-trials:]) * 1000, 1),
            "tick_seconds_p50": round(statistics.median(ticks), 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deadline_approval")
    parser.add_argument("--open", type=int, default=500, help="open events every tick re-evaluates")
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(run(args.open, args.trials)))


if __name__ == "__main__":
    main()
