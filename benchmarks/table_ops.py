"""Counts the coordinator's Table operations per partition per second, and records its writes to replay them raw.

Azure Table Storage targets about 2,000 entity operations per second per partition (a read of N entities by a query
is N operations, an entity group transaction of N entities is N): ``CountingTable`` wraps the store's ``TableClient``
and counts each entity read or written under its PartitionKey and the wall-clock second it happened in, so a benchmark
can print the busiest partition's rate. ``replay`` sends the same writes again, straight through the SDK, with none
of the coordinator's logic: the floor a wave's time is compared with.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from azure.data.tables import TableClient


@dataclass
class Ops:
    """Entity operations by (partition kind, second), and the writes made (for ``replay``)."""

    per_second: Counter[tuple[str, int]] = field(default_factory=Counter)
    reads: int = 0
    writes: int = 0
    requests: int = 0
    recorded: list[tuple[str, Any]] = field(default_factory=list)
    record: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, partitions: list[str], *, write: bool) -> None:
        second = int(time.time())
        with self.lock:
            self.requests += 1
            for partition in partitions:
                self.per_second[(partition, second)] += 1
            if write:
                self.writes += len(partitions)
            else:
                self.reads += len(partitions)

    def busiest(self, *, since: int = 0) -> dict[str, Any]:
        """The partition and second (from ``since``, a wall-clock second) with the most entity operations."""
        counts = Counter({key: n for key, n in self.per_second.items() if key[1] >= since})
        if not counts:
            return {"busiest_partition": None, "busiest_partition_ops_per_s": 0}
        (partition, _), ops = counts.most_common(1)[0]
        return {"busiest_partition": partition, "busiest_partition_ops_per_s": ops}

    def summary(self) -> dict[str, Any]:
        by_kind: Counter[str] = Counter()
        for (partition, _), ops in self.per_second.items():
            by_kind[partition.split("-")[0]] += ops  # event-2, vmgroup-0, budget, claim-…: where a wave's cost goes
        return {
            **self.busiest(),
            "table_partitions": len({p for p, _ in self.per_second}),
            "table_entity_reads": self.reads,
            "table_entity_writes": self.writes,
            "table_requests": self.requests,
            "table_entity_ops_by_partition_kind": dict(sorted(by_kind.items())),
        }


class CountingTable:
    """A ``TableClient`` that counts what goes through it (and records writes when ``ops.record``)."""

    def __init__(self, table: TableClient, ops: Ops) -> None:
        self._table = table
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)

    def _write(self, kind: str, payload: Any, partitions: list[str]) -> None:
        self._ops.count(partitions, write=True)
        if self._ops.record:
            with self._ops.lock:
                self._ops.recorded.append((kind, payload))

    def create_entity(self, entity: Any, **kwargs: Any) -> Any:
        result = self._table.create_entity(entity, **kwargs)
        self._write("create", dict(entity), [str(entity["PartitionKey"])])
        return result

    def update_entity(self, entity: Any, **kwargs: Any) -> Any:
        result = self._table.update_entity(entity, **kwargs)
        self._write("update", (dict(entity), kwargs.get("mode")), [str(entity["PartitionKey"])])
        return result

    def upsert_entity(self, entity: Any, **kwargs: Any) -> Any:
        result = self._table.upsert_entity(entity, **kwargs)
        self._write("upsert", (dict(entity), kwargs.get("mode")), [str(entity["PartitionKey"])])
        return result

    def delete_entity(self, *args: Any, **kwargs: Any) -> Any:
        result = self._table.delete_entity(*args, **kwargs)
        self._ops.count([str(args[0]) if args else str(kwargs.get("partition_key"))], write=True)
        return result

    def get_entity(self, partition_key: str, row_key: str, **kwargs: Any) -> Any:
        result = self._table.get_entity(partition_key, row_key, **kwargs)
        self._ops.count([partition_key], write=False)
        return result

    def submit_transaction(self, operations: Any, **kwargs: Any) -> Any:
        operations = list(operations)
        result = self._table.submit_transaction(operations, **kwargs)
        self._write("transaction", operations, [str(op[1]["PartitionKey"]) for op in operations])
        return result

    def query_entities(self, query_filter: str, **kwargs: Any) -> Iterator[Any]:
        ops = self._ops

        def counted() -> Iterator[Any]:
            found = []
            for entity in self._table.query_entities(query_filter, **kwargs):
                found.append(str(entity["PartitionKey"]))
                yield entity
            ops.count(found, write=False)

        return counted()

    def list_entities(self, **kwargs: Any) -> Iterator[Any]:
        return self.query_entities("PartitionKey ne ''", **kwargs)


def replay(table: TableClient, recorded: list[tuple[str, Any]]) -> float:
    """Sends the recorded writes again (unconditionally: the same entities, the same grouping into transactions,
    no ETags to check against a table they were not read from) and returns the seconds it took."""
    started = time.perf_counter()
    for kind, payload in recorded:
        if kind == "create":
            table.upsert_entity(payload)
        elif kind in ("update", "upsert"):
            entity, mode = payload
            table.upsert_entity(entity, **({"mode": mode} if mode is not None else {}))
        else:
            operations = []
            for op in payload:
                if op[0] in ("create", "update", "upsert"):
                    options = op[2] if len(op) > 2 else {}
                    mode = options.get("mode") if isinstance(options, dict) else None
                    operations.append(("upsert", op[1], {"mode": mode}) if mode is not None else ("upsert", op[1]))
                else:
                    operations.append(op)
            table.submit_transaction(operations)
    return time.perf_counter() - started
