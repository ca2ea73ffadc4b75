"""A slow read of ARM's census holds no batch beyond its bound (coordinator/adapters/census.py): the read runs on a
thread of its own, a run waits for it ``REREAD_WAIT`` at most for the VMs it does not list (``FIRST_READ_WAIT`` while
there is no census), in all however many of its envelopes ask, and the read lands for the runs after.

Measured before: a batch meeting a VM the census did not list read ARM on its own thread, every page of every list,
with no bound on the read as a whole (each page only within its call's 20 s deadline, a throttled ARM's Retry-After
slept): a scale-out's first batch waited for the whole fleet's read, and its Event Hubs partition with it. Here
ARM's read blocks until the test lets it go: each test failed by hanging until the reader's own timeout.

Fast: the in-memory store, documents signed in-process by the IMDS emulator's signer, a coordinator that requires
them; ARM's lists from a stub reader (``HeldArm``) for the pipeline's tests and from the IMDS emulator's ARM face
(real HTTP, ARM's 429 and Retry-After, the ARM pipeline's retries) for the adapter's.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.attestation import state_nonce
from coordinator.adapters import census as census_module
from coordinator.adapters.census import Census
from coordinator.domain.attestation import Attestations
from coordinator.domain.census import CensusEntry
from coordinator.domain.controls import VmFacts
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from emulators.imds import ImdsEmulator
from tests.coordinator.attested import DOCUMENTS, verifier
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import folder_coordinator, imds_serving
from tests.coordinator.test_census import GROUP, SUBSCRIPTION, reader
from tests.coordinator.test_names import Listeners

WEB = [vm(f"web_{n}", index=n + 1, group="pg-web", scale_set="web") for n in range(8)]
# How long a held read stays held when no test lets it go: a test that waits for it fails by this much.
HELD_FOR = 20.0


def entry(identity: dict[str, Any]) -> CensusEntry:
    return CensusEntry(
        name=identity["name"],
        vmId=identity["vmId"],
        resourceId=identity["resourceId"],
        facts=VmFacts(scaleSet="web", placementGroup="pg-web", location="norwayeast"),
    )


class HeldArm:
    """ARM's lists as the census reads them (``listed``); every read after the first ``free`` is held until the
    test lets it go, as a throttled ARM or a large fleet's pages hold a read."""

    scopes = ("/subscriptions/s/resourceGroups/rg-fleet",)

    def __init__(self, listed: list[dict[str, Any]], *, free: int = 1) -> None:
        self.listed, self.free, self.reads = list(listed), free, 0
        self.go, self.done = threading.Event(), threading.Event()

    def read(self) -> list[CensusEntry]:
        self.reads += 1
        if self.reads > self.free:
            self.go.wait(HELD_FOR)
        entries = [entry(identity) for identity in self.listed]
        if self.reads > self.free:
            self.done.set()
        return entries


class Clock:
    def __init__(self) -> None:
        self.now = DOC_NOW

    def __call__(self) -> datetime:
        return self.now


class Run:
    def __init__(self, tmp_path: Path, arm: HeldArm, *, policy: str | None = None) -> None:
        self.store, self.history, self.listeners, self.clock = MemoryStateStore(), MemoryHistory(), Listeners(), Clock()
        self.arm, self.census = arm, Census(arm)
        self.coordinator: Coordinator = folder_coordinator(
            tmp_path / "cards",
            store=self.store,
            history=self.history,
            callback=self.listeners,
            clock=self.clock,
            attestations=Attestations(verifier()),
            require_attestation=True,
            census=self.census,
            policy=parse_policy(policy) if policy is not None else None,
        )

    def batch(self, *identities: dict[str, Any]) -> float:
        """One batch of one envelope per VM, each reporting a 5 s Freeze of itself (the default policy approves it
        at once); the seconds the batch took to return."""
        messages = []
        for identity in identities:
            state = hashlib.sha256(str(identity["vmId"]).encode()).hexdigest()
            event = scheduled_event(f"EV-{identity['name']}", resources=[identity["name"]], duration=5)
            data = envelope(identity, sequence=1, incarnation=1, events=[event])
            data["stateId"] = state
            data["attestation"] = DOCUMENTS.document(identity, nonce=state_nonce(state), now=DOC_NOW)
            body = json.dumps(data).encode()
            messages.append(RawMessage(body=body, partition_key=str(identity["resourceId"]).lower()))
        started = time.monotonic()
        self.coordinator.process_batch(messages)
        return time.monotonic() - started

    def approved(self) -> set[str]:
        return {name for _, name, _ in self.listeners.sent}


@pytest.fixture
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's bounds, shortened so that a test waits them out in about a second."""
    monkeypatch.setattr(census_module, "REREAD_WAIT", timedelta(seconds=0.5))
    monkeypatch.setattr(census_module, "FIRST_READ_WAIT", timedelta(seconds=1))


