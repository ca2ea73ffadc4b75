"""The approval path on loopback: Relay emulator + IMDS emulator + the real listener, approver and sender.

Nothing here is faked: the listener speaks the Hybrid Connections protocol to the Relay emulator over WebSockets,
the sender POSTs through it over HTTP, the approver reads and approves through the IMDS emulator, and the VM's
Entra token comes from azure-identity's ManagedIdentityCredential served by the IMDS emulator.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from azure.core.credentials import AccessToken, AzureNamedKeyCredential

from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.document import ScheduledEvent
from contracts.envelope import VmIdentity
from contracts.sas import relay_resource_uri
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator, Scenario, VmSpec
from emulators.relay import RelayEmulator
from emulators.relay.auth import Right
from emulators.tokens import mint_token
from forwarder.approver import Approver
from forwarder.credential import ImdsManagedIdentityCredential
from forwarder.imds import ImdsClient
from forwarder.relay_listener import RelayListener
from forwarder.relay_tokens import EntraTokenProvider, SasTokenProvider, TokenProvider
from forwarder.retry import Backoff, RateLimiter

LISTEN_KEY = "bGlzdGVuLWtleS1mb3ItdGVzdHM="
SEND_KEY = "c2VuZC1rZXktZm9yLXRlc3Rz"
VM_A0, VM_A1, VM_B0 = "web_0", "web_1", "db_0"
COORDINATOR_IDENTITY = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Web/sites/coordinator"


def scenario() -> Scenario:
    return Scenario(
        name="relay-tests",
        vms=[
            VmSpec(name=VM_A0, vmScaleSetName="web", placementGroupId="pg-web"),
            VmSpec(name=VM_A1, vmScaleSetName="web", placementGroupId="pg-web", platformFaultDomain="1"),
            VmSpec(name=VM_B0, placementGroupId="pg-db"),
        ],
    )


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    with ImdsEmulator(scenario=scenario(), throttle_rps=10_000) as emulator:
        yield emulator


@contextmanager
def keyed_relay(**options: Any) -> Iterator[RelayEmulator]:
    """A Relay emulator whose SAS keys are the tests' "listen" and "send", each with that one right."""
    with RelayEmulator(
        sas_keys={"listen": LISTEN_KEY, "send": SEND_KEY},
        sas_rights={"listen": frozenset({Right.LISTEN}), "send": frozenset({Right.SEND})},
        response_timeout=5.0,
        **options,
    ) as emulator:
        yield emulator


@pytest.fixture
def relay() -> Iterator[RelayEmulator]:
    with keyed_relay() as emulator:
        yield emulator


def ws_endpoint(relay: RelayEmulator) -> str:
    return relay.ws_url


def imds_client(imds: ImdsEmulator, vm_name: str) -> ImdsClient:
    # Own limiter: the process-wide one would make tests wait on each other.
    return ImdsClient(base_url=imds.url_for(vm_name), timeout=5.0, limiter=RateLimiter(requests=1000))


@dataclass
class Vm:
    identity: VmIdentity
    listener: RelayListener
    approver: Approver


@pytest.fixture
def start_vm(
    imds: ImdsEmulator, relay: RelayEmulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Callable[..., Vm]]:
    started: list[RelayListener] = []

    def start(vm_name: str = VM_A0, *, auth: str = "entra", token_provider: TokenProvider | None = None,
              wait: float = 10.0, **options: Any) -> Vm:  # fmt: skip
        client = imds_client(imds, vm_name)
        identity = client.get_identity()
        hybrid_connection = identity.hybrid_connection_name
        if token_provider is None and auth == "entra":
            # The VM's managed identity as the forwarder takes it: a token from the IMDS emulator's endpoint.
            token_provider = EntraTokenProvider(credential=ImdsManagedIdentityCredential(imds=client))
        elif token_provider is None:
            key_file = tmp_path / f"{vm_name}.key"
            key_file.write_text(LISTEN_KEY)
            token_provider = SasTokenProvider(
                resource_uri=relay_resource_uri(ws_endpoint(relay), hybrid_connection),
                key_name="listen",
                key_file=key_file,
            )
        approver = Approver(imds=client, vm_name=identity.name, ledger=options.pop("ledger", None))
        options.setdefault("backoff", Backoff(initial=0.05, maximum=0.5))
        listener = RelayListener(
            endpoint=ws_endpoint(relay),
            hybrid_connection=hybrid_connection,
            token_provider=token_provider,
            handler=options.pop("handler", approver),
            **options,
        )
        started.append(listener.start())
        assert listener.wait_connected(wait), "the listener did not connect to the relay emulator"
        return Vm(VmIdentity.of(identity), listener, approver)

    yield start
    for listener in started:
        listener.stop(timeout=5)


@pytest.fixture
def sender(relay: RelayEmulator) -> Iterator[RelayApprovalSender]:
    with RelayApprovalSender(
        endpoint=relay.base_url,
        credential=AzureNamedKeyCredential("send", SEND_KEY),
        backoff_initial=0.05,
        backoff_maximum=0.3,
        max_retry_seconds=5.0,
    ) as client:
        yield client


class MintedCredential:
    """FAKE Entra for the coordinator (no local Entra ID): tokens signed with the emulators' development key."""

    def __init__(self, audience: str, identity: str = COORDINATOR_IDENTITY) -> None:
        self.audience = audience
        self.identity = identity

    def get_token(self, *scopes: str, **_: object) -> AccessToken:
        token, expires_on = mint_token(audience=self.audience, identity_resource_id=self.identity)
        return AccessToken(token, expires_on)


# The facts of the events the tests created, as the coordinator would have recorded them from the VMs' sightings:
# an approval request carries them and the listener checks them against its own IMDS document.
_CREATED: dict[str, ApprovalFacts] = {}


def facts_of(created: dict[str, Any], *, hooks_required: tuple[str, ...] = ()) -> ApprovalFacts:
    """An emulator event (as `create_event` returns it) as the facts of a decision, remembered for `approval`."""
    event = ScheduledEvent.model_validate(
        {k: v for k, v in created.items() if k[:1].isupper()} | {"EventStatus": "Scheduled"}
    )
    facts = ApprovalFacts.of(event, hooks_required=hooks_required)
    _CREATED[event.EventId] = facts
    return facts


def approval(
    event_id: str,
    *,
    decision: str | None = None,
    issued: datetime | None = None,
    valid_for: timedelta = timedelta(minutes=10),
    facts: ApprovalFacts | None = None,
) -> ApprovalRequest:
    issued_at = issued or datetime.now(UTC)
    facts = facts or _CREATED.get(event_id)
    # As the coordinator dates it: never past the event's NotBefore.
    not_after = min(issued_at + valid_for, facts.notBefore or issued_at + valid_for) if facts else issued_at + valid_for
    return ApprovalRequest(
        eventId=event_id,
        decisionId=decision or f"d-{uuid.uuid4()}",
        rule="tests",
        issuedAt=issued_at,
        expiresAt=issued_at + valid_for,
        notAfter=not_after,
        facts=facts,
    )


def scheduled_event(imds: ImdsEmulator, *resources: str, **fields: Any) -> str:
    fields.setdefault("NoticeSeconds", 900)
    created = imds.create_event(EventType="Freeze", Resources=list(resources), **fields)
    facts_of(created)
    return str(created["EventId"])
