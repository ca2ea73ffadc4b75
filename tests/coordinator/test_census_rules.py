"""Budgets and tag rules on ARM's census: a VM that lies about its own zone, fault domain or tags, or about another
VM's, or that reports under names no VM has, and an Event Grid event naming 1,000 VMs, change nothing the rules
allow.

Each case runs the same events twice through the coordinator (the in-memory store, approvals straight into the IMDS
emulator as the VM's listener would make them, the census read from the emulator's ARM face over HTTP): once with
every envelope as its VM's forwarder would send it, once with the lies. The approvals must be the same events. The
control: on the census the VMs report (the coordinator before ARM's), the same lies make approvals the truth would
not. Then the lies are in the history (``census-mismatch``), and a census that cannot be read approves nothing
resting on it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.census import ArmCensusReader, Census
from coordinator.domain.policy_file import parse_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from emulators.imds import ImdsEmulator
from emulators.tokens import mint_token
from forwarder.imds import identity_of
from local.direct_callback import DirectImdsCallback
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import BY_TAG, DOC_NOW, MemoryHistory, envelope, grid_event
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingAlerts, imds_serving, make_coordinator

SUBSCRIPTION = "00000000-0000-0000-0000-0000000c0502"
GROUP = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg-fleet"
VMS: list[dict[str, Any]] = [
    {"name": "web_0", "vmScaleSetName": "web", "zone": "1", "platformFaultDomain": 0},
    {"name": "web_1", "vmScaleSetName": "web", "zone": "1", "platformFaultDomain": 0, "platformUpdateDomain": 1},
    {"name": "web_2", "vmScaleSetName": "web", "zone": "2", "platformFaultDomain": 1},
    {"name": "api_0", "vmScaleSetName": "api", "zone": "1"},
    {"name": "db_0", "vmScaleSetName": "db", "zone": "2", "tags": {"scheduled-events": "manual"}},
    {"name": "batch_0", "vmScaleSetName": "batch", "zone": "3"},
]


class MintedCredential:
    """FAKE Entra: the coordinator's ARM token minted with the emulators' development key."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        token, expires_on = mint_token(
            audience="https://management.azure.com", identity_resource_id=f"{GROUP}/coordinator"
        )
        return AccessToken(token, expires_on)


@dataclass
class Lies:
    """What one run's envelopes say falsely: ``own`` changes a VM's identity in its own envelopes; ``as_other`` are
    extra envelopes a VM sends under another VM's name (a state of its own) with identity changes; ``ghosts`` are
    envelopes under that many names no VM has, claiming ``ghost_facts``."""

    own: dict[str, dict[str, Any]] = field(default_factory=dict)
    as_other: dict[str, dict[str, Any]] = field(default_factory=dict)
    ghosts: int = 0
    ghost_facts: dict[str, Any] = field(default_factory=dict)
    # Event Grid events taken from the platform's hub before the envelopes (what only the system topic can send).
    platform: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Outcome:
    approved: set[str]
    coordinator: Coordinator
    history: MemoryHistory
    refs: dict[str, str]


@pytest.fixture
def fleet() -> Iterator[ImdsEmulator]:
    with serving() as emulator:
        yield emulator


def serving() -> AbstractContextManager[ImdsEmulator]:
    """The IMDS emulator (and ARM) serving VMS, in the fleet's resource group."""
    vms = [{"subscriptionId": SUBSCRIPTION, "resourceGroupName": "rg-fleet", **vm} for vm in VMS]
    return imds_serving("census-rules", vms)


def report(imds: ImdsEmulator, name: str, sequence: int, changes: Mapping[str, Any] | None = None) -> RawMessage:
    """``name``'s envelope as its forwarder sends it (its identity from its instance metadata, its document), with
    ``changes`` put over its identity."""
    spec = next(vm for vm in imds.vms() if vm.name == name)
    identity = VmIdentity.of(identity_of(spec.compute())).model_copy(update=dict(changes or {}))
    document = imds.document(name)
    data = envelope(
        identity.model_dump(), sequence=sequence, incarnation=document["DocumentIncarnation"], events=document["Events"]
    )
    return RawMessage(body=json.dumps(data, default=str).encode(), partition_key=identity.partition_key)


def forged_as(imds: ImdsEmulator, name: str, changes: Mapping[str, Any]) -> RawMessage:
    """An envelope under ``name`` from another process (a state of its own, a sequence no forwarder reaches)."""
    message = report(imds, name, 2**62, changes)
    data = json.loads(message.body)
    data["stateId"] = uuid.uuid4().hex
    return RawMessage(body=json.dumps(data).encode(), partition_key=message.partition_key)


