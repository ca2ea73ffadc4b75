"""Fixtures: the function app wired to Azurite (state), SQLite (history), a cards folder and the IMDS emulator
(approvals through DirectImdsCallback), each test with its own table; and, for the fast stage tests, a run's parts
on the in-memory store (``bench``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests.sessions

from coordinator.adapters.history import SqliteHistory
from coordinator.service import Coordinator
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from local.direct_callback import direct_coordinator
from tests.coordinator.helpers import DOC_NOW, WEB_FLEET, web_vms
from tests.coordinator.runs import Bench, imds_serving


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture(scope="session")
def imds() -> Iterator[ImdsEmulator]:
    vms = [{"name": name, "placementGroupId": "avset-westno"} for name in ("WestNO_0", "WestNO_1")]
    with imds_serving("coordinator-tests", vms) as emulator:
        yield emulator


@dataclass
class App:
    module: ModuleType
    clock: Clock
    table: str
    history_path: Path
    cards: Path
    imds: ImdsEmulator

    @property
    def coordinator(self) -> Coordinator:
        coordinator: Coordinator = self.module.coordinator()
        return coordinator

    def history(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        store = SqliteHistory(self.history_path)
        try:
            return store.query(sql, params)
        finally:
            store.close()

    def approvals(self, event_id: str) -> list[dict[str, Any]]:
        return [a for a in self.imds.approvals() if a["EventId"] == event_id]

    def card_files(self) -> list[str]:
        return sorted(p.name for p in self.cards.glob("*.json"))


@pytest.fixture
def app(
    azurite: AzuriteEndpoints, imds: ImdsEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[App]:
    import function_app

    table = "t" + uuid.uuid4().hex[:16]
    env = {
        "COORDINATOR_STORAGE_CONNECTION_STRING": azurite.connection_string,
        "COORDINATOR_STATE_TABLE": table,
        "COORDINATOR_HISTORY_SQLITE_PATH": str(tmp_path / "history.sqlite"),
        "COORDINATOR_CARDS_FOLDER": str(tmp_path / "cards"),
        "COORDINATOR_PUBLIC_BASE_URL": "http://127.0.0.1:7071",
        "COORDINATOR_HEARTBEAT_TIMEOUT_SECONDS": "300",
        # The function app's plumbing with hand-made envelopes, dated 2022: no attested documents (the attested
        # path has its own tests, test_attestation.py and tests/local).
        "COORDINATOR_REQUIRE_ATTESTATION": "false",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(function_app, "coordinator", direct_coordinator(function_app.settings, imds.url))
    function_app.settings.cache_clear()
    function_app.coordinator.cache_clear()
    clock = Clock(DOC_NOW)
    function_app.coordinator().parts = replace(function_app.coordinator().parts, clock=clock)
    yield App(function_app, clock, table, tmp_path / "history.sqlite", tmp_path / "cards", imds)
    function_app.settings.cache_clear()
    function_app.coordinator.cache_clear()


@pytest.fixture  # one fleet per test: an approved Terminate removes its VM from the emulator for good
def fleet_imds() -> Iterator[ImdsEmulator]:
    with imds_serving("coordinator-deletes", web_vms(*WEB_FLEET), clock=None) as emulator:
        yield emulator


@pytest.fixture
def bench() -> Iterator[Bench]:
    """A run's parts on the in-memory store, with stand-ins for the approval path and the card sink
    (tests/coordinator/runs.py); its approval threads are joined at the end."""
    parts = Bench()
    yield parts
    parts.close()


@pytest.fixture
def environment_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs ``requests`` looked the environment's proxies up for, from now on (coordinator/adapters/deadline.py
    reads them once per host)."""
    looked: list[str] = []
    real = requests.sessions.get_environ_proxies

    def counting(url: str, no_proxy: str | None = None) -> dict[str, str]:
        looked.append(url)
        return real(url, no_proxy=no_proxy)

    monkeypatch.setattr(requests.sessions, "get_environ_proxies", counting)
    return looked
