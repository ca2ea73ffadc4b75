"""The wave's fleet as Azure shows it, and the coordinator configured for it as shipped (benchmarks/wave.py).

One IMDS emulator scenario defines every VM of the wave (``fleet_scenario``): scale sets ``vmss000``… of one
placement group each, zones, update domains, tags. What IMDS serves a VM, what the emulator's ARM face lists for
the coordinator's census and what the wave's envelopes say of the VM are all that one ``VmSpec``: an envelope's
``vm`` is what the forwarder's ``get_identity`` reads from the emulator's compute metadata (``identity_of``), and it
carries the emulator's attested document of that VM for its forwarder state (``state_nonce(stateId)``), as the
forwarder's Attestor attaches it. ``coordinator_env`` configures the coordinator as local/stack.py does (trust
anchors, issuer URLs, ARM's census, the managed identity through the emulator), which is what
infra/modules/functionapp.bicep deploys: attestation required, the census configured.

``build_wave`` and ``build_heartbeats`` make the envelopes, ``partitioned`` and ``batches`` what the Functions host
hands the coordinator. Whether a wave measured the product is benchmarks/wave_checks.py's.
"""

from __future__ import annotations

import json
import random
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import azure.functions as func

from benchmarks.wave_budgets import BUDGETS
from contracts.attestation import state_nonce
from contracts.envelope import SCHEMA
from coordinator import Wanted, remember
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from emulators.imds.attested import CertificateAuthority
from forwarder.imds import identity_of
from local.scenario import census_scopes

START = datetime(2026, 11, 20, 1, 0, tzinfo=UTC)
SUBSCRIPTION = "00000000-0000-0000-0000-000000000001"
RESOURCE_GROUP = "rg-wave"
# When IMDS signed every VM's document for its forwarder state: before the warm-up's heartbeats, and valid (6 h)
# well past the last envelope of a 100k wave (START + 250 s).
ATTESTED_AT = START - timedelta(minutes=10)
# A policy that needs the census (Policy.needs_census: a tag rule, percent budgets per zone and update domain) and
# decides the wave as the default policy does: nothing of the wave carries the tag or matches the budget rule, so
# the writes are the same and the difference is what knowing every VM costs.
CENSUS_POLICY = """version: 1
rules:
  - name: opted-out
    match: {tags: {scheduled-events: manual}}
    action: wait-for-person
  - name: paced-short-freezes
    match: {eventType: [Freeze], durationSeconds: {min: 0, max: 8}}
    action: approve-within-budget
    budget: {maxPercent: 10, per: [scaleSet, zone, updateDomain]}
  - name: terminate-after-prepare-hooks
    match: {eventType: [Terminate]}
    action: approve-after-hooks
    hooks: {deadlineSeconds: 240, onDeadline: approve, noHooks: wait}
  - name: everything-else-waits
    match: {}
    action: wait-for-person
"""


def vm_name(group: int, index: int) -> str:
    return f"vmss{group:03d}_{index}"