def ghost(imds: ImdsEmulator, number: int, facts: Mapping[str, Any]) -> RawMessage:
    template = next(vm for vm in imds.vms() if vm.name == "web_0")
    identity = VmIdentity.model_validate(
        {
            **identity_of(template.compute()).to_mapping(),
            "name": f"web_{100 + number}",
            "vmId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"ghost-{number}")),
            "resourceId": template.resourceId.rsplit("/", 1)[0] + f"/{100 + number}",
            **facts,
        }
    )
    data = envelope(identity.model_dump(), sequence=1, incarnation=1, events=[])
    return RawMessage(body=json.dumps(data, default=str).encode(), partition_key=identity.partition_key)


def run(
    imds: ImdsEmulator, policy: str, events: list[dict[str, Any]], lies: Lies | None = None, *, arm: bool = True
) -> Outcome:
    """The events created in IMDS, every VM's envelope (and the lies) in one batch, then a timer tick. ``arm``:
    the census is ARM's (else what the VMs report, as before it was)."""
    lies = lies or Lies()
    reader = ArmCensusReader(
        credential=MintedCredential(), resource_groups=[GROUP], arm=ArmOptions(endpoint=imds.arm_url)
    )
    history = MemoryHistory()
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=history,
        alerts=RecordingAlerts(),
        callback=DirectImdsCallback(base_url=imds.url),
        policy=parse_policy(policy),
        clock=Clock(DOC_NOW),
        census=Census(reader) if arm else None,
    )
    refs = {}
    for number, spec in enumerate(events):
        refs[imds.create_event(NoticeSeconds=900 + 60 * number, **spec)["EventId"]] = spec["EventType"] + str(number)
    messages = [report(imds, vm.name, 1, lies.own.get(vm.name)) for vm in imds.vms()]
    messages += [forged_as(imds, name, changes) for name, changes in lies.as_other.items()]
    messages += [ghost(imds, number, lies.ghost_facts) for number in range(lies.ghosts)]
    if lies.platform:
        coordinator.process_batch(
            [RawMessage(body=json.dumps(event).encode()) for event in lies.platform], channel="platform"
        )
    coordinator.process_batch(messages)
    coordinator.tick()
    approved = {refs[a["EventId"]] for a in imds.approvals() if a["EventId"] in refs}
    return Outcome(approved, coordinator, history, refs)


def both(policy: str, events: list[dict[str, Any]], lies: Lies, *, arm: bool = True) -> tuple[Outcome, Outcome]:
    """The truthful run and the lying one, each on a fresh emulator."""
    outcomes = []
    for told in (Lies(), lies):
        with serving() as imds:
            outcomes.append(run(imds, policy, events, told, arm=arm))
    truth, lied = outcomes
    return truth, lied


def same_approvals(policy: str, events: list[dict[str, Any]], lies: Lies) -> tuple[Outcome, Outcome]:
    """The truthful run and the lying one: the same approvals, or the test fails."""
    truth, lied = both(policy, events, lies)
    assert lied.approved == truth.approved, f"truth approved {truth.approved}, the lies {lied.approved}"
    return truth, lied


def mismatches(outcome: Outcome) -> dict[str, str]:
    return {
        row.VmName or "": row.Reason or ""
        for row in outcome.history.rows
        if row.RecordType == "Heartbeat" and row.Outcome == "census-mismatch"
    }


ZONE_BUDGET = """
version: 1
rules:
  - name: one-per-zone
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 1, per: [zone]}
"""


def test_a_vm_lying_about_its_own_zone_or_another_vms_changes_no_zone_budget() -> None:
    events = [
        {"EventType": "Reboot", "Resources": ["web_0"]},
        {"EventType": "Reboot", "Resources": ["api_0"]},  # zone 1 as well: held while web_0's holds it
        {"EventType": "Reboot", "Resources": ["web_2"]},
    ]
    lies = Lies(own={"api_0": {"zone": "3"}}, as_other={"web_0": {"zone": "2"}})
    truth, lied = same_approvals(ZONE_BUDGET, events, lies)
    assert truth.approved == {"Reboot0", "Reboot2"}
    held = [r for r in lied.history.rows if r.RecordType == "Decision" and r.HoldKind == "budget"]
    assert {r.HoldName for r in held} == {"zone:westeurope/1"}
    # Kept as they said it, and flagged: the VM that lied of itself, and the one another VM lied about.
    flagged = mismatches(lied)
    assert "zone '3' (ARM: '1')" in flagged["api_0"]
    assert "zone '2' (ARM: '1')" in flagged["web_0"]
    assert mismatches(truth) == {}


