"""Dead letters as entities (coordinator/state/dead_letters.py): one partition a transaction, spread over the day's."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from coordinator.state.dead_letters import (
    DEAD_LETTER_PARTITIONS,
    dead_letter_entity,
    dead_letter_order,
    dead_letter_transactions,
)
from coordinator.state.store import DeadLetter
from coordinator.state.tables import TableStateStore

NOON = datetime(2026, 11, 29, 12, tzinfo=UTC)


def letters(n: int, at: datetime = NOON) -> list[DeadLetter]:
    return [
        DeadLetter(reason=f"r{i}", body=b"x", received_at=at + timedelta(microseconds=i), source={}) for i in range(n)
    ]


def test_each_transaction_is_one_partition_of_at_most_100_and_the_next_goes_to_the_next_partition() -> None:
    parts = list(dead_letter_transactions(letters(250), first_shard=DEAD_LETTER_PARTITIONS - 1))

    assert [len(part) for part in parts] == [100, 100, 50]
    assert [{e["PartitionKey"] for e in part} for part in parts] == [
        {f"2026-11-29-{DEAD_LETTER_PARTITIONS - 1:02d}"},
        {"2026-11-29-00"},
        {"2026-11-29-01"},
    ]


def test_letters_of_two_days_never_share_a_transaction() -> None:
    parts = list(dead_letter_transactions([*letters(3), *letters(2, NOON + timedelta(days=1))], first_shard=0))

    assert [sorted({str(e["PartitionKey"]) for e in part}) for part in parts] == [["2026-11-29-00"], ["2026-11-30-01"]]


def test_batches_start_at_random_partitions_so_that_a_storm_spreads() -> None:
    firsts = {next(dead_letter_transactions(letters(1)))[0]["PartitionKey"] for _ in range(200)}

    assert len(firsts) >= DEAD_LETTER_PARTITIONS // 2


def test_the_order_is_by_day_then_arrival_whatever_the_partition() -> None:
    late = dead_letter_entity(letters(1, NOON + timedelta(hours=1))[0], shard=0)
    early = dead_letter_entity(letters(1)[0], shard=9)
    tomorrow = dead_letter_entity(letters(1, NOON + timedelta(days=1))[0], shard=0)

    assert sorted([tomorrow, late, early], key=dead_letter_order) == [early, late, tomorrow]


def test_a_transaction_of_dead_letters_sent_again_after_it_landed_is_taken_as_written(azurite, monkeypatch) -> None:
    """Inserted, not upserted: the same transaction again (an attempt whose answer was lost) meets its own rows,
    which is no failure, and writes nothing twice."""
    store = TableStateStore.from_connection_string(azurite.connection_string, table_name=f"dl{uuid.uuid4().hex[:8]}")
    same = uuid.UUID(int=7)
    monkeypatch.setattr("coordinator.state.dead_letters.uuid.uuid4", lambda: same)
    monkeypatch.setattr("coordinator.state.dead_letters.secrets.randbelow", lambda _: 3)
    store.put_dead_letters(letters(1))
    store.put_dead_letters(letters(1))

    assert [row["Reason"] for row in store.dead_letters()] == ["r0"]