def fleet_scenario(vms: int, group_size: int) -> Scenario:
    """Every VM of the wave: a Uniform scale set per placement group of ``group_size``, zones 1-3 by group, fault
    domains 0-2 and update domains 0-4 within a group, one tag."""
    specs = [
        VmSpec(
            name=vm_name(g, i),
            subscriptionId=SUBSCRIPTION,
            resourceGroupName=RESOURCE_GROUP,
            vmScaleSetName=f"vmss{g:03d}",
            placementGroupId=f"pg-{g:03d}",
            zone=str(g % 3 + 1),
            platformFaultDomain=str(i % 3),
            platformUpdateDomain=str(i % 5),
            tags={"team": "wave"},
        )
        for g in range(vms // group_size)
        for i in range(group_size)
    ]
    return Scenario(name="wave", description="benchmarks/wave.py", vms=specs)


@dataclass(frozen=True)
class AttestedVm:
    """A VM as its forwarder speaks: its identity (as read from IMDS), its state, IMDS's document for that state."""

    identity: dict[str, Any]
    state_id: str
    attestation: dict[str, str] | None


def attest_fleet(imds: ImdsEmulator, *, signed: bool = True, at: datetime = ATTESTED_AT) -> dict[str, AttestedVm]:
    """Per VM name: the identity its forwarder reads from the emulator's compute metadata and the emulator's
    attested document for its forwarder state, signed at ``at`` (one RSA signature per VM). ``signed`` False:
    no document, as a forwarder older than attestation sends."""
    fleet: dict[str, AttestedVm] = {}
    for spec in imds.vms():
        compute = spec.compute()
        state_id = uuid.uuid5(uuid.NAMESPACE_URL, f"wave-forwarder-state:{spec.vmId}").hex
        document = imds.attested.document(compute, nonce=state_nonce(state_id), now=at) if signed else None
        fleet[spec.name] = AttestedVm(identity_of(compute).to_mapping(), state_id, document)
    return fleet


def coordinator_settings(azurite_connection: str, tmp: str, history: str, policy: str = "default") -> dict[str, str]:
    """The coordinator's own settings for the wave: Azurite, its table, the history and cards in ``tmp``, and the
    policy: the default, the census policy or a budget's (benchmarks/wave_budgets.py)."""
    env = {
        "COORDINATOR_STORAGE_CONNECTION_STRING": azurite_connection,
        "COORDINATOR_STATE_TABLE": "wave",
        "COORDINATOR_HISTORY_SQLITE_PATH": f"{tmp}/{history}",
        "COORDINATOR_CARDS_FOLDER": f"{tmp}/cards",
    }
    if policy != "default":
        path = f"{tmp}/{policy}-policy.yaml"
        with open(path, "w", encoding="utf-8") as file:
            file.write(CENSUS_POLICY if policy == "census" else BUDGETS[policy].policy)
        env["COORDINATOR_POLICY_PATH"] = path
    return env


def coordinator_env(
    imds: ImdsEmulator,
    scenario: Scenario,
    folder: Path,
    identity: Mapping[str, str],
    *,
    foreign_anchor: bool = False,
) -> dict[str, str]:
    """The coordinator's attestation, census and identity settings as local/stack.py gives them (``identity``: its
    own managed identity's, ``AppIdentity.environment()``; ``foreign_anchor``: trust another CA's root instead of the
    emulator's, which must refuse every document)."""
    root = folder / "imds-root.pem"
    root.write_bytes(
        CertificateAuthority.create(label="Not The Emulator").root_pem if foreign_anchor else imds.root_pem
    )
    return {
        "COORDINATOR_CENSUS_RESOURCE_GROUPS": ",".join(census_scopes(scenario)),
        "COORDINATOR_ARM_ENDPOINT": imds.arm_url,
        **identity,
        "COORDINATOR_ATTESTATION_TRUST_ANCHORS": str(root),
        "COORDINATOR_ATTESTATION_ISSUER_URLS": imds.url + "/_emulator/pki/",
    }


def seed_bindings(coordinator: Any, identities: Iterable[Mapping[str, Any]], *, table: bool = True) -> int:
    """Every VM's four bindings (its resource id's and name's vmId, its vmId's resource id and name) remembered by the
    instance and, with ``table``, written to the state table in entity group transactions of 100 per partition: the
    state its VMs' first attested envelopes leave (pipeline/bindings.py), reached without the door's checks, which
    ``--bindings cold`` measures. Azurite finds an entity by scanning its partition: 100,000 VMs' bindings take long
    to write (Azure Table Storage indexes the keys). Returns the rows written."""
    pairs: dict[str, str] = {}
    for identity in identities:
        vm = Wanted(
            str(identity["vmId"]).lower(), str(identity["resourceId"]).lower(), str(identity["name"]).lower(), True
        )
        pairs.update(vm.claims())
    if table:
        coordinator.parts.store.claim_many(list(pairs.items()))  # transactions of 100 claims of one partition
    for name, value in pairs.items():
        remember(coordinator.parts.attestations.bindings, name, value)
    return len(pairs) if table else 0


# ---- the envelopes ------------------------------------------------------------------------------------------


# A partition's messages as the host delivers them: (body, partition key, enqueued time).
Message = tuple[bytes, str, datetime]


def _attested(envelope: dict[str, Any], vm: AttestedVm) -> dict[str, Any]:
    """The envelope as the forwarder sends it: its state, and IMDS's document for that state when it has one."""
    envelope["stateId"] = vm.state_id
    if vm.attestation is not None:
        envelope["attestation"] = vm.attestation
    return envelope


def build_wave(
    fleet: dict[str, AttestedVm],
    *,
    vms: int,
    group_size: int,
    spacing_ms: float,
    rng: random.Random,
    event_type: str = "mixed",
) -> list[dict[str, Any]]:
    """Every VM's envelope of its group's event, in the order they are observed."""
    groups = vms // group_size
    kinds = [("Reboot", -1), ("Redeploy", -1), ("Freeze", 30)] if event_type == "mixed" else [(event_type, -1)]
    out: list[dict[str, Any]] = []
    for g in range(groups):
        group_start = START + timedelta(milliseconds=spacing_ms * g)
        names = [vm_name(g, i) for i in range(group_size)]
        event_type, duration = kinds[g % len(kinds)]
        event = {
            "EventId": str(uuid.UUID(int=rng.getrandbits(128))).upper(),
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": names[: group_size // 4],  # one update domain of the group
            "EventStatus": "Scheduled",
            "NotBefore": format_datetime(group_start + timedelta(minutes=15), usegmt=True),
            "Description": "Virtual machine is going to be restarted for platform maintenance.",
            "EventSource": "Platform",
            "DurationInSeconds": duration,
        }
        for name in names:
            observed = group_start + timedelta(milliseconds=rng.uniform(0, 1000))
            envelope = {
                "schema": SCHEMA,
                "kind": "incarnation",
                "vm": fleet[name].identity,
                "observedAt": observed.isoformat(),
                "sequence": 100,
                "forwarder": "wave/1.0",
                "document": {"DocumentIncarnation": 2, "Events": [event]},
            }
            out.append(_attested(envelope, fleet[name]))
    out.sort(key=lambda e: e["observedAt"])
    return out


def build_heartbeats(fleet: dict[str, AttestedVm]) -> list[dict[str, Any]]:
    """One attested heartbeat per VM a minute before the wave (the forwarder's first, at its start)."""
    out = []
    for index, vm in enumerate(fleet.values()):
        observed = START - timedelta(seconds=60) + timedelta(milliseconds=index % 1000)
        envelope = {
            "schema": SCHEMA,
            "kind": "heartbeat",
            "vm": vm.identity,
            "observedAt": observed.isoformat(),
            "sequence": 99,
            "forwarder": "wave/1.0",
        }
        out.append(_attested(envelope, vm))
    out.sort(key=lambda e: e["observedAt"])
    return out


def partitioned(envelopes: list[dict[str, Any]], partitions: int) -> list[list[Message]]:
    """Per partition (by the forwarder's partition key, the VM's resource id), its messages in order."""
    out: list[list[Message]] = [[] for _ in range(partitions)]
    for envelope in envelopes:
        key = envelope["vm"]["resourceId"].lower()
        body = json.dumps(envelope).encode()
        out[zlib.crc32(key.encode()) % partitions].append((body, key, datetime.fromisoformat(envelope["observedAt"])))
    return out


def batches(messages: list[Message], batch: int) -> list[list[func.EventHubEvent]]:
    """A partition's messages as the host's batches of Event Hubs events."""
    events = [
        func.EventHubEvent(body=body, partition_key=key, sequence_number=n, offset=str(n), enqueued_time=enqueued)
        for n, (body, key, enqueued) in enumerate(messages)
    ]
    return [events[i : i + batch] for i in range(0, len(events), batch)]


@dataclass
class Prepared:
    """The wave and its warm-up, per partition, and the coordinator's settings: all made before the clock."""

    envelopes: int
    work: list[list[Message]]
    warm: list[list[Message]]
    env: dict[str, str]  # the attestation, census and identity settings (wave_fleet.coordinator_env)
    documents: dict[str, dict[str, Any]]  # per VM, the document its wave envelope carried
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def events(self) -> dict[str, list[str]]:
        """Per EventId, the VMs it impacts (its Resources)."""
        return {e["EventId"]: e["Resources"] for document in self.documents.values() for e in document["Events"]}


def prepare(args: Any, imds: ImdsEmulator, identity: Mapping[str, str], tmp: str, started: float) -> Prepared:
    """Every VM's document signed (the slow part: an RSA signature a VM), the envelopes built and encoded."""
    timings = {"start_seconds": time.perf_counter() - started}  # Azurite, the IMDS emulator, the scenario
    fleet = attest_fleet(imds, signed=not args.storm and args.sabotage != "unsigned")
    timings["sign_seconds"] = time.perf_counter() - started - timings["start_seconds"]
    env = coordinator_env(imds, imds.scenario, Path(tmp), identity, foreign_anchor=args.sabotage == "foreign-anchor")
    wave = build_wave(
        fleet,
        vms=args.vms,
        group_size=args.group_size,
        spacing_ms=args.group_spacing_ms,
        rng=random.Random(args.seed),
        event_type=args.event_type,
    )
    work = partitioned(wave, args.partitions)
    warm = partitioned(build_heartbeats(fleet), args.partitions) if args.bindings == "warm" else [[]] * len(work)
    documents = {envelope["vm"]["name"]: envelope["document"] for envelope in wave}
    return Prepared(len(wave), work, warm, env, documents, timings)
