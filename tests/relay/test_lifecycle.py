"""A VM's hybrid connection over its life: created through ARM by the coordinator, used, found silent, deleted.

Runs HybridConnectionAdmin against the Relay emulator's ARM-shaped hybridConnections API, with ``require_known``
so that only connections created that way can be listened on or sent to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from azure.core.credentials import AzureNamedKeyCredential

from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.relay_admin import HybridConnectionAdmin, hybrid_connections_to_delete
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from tests.polling import wait_for
from tests.relay.conftest import (
    SEND_KEY,
    VM_A0,
    VM_A1,
    MintedCredential,
    Vm,
    approval,
    imds_client,
    keyed_relay,
    scheduled_event,
)


@pytest.fixture
def relay() -> Iterator[RelayEmulator]:
    """Overrides conftest's relay: hybrid connections must be created (through ARM) before use."""
    with keyed_relay(require_known=True) as emulator:
        yield emulator


def test_create_use_find_silent_and_delete(
    imds: ImdsEmulator, relay: RelayEmulator, start_vm: Callable[..., Vm]
) -> None:
    web0, web1 = (VmIdentity.of(imds_client(imds, vm).get_identity()) for vm in (VM_A0, VM_A1))
    admin = HybridConnectionAdmin(
        credential=MintedCredential("https://management.azure.com"),
        subscription_id="00000000-0000-0000-0000-00000000e001",
        resource_group="rg-scheduled-events",
        namespace="relay-local",
        arm=ArmOptions(endpoint=relay.base_url),
    )
    sender = RelayApprovalSender(
        endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY), max_retry_seconds=2.0
    )
    with admin, sender:
        with pytest.raises(ApprovalDeliveryError, match="does not exist"):
            sender.send(approval(scheduled_event(imds, VM_A0)), vm=web0)

        created = admin.ensure(web0)
        assert created.vm_resource_id == web0.resourceId
        assert created.requires_client_authorization is True
        admin.ensure(web1)
        vm = start_vm(VM_A0, auth="sas")
        assert admin.get(web0.hybrid_connection_name).listener_count == 1  # type: ignore[union-attr]
        assert sender.send(approval(scheduled_event(imds, VM_A0)), vm=web0).outcome == "approved"

        now = datetime.now(UTC)
        existing = [item.name for item in admin.list()]
        assert sorted(existing) == sorted([web0.hybrid_connection_name, web1.hybrid_connection_name])
        doomed = hybrid_connections_to_delete(
            existing,
            last_seen={web0.hybrid_connection_name: now, web1.hybrid_connection_name: now - timedelta(days=3)},
            now=now,
            silence_limit=timedelta(days=1),
        )
        assert doomed == [web1.hybrid_connection_name]
        assert all(admin.delete(name) for name in doomed)

        # Deleting the connection of a VM that is still listening drops its listener (1001) …
        assert admin.delete(web0.hybrid_connection_name) is True
        assert wait_for(lambda: not vm.listener.connected)
        assert admin.list() == []
        # … and ensure() brings it back: the listener's own reconnects find it again.
        admin.ensure(web0)
        assert vm.listener.wait_connected(10)
        assert sender.send(approval(scheduled_event(imds, VM_A0)), vm=web0).outcome == "approved"
    assert len(imds.approvals()) == 2
