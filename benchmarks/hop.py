"""The coordinator's hop: from an Event Hubs batch reaching it to the approval leaving, beside one conditional write.

    .venv/bin/python -m benchmarks.hop [--n 300]

Known VMs (their positions stored) each report one new event in a batch of one envelope; the policy approves at
once; the hop ends when the coordinator calls its approval callback (a stand-in that answers "approved" at once: the
Relay round trip is benchmarks/approval_latency.py's). State in Azurite, history in SQLite, cards in a folder, as in the
wave. Between two hops, one conditional write (an If-Match update of a small entity whose ETag is known, what the
deciding write is) is timed on the same table: the floor of a hop that writes its decision before it sends.

Prints one JSON object: hop_ms_p50/p99, conditional_write_ms_p50/p99, hop_over_conditional_write (p50 ÷ p50;
target ≤ 2.5: before the approval path was rebuilt it was 12-14), hop_table_requests (Table requests a hop makes
before its approval leaves).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from azure.core import MatchConditions
from azure.data.tables import UpdateMode

from benchmarks.approval_latency import percentile
from benchmarks.table_ops import CountingTable, Ops
from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import SCHEMA, VmIdentity
from coordinator.adapters.history import SqliteHistory
from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from coordinator.state.tables import TableStateStore
from emulators.azurite import Azurite

POLICY = parse_policy("version: 1\nrules:\n  - {name: approve-everything, match: {}, action: approve-now}\n")


def vm(index: int) -> dict[str, str]:
    return {
        "name": f"hop_{index}",
        "vmId": f"00000000-0000-4000-8000-{index:012d}",
        "resourceId": (
            "/subscriptions/00000000-0000-0000-0000-000000000001/resourceGroups/rg-hop/providers/"
            f"Microsoft.Compute/virtualMachineScaleSets/hop/virtualMachines/{index}"
        ),
        "vmScaleSetName": "hop",
        "placementGroupId": f"pg-hop-{index // 20}",
        "location": "westeurope",
    }


class Stopwatch:
    """The approval callback: notes when the coordinator hands it an approval, answers "approved" at once."""

    def __init__(self, ops: Ops) -> None:
        self.called_at = 0.0
        self.requests_before = 0
        self._ops = ops

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.called_at = time.perf_counter()
        self.requests_before = self._ops.requests
        return ApprovalResult(outcome="approved", eventId=request.eventId, decisionId=request.decisionId)


def envelope(index: int, sequence: int, events: list[dict[str, Any]], now: datetime) -> RawMessage:
    identity = vm(index)
    data = {
        "schema": SCHEMA,
        "kind": "incarnation",
        "vm": identity,
        "observedAt": now.isoformat(),
        "sequence": sequence,
        "forwarder": "hop/1.0",
        "document": {"DocumentIncarnation": sequence, "Events": events},
    }
    return RawMessage(body=json.dumps(data).encode(), partition_key=identity["resourceId"].lower())


def event(index: int, now: datetime) -> dict[str, Any]:
    return {
        "EventId": f"00000000-0000-4000-8000-{index:012d}",
        "EventType": "Freeze",
        "ResourceType": "VirtualMachine",
        "Resources": [f"hop_{index}"],
        "EventStatus": "Scheduled",
        "NotBefore": (now + timedelta(minutes=15)).strftime("%a, %d %b %Y %H:%M:%S GMT"),
        "Description": "benchmark",
        "EventSource": "Platform",
        "DurationInSeconds": 5,
    }


def run(n: int) -> dict[str, Any]:
    hops: list[float] = []
    writes: list[float] = []
    ops = Ops()
    with tempfile.TemporaryDirectory() as tmp, Azurite() as azurite:
        store = TableStateStore.from_connection_string(azurite.connection_string, table_name="hop")
        table = store._table
        store._table = CountingTable(table, ops)  # type: ignore[assignment]
        stopwatch = Stopwatch(ops)
        now = datetime.now(UTC)
        coordinator = Coordinator(
            store=store,
            history=SqliteHistory(Path(tmp) / "history.sqlite"),
            alerts=FolderCardSink(Path(tmp) / "cards"),
            callback=stopwatch,
            policy=POLICY,
            clock=lambda: now,
        )
        for first in range(0, n, 100):  # the VMs are known: their positions are stored
            coordinator.process_batch([envelope(i, 1, [], now) for i in range(first, min(n, first + 100))])
        probe = table.create_entity({"PartitionKey": "probe", "RowKey": "write", "Value": 0})
        etag = probe["etag"]
        requests = 0
        for index in range(n):
            now = datetime.now(UTC)
            ops.requests = 0
            started = time.perf_counter()
            coordinator.process_batch([envelope(index, 2, [event(index, now)], now)])
            hops.append((stopwatch.called_at - started) * 1000)
            requests += stopwatch.requests_before
            write_started = time.perf_counter()
            result = table.update_entity(
                {"PartitionKey": "probe", "RowKey": "write", "Value": index},
                mode=UpdateMode.REPLACE,
                etag=etag,
                match_condition=MatchConditions.IfNotModified,
            )
            writes.append((time.perf_counter() - write_started) * 1000)
            etag = result["etag"]
    hop_p50, write_p50 = percentile(hops, 0.5), percentile(writes, 0.5)
    return {
        "hop_ms_p50": round(hop_p50, 2),
        "hop_ms_p99": round(percentile(hops, 0.99), 2),
        "conditional_write_ms_p50": round(write_p50, 2),
        "conditional_write_ms_p99": round(percentile(writes, 0.99), 2),
        "hop_over_conditional_write": round(hop_p50 / write_p50, 2),
        "hop_table_requests": round(requests / n, 2),
        "n": n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hop", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="hops to time (default 300)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