def test_a_batch_meeting_new_vms_while_arm_is_slow_waits_its_bound_once_and_the_read_lands_after(
    tmp_path: Path, short_waits: None
) -> None:
    """web_0 and web_1 are listed; six VMs of a scale-out report at once while ARM's read is held. The batch waits
    for it once (0.5 s here, not once per envelope: 3 s), returns with the read still held, and decides the new VMs'
    events on their attested vmIds and bindings, as for any VM the census does not list. The read lands behind
    it; the next run finds the new VMs listed without reading again."""
    arm = HeldArm(WEB[:2])
    run = Run(tmp_path, arm)
    run.batch(WEB[0])
    assert arm.reads == 1
    assert run.approved() == {"web_0"}

    run.clock.now = DOC_NOW + timedelta(minutes=1)  # past the census' 30 s between reads
    arm.listed = WEB
    took = run.batch(*WEB[2:])

    assert not arm.done.is_set(), "the batch returned while ARM's read was still held"
    assert took < 6 * 0.5, f"waited {took:.2f} s: once per envelope"
    assert arm.reads == 2, "one read for the batch's six new VMs"
    assert run.approved() == {"web_0", *(identity["name"] for identity in WEB[2:])}
    assert run.store.dead_letters() == []

    arm.go.set()
    assert arm.done.wait(5)
    deadline = time.monotonic() + 5
    while run.census.at(run.clock.now).entry("web_7") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.census.at(run.clock.now).entry("web_7") is not None, "the held read landed for the runs after it"
    run.batch(WEB[1])
    assert arm.reads == 2, "web_1 was listed: no read"


def test_a_first_read_that_is_held_holds_the_batch_for_its_bound_only(tmp_path: Path, short_waits: None) -> None:
    """No census yet and ARM's first read held: the batch waits for it 1 s here (``FIRST_READ_WAIT``, 10 s as
    shipped), then goes on without it: its VMs are what they are without a census (bound by their attested
    vmIds) and the Freezes (the default policy needs no census) approved. The census is usable once the read
    lands."""
    arm = HeldArm(WEB[:2], free=0)
    run = Run(tmp_path, arm)

    run.batch(WEB[0], WEB[1])

    assert not arm.done.is_set(), "the batch returned while ARM's first read was still held"
    assert run.approved() == {"web_0", "web_1"}
    assert not run.census.at(run.clock.now).usable()
    arm.go.set()
    assert arm.done.wait(5)
    deadline = time.monotonic() + 5
    while not run.census.at(run.clock.now).usable() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.census.at(run.clock.now).usable()
    assert arm.reads == 1


BY_SCALE_SET = """
version: 1
rules:
  - name: web-freezes
    match: {scaleSet: [web], eventType: [Freeze]}
    action: approve-now
"""


def test_what_a_batch_decided_without_its_first_read_is_decided_again_once_it_lands(
    tmp_path: Path, short_waits: None
) -> None:
    """A policy by scale set (ARM's), no census yet, its first read held past the batch's wait (1 s here): web_0's
    Freeze is decided without it (no rule matches a VM the census does not list yet: a person). The read lands
    0.5 s later, and the batch's tail decides it again from then: approved, not at the timer's next tick."""
    arm = HeldArm(WEB[:2], free=0)
    run = Run(tmp_path, arm, policy=BY_SCALE_SET)
    threading.Timer(1.5, arm.go.set).start()

    run.batch(WEB[0])
    run.coordinator.drain(10)

    assert arm.done.is_set()
    assert run.approved() == {"web_0"}
    rules = [row.Rule for row in run.history.rows if row.RecordType == "Decision"]
    assert rules == ["(no rule matched)", "web-freezes"]


def test_the_timer_does_not_wait_for_a_held_read_beyond_its_bound(tmp_path: Path, short_waits: None) -> None:
    """The timer asks for its read every 5 minutes; with ARM's read held, its tick goes on after 0.5 s here (3 s as
    shipped) on the census it has, which stays usable."""
    arm = HeldArm(WEB[:2])
    run = Run(tmp_path, arm)
    run.batch(WEB[0])
    run.clock.now = DOC_NOW + timedelta(minutes=5)

    run.coordinator.tick()

    assert arm.reads == 2
    assert not arm.done.is_set(), "the tick returned while its read was held"
    assert run.census.at(run.clock.now).usable()
    arm.go.set()
    assert arm.done.wait(5)


@pytest.fixture
def arm_face() -> Iterator[ImdsEmulator]:
    vms = [
        {"subscriptionId": SUBSCRIPTION, "resourceGroupName": "rg-fleet", "name": "web_0", "vmScaleSetName": "web"},
    ]
    with imds_serving("census-wait", vms, scale_sets={"web": {}}) as emulator:
        yield emulator


def test_a_throttled_arm_is_read_behind_the_run_that_asked(arm_face: ImdsEmulator, short_waits: None) -> None:
    """Over the IMDS emulator's ARM face: a new VM joined and ARM answers the census' reads 429 with a Retry-After
    of 1 s, twice. The run that meets the VM waits 0.5 s (the ARM pipeline sleeps the Retry-After meanwhile) and is
    told ARM was not read; the read goes on behind it and lists the VM for the next run."""
    census = Census(reader(arm_face))
    assert census.at(DOC_NOW).usable()
    arm_face.add_vm({"name": "web_1", "vmScaleSetName": "web", "subscriptionId": SUBSCRIPTION,
                     "resourceGroupName": "rg-fleet"})  # fmt: skip
    arm_face.inject_arm_fault(status=429, retryAfterSeconds=1, count=2, target="read")
    later = DOC_NOW + timedelta(minutes=1)

    view = census.at(later)
    assert view.ensure(["web_1"]) is False, "not read within the run's wait"
    assert view.entry("web_1") is None

    deadline = time.monotonic() + 10
    while census.reads < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert census.reads == 2, census.error
    assert census.at(later).entry("web_1") is not None
    assert GROUP in census.scopes
