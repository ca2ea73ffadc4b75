"""Sender authentication is the Relay's job: with Entra RBAC, only the coordinator's identity may send.

The Relay emulator models role assignments: the VM's managed identity holds "Azure Relay Listener", the
coordinator's identity "Azure Relay Sender". The VM's listener takes its token as the forwarder does (its IMDS
credential); the VM trying to send uses azure-identity's ManagedIdentityCredential, pointed at the IMDS emulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from azure.identity import ManagedIdentityCredential

from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from emulators.relay.auth import Right
from forwarder.relay_tokens import EntraTokenProvider
from tests.relay.conftest import (
    COORDINATOR_IDENTITY,
    VM_A0,
    MintedCredential,
    Vm,
    approval,
    scenario,
    scheduled_event,
)

RELAY = "https://relay.azure.net"


@pytest.fixture
def relay() -> Iterator[RelayEmulator]:
    """Overrides the SAS relay of conftest: Entra only, with role assignments."""
    vm_identity = next(vm.resourceId for vm in scenario().vms if vm.name == VM_A0)
    emulator = RelayEmulator(
        role_assignments={vm_identity: frozenset({Right.LISTEN}), COORDINATOR_IDENTITY: frozenset({Right.SEND})},
        response_timeout=5.0,
    )
    emulator.start()
    yield emulator
    emulator.stop()


def test_only_the_coordinator_identity_can_send(
    imds: ImdsEmulator, relay: RelayEmulator, start_vm: Callable[..., Vm], monkeypatch: pytest.MonkeyPatch
) -> None:
    vm = start_vm(VM_A0)  # Entra: the VM's managed identity, a token from the IMDS emulator
    for name, value in imds.identity_environment(VM_A0).items():
        monkeypatch.setenv(name, value)
    event_id = scheduled_event(imds, VM_A0)
    with (
        RelayApprovalSender(endpoint=relay.base_url, credential=ManagedIdentityCredential()) as vm_as_sender,
        pytest.raises(ApprovalDeliveryError, match=r"HTTP 403.*Azure Relay Sender"),
    ):
        vm_as_sender.send(approval(event_id), vm=vm.identity)
    assert imds.approvals() == []
    with RelayApprovalSender(endpoint=relay.base_url, credential=MintedCredential(RELAY)) as coordinator:
        assert coordinator.send(approval(event_id), vm=vm.identity).outcome == "approved"
    assert [item["EventId"] for item in imds.approvals()] == [event_id]


def test_the_coordinator_identity_cannot_listen(
    imds: ImdsEmulator, relay: RelayEmulator, start_vm: Callable[..., Vm]
) -> None:
    provider = EntraTokenProvider(credential=MintedCredential(RELAY))
    with pytest.raises(AssertionError, match="did not connect"):
        start_vm(VM_A0, token_provider=provider, wait=1.0)
    refused = {kind: count for kind, count in relay.counters().items() if count}
    assert refused, "the relay should have counted the refused listener handshakes"