def test_a_vm_lying_about_its_fault_domain_changes_no_fault_domain_budget() -> None:
    policy = ZONE_BUDGET.replace("per: [zone]", "per: [faultDomain]")
    events = [{"EventType": "Reboot", "Resources": ["web_0"]}, {"EventType": "Reboot", "Resources": ["web_1"]}]
    truth, lied = same_approvals(policy, events, Lies(own={"web_1": {"platformFaultDomain": "1"}}))
    assert truth.approved == {"Reboot0"}
    assert "faultDomain '1' (ARM: '0')" in mismatches(lied)["web_1"]


TAG_RULES = (
    BY_TAG
    + """  - name: reboots-by-budget
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxImpacted: 5}
"""
)


def test_a_vm_lying_about_tags_neither_escapes_a_tag_nor_earns_one_even_where_tags_are_trusted() -> None:
    events = [
        {"EventType": "Reboot", "Resources": ["db_0"]},  # ARM: scheduled-events=manual, a person decides
        {"EventType": "Redeploy", "Resources": ["batch_0"]},  # no tag, no rule: a person decides
        {"EventType": "Redeploy", "Resources": ["web_2"]},
    ]
    lies = Lies(
        own={"db_0": {"tags": {}}, "batch_0": {"tags": {"scheduled-events": "auto"}}},
        as_other={"web_2": {"tags": {"Scheduled-Events": "auto"}}},
    )
    truth, lied = same_approvals(TAG_RULES, events, lies)
    assert truth.approved == set()
    decisions = {
        lied.refs[r.EventId or ""]: r.Rule for r in lied.history.rows if r.RecordType == "Decision" and r.EventId
    }
    assert decisions["Reboot0"] == "manual-by-tag"
    assert {decisions["Redeploy1"], decisions["Redeploy2"]} == {"(no rule matched)"}
    assert set(mismatches(lied)) == {"db_0", "batch_0", "web_2"}


def test_names_no_vm_has_do_not_widen_a_percent_budget() -> None:
    policy = ZONE_BUDGET.replace("maxImpacted: 1", "maxPercent: 30")  # zone 1 has 3 VMs: 30 % is 1
    events = [{"EventType": "Reboot", "Resources": [name]} for name in ("web_0", "web_1", "api_0")]
    # Ten envelopes under invented names in zone 1: believed, zone 1 would hold 13 VMs and allow 4 at once.
    truth, lied = same_approvals(policy, events, Lies(ghosts=10, ghost_facts={"zone": "1"}))
    assert truth.approved == {"Reboot0"}
    assert len(lied.approved) == 1
    assert all(reason.startswith(name) for name, reason in mismatches(lied).items())
    assert "ARM lists no VM of this name" in mismatches(lied)["web_100"]
    assert lied.coordinator.parts.census is not None
    assert lied.coordinator.parts.census.reads <= 2, "the unknown names cost one read of ARM at most"


def test_an_event_grid_event_naming_a_thousand_vms_adds_none_to_the_census() -> None:
    policy = ZONE_BUDGET.replace("budget: {maxImpacted: 1, per: [zone]}", "budget: {maxPercent: 30}")  # web: 3 VMs
    events = [{"EventType": "Reboot", "Resources": [name]} for name in ("web_0", "web_1", "web_2")]
    thousand = grid_event("EV-1000", resources=[f"web_{n}" for n in range(100, 1100)], scale_set="web")
    lies = Lies(platform=[thousand])
    truth, lied = same_approvals(policy, events, lies)
    assert len(truth.approved) == 1
    census = lied.coordinator.parts.census
    assert census is not None
    assert census.reads <= 2, "the thousand names cost one read of ARM at most"
    assert sorted(census.at(DOC_NOW).facts()) == sorted(vm["name"] for vm in VMS)
    # On the census the VMs report, the same event makes web a scale set of 1,003 VMs: every Reboot goes at once.
    old_truth, old_lied = both(policy, events, lies, arm=False)
    assert (len(old_truth.approved), len(old_lied.approved)) == (1, 3)


SCALE_SET_RULES = """
version: 1
rules:
  - name: db-by-person
    match: {scaleSet: [db]}
    action: wait-for-person
  - name: reboots-at-once
    match: {eventType: [Reboot]}
    action: approve-now
"""


