"""The alert outbox: a card is recorded in the same write as its transition, so a process killed between that
write and the send loses nothing: the timer sends it after the grace period, exactly once."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.adapters.teams import FolderCardSink
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.outbox import ALERT_GRACE
from coordinator.service import Coordinator
from coordinator.state.tables import TableStateStore
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from local.direct_callback import DirectImdsCallback
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.runs import make_coordinator


class Killed(BaseException):
    """Stands for the process dying (not an error the coordinator could handle)."""


class KillingSink(FolderCardSink):
    """The real folder sink, except that the process 'dies' on the first send while ``armed``."""

    armed = False

    def send(self, card: dict[str, Any], *, key: str) -> None:
        if self.armed:
            raise Killed(key)
        super().send(card, key=key)


def restart(azurite: AzuriteEndpoints, imds: ImdsEmulator, table: str, cards: Path, clock: Clock) -> Coordinator:
    """A fresh instance: a new store (no cache) and history, as after a crash."""
    return make_coordinator(
        store=TableStateStore.from_connection_string(azurite.connection_string, table_name=table),
        history=MemoryHistory(),
        alerts=KillingSink(cards),
        callback=DirectImdsCallback(base_url=imds.url),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=clock,
    )


def sent(coordinator: Coordinator) -> list[tuple[str, str]]:
    assert isinstance(coordinator.parts.history, MemoryHistory)
    return [
        (r.EventId, r.Action) for r in coordinator.parts.history.rows if r.RecordType == "Alert" and r.Outcome == "sent"
    ]


def reboot(sequence: int, listed: bool) -> RawMessage:
    events = [scheduled_event("EV-OUTBOX", event_type="Reboot", duration=-1)] if listed else []
    data = envelope(vm("WestNO_0", index=1), sequence=sequence, incarnation=sequence, events=events)
    return RawMessage(body=json.dumps(data).encode(), partition_key=data["vm"]["resourceId"].lower())


@pytest.mark.parametrize("kill_at", ["new-event", "canceled"])
def test_a_card_lost_to_a_crash_after_the_write_is_sent_once_by_the_timer(azurite, imds, tmp_path, kill_at):
    table = "outbox" + uuid.uuid4().hex[:12]
    clock = Clock(DOC_NOW)
    cards = tmp_path / "cards"
    first = restart(azurite, imds, table, cards, clock)
    assert isinstance(first.parts.alerts, KillingSink)
    if kill_at == "canceled":
        first.process_batch([reboot(1, listed=True)])
        assert sent(first) == [("EV-OUTBOX", "new-event")]
        clock.now += ALERT_GRACE * 2
        first.tick()  # the batch logged the card as sent: the timer clears it from the outbox and sends nothing
        assert sent(first) == [("EV-OUTBOX", "new-event")]
        stored = first.parts.store.get_event("EV-OUTBOX")
        assert stored is not None
        assert stored.record.pendingAlerts == []
        assert first.parts.store.sent_alert_logs() == []
    first.parts.alerts.armed = True
    with pytest.raises(Killed):
        first.process_batch([reboot(2, listed=kill_at == "new-event")])

    stored = first.parts.store.get_event("EV-OUTBOX")
    assert stored is not None
    assert stored.record.pendingAlerts == [kill_at]  # committed with the transition, not sent
    assert stored.record.state == ("Scheduled" if kill_at == "new-event" else "Canceled")
    cards_before = sorted(p.name for p in cards.glob("*.json"))
    assert f"EV-OUTBOX-{kill_at}.json" not in cards_before

    second = restart(azurite, imds, table, cards, clock)
    clock.now += ALERT_GRACE - timedelta(seconds=1)
    second.tick()  # within the grace the sender may still be at work: nothing yet
    assert sent(second) == []
    clock.now += timedelta(seconds=2)
    second.tick()
    second.tick()
    assert sent(second) == [("EV-OUTBOX", kill_at)]
    assert sorted(p.name for p in cards.glob("*.json")) == sorted([*cards_before, f"EV-OUTBOX-{kill_at}.json"])
    stored = second.parts.store.get_event("EV-OUTBOX")
    assert stored is not None
    assert stored.record.pendingAlerts == []
    assert stored.record.pendingSince is None
