"""Partition logs: in memory, or append-only files so a restarted emulator still has its events.

An event's offset is the byte position of its record in the partition log (as in the real service, an opaque
increasing number sent as a string); memory and disk modes compute it the same way.
File format, one record after another: ``>I`` length + JSON metadata (sequence number, enqueued time in ms,
partition key), ``>I`` length + the event's AMQP message exactly as the producer encoded it.
"""

from __future__ import annotations

import bisect
import json
import logging
import struct
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proton import Message
from pydantic import BaseModel, ConfigDict

from emulators.eventhubs.addresses import Position, PositionField

_LOG = logging.getLogger("emulators.eventhubs")
_LENGTH = struct.Struct(">I")


class StoredEvent(BaseModel):
    """One event as the emulator keeps it. ``message`` is the AMQP encoding the producer sent (without the
    broker annotations, which are added on delivery)."""

    model_config = ConfigDict(frozen=True)

    hub: str
    partition_id: str
    sequence_number: int
    offset: int
    enqueued_time_ms: int
    partition_key: str | None
    message: bytes

    @property
    def enqueued_time(self) -> datetime:
        return datetime.fromtimestamp(self.enqueued_time_ms / 1000, tz=UTC)

    def decoded(self) -> Message:
        message = Message()
        message.decode(self.message)
        return message

    @property
    def body(self) -> bytes:
        """The data body as bytes (what ``EventData.body_as_str()`` would decode); other bodies as UTF-8 repr."""
        message = self.decoded()  # keep it alive: a binary body is a view into the message's buffer
        body: Any = message.body
        if isinstance(body, bytes | bytearray | memoryview):
            return bytes(body)
        return str(body).encode("utf-8")

    @property
    def properties(self) -> dict[str, Any]:
        return dict(self.decoded().properties or {})


class RejectedTransfer(BaseModel):
    """A transfer the emulator could not accept, set aside with the reason (nothing of it was stored)."""

    model_config = ConfigDict(frozen=True)

    hub: str
    reason: str
    payload: bytes


class PartitionProperties(BaseModel):
    model_config = ConfigDict(frozen=True)

    beginning_sequence_number: int
    last_enqueued_sequence_number: int
    last_enqueued_offset: int
    last_enqueued_time_ms: int
    is_empty: bool