def test_a_vm_lying_about_a_scale_set_neither_escapes_its_rule_nor_holds_another_vm_by_it() -> None:
    """db_0 says it is in scale set web (a db rule would not take its Reboot), and another process says web_2 is in
    db (the db rule would hold web_2's): the scale set a rule matches is ARM's."""
    events = [{"EventType": "Reboot", "Resources": ["db_0"]}, {"EventType": "Reboot", "Resources": ["web_2"]}]
    lies = Lies(own={"db_0": {"vmScaleSetName": "web"}}, as_other={"web_2": {"vmScaleSetName": "db"}})
    truth, lied = same_approvals(SCALE_SET_RULES, events, lies)
    assert truth.approved == {"Reboot1"}
    decisions = {lied.refs[r.EventId or ""]: r.Rule for r in lied.history.rows if r.RecordType == "Decision"}
    assert decisions == {"Reboot0": "db-by-person", "Reboot1": "reboots-at-once"}
    assert "scaleSet 'web' (ARM: 'db')" in mismatches(lied)["db_0"]


COUPLED_DELETES = """
version: 1
rules:
  - name: web_0-by-person
    match: {eventType: [Terminate], vmName: [web_0]}
    action: wait-for-person
  - name: deletes-at-once
    match: {eventType: [Terminate]}
    action: approve-now
"""
DELETES = [{"EventType": "Terminate", "Resources": ["web_0"]}, {"EventType": "Terminate", "Resources": ["web_2"]}]


def test_a_vm_lying_about_its_scale_set_does_not_uncouple_its_delete() -> None:
    """web_2's delete is ready, and held with web_0's (the same scale set, a person decides it) as the platform holds
    them; web_2 says it is in scale set batch: the deletes it is coupled with are still web's, ARM's."""
    truth, lied = same_approvals(COUPLED_DELETES, DELETES, Lies(own={"web_2": {"vmScaleSetName": "batch"}}))
    assert truth.approved == set()
    [held] = [r for r in lied.history.rows if r.RecordType == "Decision" and r.Rule == "deletes-at-once"]
    assert held.HoldKind == "delete"
    assert "held with the pending deletes of scale set web" in (held.Reason or "")


REBOOTS = [{"EventType": "Reboot", "Resources": [name]} for name in ("web_0", "api_0", "web_2")]
REDEPLOYS = [{"EventType": "Redeploy", "Resources": [name]} for name in ("db_0", "batch_0", "web_2")]


@pytest.mark.parametrize(
    ("policy", "events", "lies", "wrong"),
    [
        (ZONE_BUDGET, REBOOTS, Lies(own={"api_0": {"zone": "3"}}), {"Reboot1"}),
        (TAG_RULES, REDEPLOYS, Lies(as_other={"web_2": {"tags": {"scheduled-events": "auto"}}}), {"Redeploy2"}),
        (ZONE_BUDGET.replace("maxImpacted: 1", "maxPercent: 30"), REBOOTS, Lies(ghosts=10, ghost_facts={"zone": "1"}),
         {"Reboot1"}),
        (SCALE_SET_RULES, [{"EventType": "Reboot", "Resources": ["db_0"]}],
         Lies(own={"db_0": {"vmScaleSetName": "web"}}), {"Reboot0"}),
        (COUPLED_DELETES, DELETES, Lies(own={"web_2": {"vmScaleSetName": "batch"}}), {"Terminate1"}),
    ],
    ids=["own-zone", "another-vms-tags", "invented-names", "own-scale-set", "uncoupled-delete"],
)  # fmt: skip
def test_the_lies_are_real_on_what_the_vms_report_each_makes_an_approval_the_truth_would_not(
    policy: str, events: list[dict[str, Any]], lies: Lies, wrong: set[str]
) -> None:
    truth, lied = both(policy, events, lies, arm=False)
    assert lied.approved - truth.approved == wrong


def test_a_census_that_cannot_be_read_approves_nothing_resting_on_it(fleet: ImdsEmulator) -> None:
    fleet.inject_arm_fault(status=403, count=100, target="read")
    outcome = run(fleet, TAG_RULES, [{"EventType": "Reboot", "Resources": ["web_0"]}])
    assert outcome.approved == set()
    [decision] = [r for r in outcome.history.rows if r.RecordType == "Decision"]
    assert (decision.HoldKind, decision.HoldName, decision.Outcome) == ("census", "arm", "wait")
    assert "the census from ARM" in (decision.Reason or "")
    assert "403" in (decision.Reason or "")
    # Nothing was read, so nothing is said of the VMs: a census never read lists no VM, and every VM of a local
    # demo whose first read failed was flagged "ARM lists no VM of this name".
    assert mismatches(outcome) == {}
    # Once ARM answers, the timer reads it again and the event is decided on it.
    fleet.arm_faults = type(fleet.arm_faults)()
    coordinator = outcome.coordinator
    coordinator.parts.clock.now = DOC_NOW + timedelta(minutes=1)  # type: ignore[attr-defined]
    coordinator.tick()
    assert {a["EventId"] for a in fleet.approvals()} == set(outcome.refs)
