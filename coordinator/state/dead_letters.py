"""Dead letters as entities: what a refused message or a set-aside entity keeps (``entities``' limits), in
which partition, in which transactions, and in which order they are read back."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime

from coordinator.state.entities import DEAD_LETTER_BODY, DEAD_LETTER_TEXT, TRANSACTION_LIMIT, Entity
from coordinator.state.store import DeadLetter

# Partitions a day's dead letters are spread over (dead_letter_transactions). 64: Azurite scans a partition to
# insert into it, and a 50,000-envelope storm over 16 took 1.44× a 10,000 one per letter (64: 1.01×, one run each of
# 50,000 rows inserted in transactions of 100); reading a day's letters is one query whatever the count.
DEAD_LETTER_PARTITIONS = 64


def set_aside_letter(entity: Entity, etag: str | None, what: str, reason: str, at: datetime) -> DeadLetter:
    """The dead letter of an entity (or one VM's property) set aside: the reason, and the entity as JSON."""
    body = json.dumps(dict(entity), default=str, sort_keys=True).encode("utf-8")
    return DeadLetter(
        reason=f"state entity {what} set aside: {reason}"[:DEAD_LETTER_TEXT],
        body=body,
        received_at=at,
        source={"entity": what, "etag": etag},
    )


def dead_letter_entity(letter: DeadLetter, shard: int = 0) -> Entity:
    """The reason, the source, the body's first 16 KiB as base64, and the SHA-256 and size that identify the whole
    message, however large it was; in partition ``shard`` of its day (``dead_letter_transactions``)."""
    received = letter.received_at.astimezone(UTC)
    return {
        "PartitionKey": f"{received.strftime('%Y-%m-%d')}-{shard % DEAD_LETTER_PARTITIONS:02d}",
        "RowKey": f"{received.strftime('%H%M%S%f')}-{uuid.uuid4().hex[:12]}",
        "Reason": letter.reason[:DEAD_LETTER_TEXT],
        "Source": json.dumps(letter.source, default=str)[:DEAD_LETTER_TEXT],
        "BodyBase64": base64.b64encode(letter.body[:DEAD_LETTER_BODY]).decode("ascii"),
        "BodyBytes": len(letter.body),
        "BodySha256": hashlib.sha256(letter.body).hexdigest(),
    }


def dead_letter_transactions(
    letters: Sequence[DeadLetter], *, first_shard: int | None = None
) -> Iterator[list[Entity]]:
    """The dead letters' entities in transactions of at most 100, each in one partition of its day: the next
    partition after the transaction before, from a random one (``first_shard`` for a test), so that a storm of
    refused messages (a fleet not yet upgraded, a hostile VM) spreads over the day's partitions as many instances
    write at once, instead of pouring into one (a partition takes about 2,000 operations a second), with no more
    transactions than one partition a day would take."""
    shard = secrets.randbelow(DEAD_LETTER_PARTITIONS) if first_shard is None else first_shard
    by_day: dict[str, list[DeadLetter]] = {}
    for letter in letters:
        by_day.setdefault(letter.received_at.astimezone(UTC).strftime("%Y-%m-%d"), []).append(letter)
    for day in by_day.values():
        for start in range(0, len(day), TRANSACTION_LIMIT):
            yield [dead_letter_entity(letter, shard) for letter in day[start : start + TRANSACTION_LIMIT]]
            shard += 1


def dead_letter_order(entity: Entity) -> tuple[str, str]:
    """Dead letters by day, then arrival (a day's partitions interleave)."""
    return (str(entity["PartitionKey"])[:10], str(entity["RowKey"]))