class PartitionLog:
    """The ordered events of one partition. Appends come from the broker thread; reads may come from any."""

    def __init__(self, *, hub: str, partition_id: str, path: Path | None) -> None:
        self.hub = hub
        self.partition_id = partition_id
        self._path = path
        self._lock = threading.Lock()
        self._events: list[StoredEvent] = []
        self._next_offset = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._load(path)

    def _load(self, path: Path) -> None:
        data = path.read_bytes() if path.exists() else b""
        position = 0
        while position < len(data):
            record = self._read_record(data, position)
            if record is None:
                _LOG.warning(
                    "partition log %s: incomplete record at byte %d (of %d) set aside by truncation; "
                    "the events before it are kept",
                    path,
                    position,
                    len(data),
                )
                path.with_suffix(".torn").write_bytes(data[position:])
                with path.open("r+b") as handle:
                    handle.truncate(position)
                break
            event, position = record
            self._events.append(event)
        self._next_offset = position

    def _read_record(self, data: bytes, position: int) -> tuple[StoredEvent, int] | None:
        try:
            (meta_length,) = _LENGTH.unpack_from(data, position)
            meta_end = position + _LENGTH.size + meta_length
            meta = json.loads(data[position + _LENGTH.size : meta_end])
            (message_length,) = _LENGTH.unpack_from(data, meta_end)
            message_end = meta_end + _LENGTH.size + message_length
            if message_end > len(data):
                return None
            event = StoredEvent(
                hub=self.hub,
                partition_id=self.partition_id,
                sequence_number=int(meta["seq"]),
                offset=position,
                enqueued_time_ms=int(meta["t"]),
                partition_key=meta.get("pk"),
                message=data[meta_end + _LENGTH.size : message_end],
            )
        except (struct.error, ValueError, KeyError, TypeError):
            return None
        return event, message_end

    def append(self, messages: Sequence[tuple[bytes, str | None]], *, now_ms: int) -> list[StoredEvent]:
        """Appends a batch atomically (one write); returns the stored events with their numbers."""
        with self._lock:
            last = self._events[-1] if self._events else None
            sequence = last.sequence_number + 1 if last else 0
            # Enqueued time never goes backwards within a partition, so time-based positions stay monotonic.
            enqueued = max(now_ms, last.enqueued_time_ms if last else 0)
            offset = self._next_offset
            records = bytearray()
            stored: list[StoredEvent] = []
            for message, partition_key in messages:
                meta = json.dumps({"seq": sequence, "t": enqueued, "pk": partition_key}).encode("utf-8")
                record = _LENGTH.pack(len(meta)) + meta + _LENGTH.pack(len(message)) + message
                stored.append(
                    StoredEvent(
                        hub=self.hub,
                        partition_id=self.partition_id,
                        sequence_number=sequence,
                        offset=offset,
                        enqueued_time_ms=enqueued,
                        partition_key=partition_key,
                        message=message,
                    )
                )
                records += record
                offset += len(record)
                sequence += 1
            if self._path is not None:
                with self._path.open("ab") as handle:
                    handle.write(records)
            self._events.extend(stored)
            self._next_offset = offset
            return stored

    def snapshot(self) -> list[StoredEvent]:
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def get(self, index: int) -> StoredEvent:
        with self._lock:
            return self._events[index]

    def start_index(self, position: Position) -> int:
        """Index of the first event after ``position``."""
        with self._lock:
            if position.latest:
                return len(self._events)
            keys: list[int]
            if position.field is PositionField.OFFSET:
                keys = [event.offset for event in self._events]
            elif position.field is PositionField.SEQUENCE_NUMBER:
                keys = [event.sequence_number for event in self._events]
            else:
                keys = [event.enqueued_time_ms for event in self._events]
            if position.inclusive:
                return bisect.bisect_left(keys, position.value)
            return bisect.bisect_right(keys, position.value)

    def properties(self) -> PartitionProperties:
        with self._lock:
            if not self._events:
                return PartitionProperties(
                    beginning_sequence_number=0,
                    last_enqueued_sequence_number=-1,
                    last_enqueued_offset=-1,
                    last_enqueued_time_ms=0,
                    is_empty=True,
                )
            first, last = self._events[0], self._events[-1]
            return PartitionProperties(
                beginning_sequence_number=first.sequence_number,
                last_enqueued_sequence_number=last.sequence_number,
                last_enqueued_offset=last.offset,
                last_enqueued_time_ms=last.enqueued_time_ms,
                is_empty=False,
            )


class EventStore:
    """All hubs' partition logs. ``data_dir`` None keeps them in memory."""

    def __init__(self, *, hubs: dict[str, int], data_dir: Path | None) -> None:
        self.created_at_ms = int(datetime.now(tz=UTC).timestamp() * 1000)
        self._hubs: dict[str, list[PartitionLog]] = {}
        for hub, partition_count in hubs.items():
            if partition_count < 1:
                raise ValueError(f"hub {hub!r}: partition count must be at least 1, got {partition_count}")
            self._hubs[hub.lower()] = [
                PartitionLog(
                    hub=hub,
                    partition_id=str(index),
                    path=data_dir / hub.lower() / f"{index}.log" if data_dir is not None else None,
                )
                for index in range(partition_count)
            ]
        self._names = {hub.lower(): hub for hub in hubs}

    def hub_name(self, hub: str) -> str | None:
        """The configured spelling of ``hub`` (entity names are case-insensitive), or None if unknown."""
        return self._names.get(hub.lower())

    def partitions(self, hub: str) -> list[PartitionLog]:
        try:
            return self._hubs[hub.lower()]
        except KeyError:
            raise KeyError(f"no event hub named {hub!r}; configured: {sorted(self._names.values())}") from None

    def partition(self, hub: str, partition_id: str) -> PartitionLog:
        partitions = self.partitions(hub)
        if not partition_id.isdigit() or int(partition_id) >= len(partitions):
            raise KeyError(f"event hub {hub!r} has no partition {partition_id!r} (it has 0..{len(partitions) - 1})")
        return partitions[int(partition_id)]
