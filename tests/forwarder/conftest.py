"""Fixtures for the forwarder tests: a real IMDS emulator on a free loopback port and an in-process forwarder
that writes its envelopes to a JSON-lines file (the dry-run sink, a real one)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from forwarder.config import ForwarderSettings
from forwarder.daemon import CompanionFactory, Forwarder
from forwarder.durable_state import Store
from forwarder.imds import ImdsClient
from forwarder.retry import RateLimiter
from forwarder.sinks import JsonLinesSink, Sink
from tests.loopback import QuietHandler
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
THREE_VMS = Scenario(
    name="three",
    vms=[
        VmSpec(name="web_0", vmScaleSetName="web", placementGroupId="pg-1", platformFaultDomain="0"),
        VmSpec(name="web_1", vmScaleSetName="web", placementGroupId="pg-1", platformFaultDomain="1"),
        VmSpec(name="web_2", vmScaleSetName="web", placementGroupId="pg-1", platformFaultDomain="2"),
    ],
)


# The forwarders' hub in the Event Hubs emulator of the ``eventhubs`` fixture.
HUB = "scheduled-events"


@pytest.fixture
def eventhubs() -> Iterator[EventHubsEmulator]:
    """The Event Hubs emulator with the forwarders' hub (HUB, 4 partitions)."""
    with EventHubsEmulator(hubs={HUB: 4}) as emulator:
        yield emulator


def hub_envelopes(eventhubs: EventHubsEmulator) -> list[dict[str, Any]]:
    """Every envelope the hub holds, as the emulator lists its events."""
    return [json.loads(event.body) for event in eventhubs.all_events(HUB)]


def read_envelopes(path: Path) -> list[dict[str, Any]]:
    """The envelopes of a jsonl sink's file: whole lines only, as a tail reads a file another process appends to."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


@contextmanager
def forwarder_importing(imds: ImdsEmulator, home: Path, **env: str) -> Iterator[Path]:
    """A real `python -X importtime -m forwarder run` for web_0 (a jsonl sink in ``home``, polling every 0.1 s, none of
    this process's SE_FORWARDER_* settings), from when it has forwarded the first document: yields its import log
    (its stderr), which grows while it runs; SIGTERM at the end, on which it must exit 0."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SE_FORWARDER_")}
    output = home / "envelopes.jsonl"
    environment.update(
        SE_FORWARDER_IMDS_URL=imds.url_for("web_0"),
        SE_FORWARDER_SINK="jsonl",
        SE_FORWARDER_JSONL_PATH=str(output),
        SE_FORWARDER_STATE_DIR=str(home / "state"),
        SE_FORWARDER_HOOKS_DIR=str(home / "hooks"),
        SE_FORWARDER_POLL_INTERVAL="0.1",
        **env,
    )
    home.mkdir(parents=True, exist_ok=True)
    log = home / "stderr.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "forwarder", "run"], cwd=ROOT, env=environment, stderr=stderr
        )
        try:
            wait_for(lambda: output.exists() and b'"incarnation"' in output.read_bytes(), timeout=30, what="a poll")
            yield log
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) == 0


class Harness:
    """One forwarder in a thread, polling fast; the test limiter lets it exceed IMDS's real 4/s budget."""

    def __init__(
        self,
        *,
        imds_url: str,
        root: Path,
        sink: Sink | None = None,
        limiter: RateLimiter | None = None,
        companions: CompanionFactory | None = None,
        **overrides: Any,
    ) -> None:
        self.root = root
        self.output = root / "envelopes.jsonl"
        values: dict[str, Any] = {
            "imds_url": imds_url,
            "poll_interval": 0.05,
            "imds_timeout": 2.0,
            "imds_first_call_timeout": 5.0,
            "state_dir": root / "state",
            "sink": "jsonl",
            "jsonl_path": self.output,
            "hooks_dir": root / "hooks",
            "hook_timeout": 5.0,
            "heartbeat_interval": 3600,
        }
        values.update(overrides)
        self.settings = ForwarderSettings.from_mapping(values)
        self.imds = ImdsClient(
            base_url=self.settings.imds_url,
            timeout=self.settings.imds_timeout,
            first_call_timeout=self.settings.imds_first_call_timeout,
            limiter=limiter or RateLimiter(requests=500),
        )
        self.store = Store(self.settings.spool_path, max_entries=self.settings.spool_max_entries)
        self.sink = sink or JsonLinesSink(path=self.output)
        self.forwarder = Forwarder(
            settings=self.settings, imds=self.imds, store=self.store, sink=self.sink, companions=companions
        )
        self._thread = threading.Thread(target=self.forwarder.run, daemon=True)

    def start(self) -> Harness:
        self._thread.start()
        wait_for(lambda: self.forwarder.identity is not None, what="the forwarder's identity")
        return self

    def stop(self) -> None:
        self.forwarder.stop()
        self._thread.join(15)
        assert not self._thread.is_alive(), "the forwarder did not stop"

    def envelopes(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_envelopes(self.output) if kind is None or e["kind"] == kind]

    def incarnations(self) -> list[int]:
        return [e["document"]["DocumentIncarnation"] for e in self.envelopes("incarnation")]

    def wait_incarnation(self, incarnation: int, *, timeout: float = 10.0) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next(
                (e for e in self.envelopes("incarnation") if e["document"]["DocumentIncarnation"] == incarnation), None
            )

        envelope: dict[str, Any] = wait_for(found, timeout=timeout, what=f"an envelope for incarnation {incarnation}")
        return envelope


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    # No throttling: these tests poll 20 times a second; the throttle has its own test.
    emulator = ImdsEmulator(scenario=THREE_VMS, throttle_rps=0)
    emulator.start()
    yield emulator
    emulator.stop()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    started: list[Harness] = []

    def make(imds_url: str, *, name: str = "vm", **overrides: Any) -> Harness:
        h = Harness(imds_url=imds_url, root=tmp_path / name, **overrides)
        started.append(h)
        return h.start()

    yield make
    for h in started:
        if h.forwarder.identity is not None and not h.forwarder.stopping:
            h.stop()


def write_hook(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + script, encoding="utf-8")
    path.chmod(0o755)
    return path


class ScriptedImds:
    """A tiny IMDS on loopback that serves whatever document bytes the test sets, for shapes the emulator does not
    produce (Microsoft's public mock server's, invalid events). Identity: web_0 of scale set "web"."""

    COMPUTE: ClassVar[dict[str, str]] = {
        "name": "web_0",
        "vmId": "00000000-0000-0000-0000-0000000000a0",
        "resourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachineScaleSets/web/"
        "virtualMachines/0",
        "vmScaleSetName": "web",
    }

    def __init__(self) -> None:
        self.document = b'{"DocumentIncarnation": 1, "Events": []}'
        scripted = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.headers.get("Metadata") != "true":
                    self.respond(400, b'{"error": "Metadata header required"}')
                elif self.path.startswith("/metadata/instance/compute"):
                    self.respond(200, json.dumps(ScriptedImds.COMPUTE).encode())
                elif self.path.startswith("/metadata/scheduledevents"):
                    self.respond(200, scripted.document)
                else:
                    self.respond(404, b"{}")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def serve(self, incarnation: int, *events: dict[str, Any]) -> None:
        self.document = json.dumps({"DocumentIncarnation": incarnation, "Events": list(events)}).encode()

    def start(self) -> ScriptedImds:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def scripted_imds() -> Iterator[ScriptedImds]:
    server = ScriptedImds().start()
    yield server
    server.stop()


class FullDisk:
    """Stands for the store's SQLite connection on a file system with no room: while ``full``, every statement that
    writes raises SQLite's own error for it ("database or disk is full", SQLITE_FULL); reads go through."""

    WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "ALTER", "CREATE")

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.full = False

    def _check(self, sql: str) -> None:
        if self.full and sql.lstrip().split(None, 1)[0].upper() in self.WRITES:
            raise sqlite3.OperationalError("database or disk is full")

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self.db.executemany(sql, *args)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def close(self) -> None:
        self.db.close()


def fill_disk(store: Store) -> FullDisk:
    """Puts ``store`` on a full disk (``.full = False`` makes room again)."""
    disk = FullDisk(store._db)
    store._db = disk  # type: ignore[assignment]
    disk.full = True
    return disk
