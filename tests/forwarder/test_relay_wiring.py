"""The daemon's relay seam, end to end on loopback: with relay settings on, the forwarder starts the relay listener
on its own hybrid connection (VmIdentity.hybrid_connection_name) with the VM's managed identity; an approval sent
by the coordinator's sender through the Relay emulator reaches IMDS, and the forwarder then forwards the event as
Started. Stopping the forwarder closes the listener."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from azure.core.credentials import AzureNamedKeyCredential

from coordinator.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from forwarder.approval import ApprovalRequest
from forwarder.cli import relay_companions
from forwarder.config import load_settings
from tests.forwarder.conftest import Harness, wait_for
from tests.relay.conftest import facts_of

SEND_KEY = "c2VuZC1rZXktZm9yLWZvcndhcmRlci10ZXN0cw=="


@pytest.fixture
def relay() -> Iterator[RelayEmulator]:
    emulator = RelayEmulator(sas_keys={"send": SEND_KEY}, response_timeout=5.0)
    emulator.start()
    yield emulator
    emulator.stop()


def test_approval_through_the_relay_reaches_imds(
    imds: ImdsEmulator, relay: RelayEmulator, harness: Callable[..., Harness]
) -> None:
    endpoint = relay.base_url.replace("http://", "ws://")
    settings = load_settings(
        flags={"sink": "stdout", "relay_enabled": True, "relay_endpoint": endpoint, "imds_url": imds.url_for("web_0")},
        environ={},
    )
    h = harness(imds.url_for("web_0"), companions=relay_companions(settings), heartbeat_interval=0.2)
    identity = h.forwarder.identity
    assert identity is not None
    wait_for(lambda: relay.listener_count(identity.hybrid_connection_name) == 1, what="the listener to connect")
    # Heartbeats say whether the listener is connected (a forwarder whose approvals cannot arrive is sick too).
    wait_for(
        lambda: any(b["health"].get("listenerConnected") is True for b in h.envelopes("heartbeat")),
        what="a heartbeat with the listener connected",
    )
    created = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    event_id = created["EventId"]
    h.wait_incarnation(2)

    now = datetime.now(UTC)
    request = ApprovalRequest(
        eventId=event_id,
        decisionId=uuid.uuid4().hex,
        rule="test",
        issuedAt=now,
        expiresAt=now + timedelta(minutes=5),
        facts=facts_of(created),
    )
    with RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY)) as sender:
        result = sender.send(request, vm=identity)
    assert result.outcome == "approved"
    assert [a["EventId"] for a in imds.approvals()] == [event_id]
    started = h.wait_incarnation(3)
    assert started["document"]["Events"][0]["EventStatus"] == "Started"

    relay.stop()  # the control channel drops; the heartbeats say so
    wait_for(
        lambda: h.envelopes("heartbeat")[-1]["health"].get("listenerConnected") is False,
        what="a heartbeat with the listener disconnected",
    )
    relay.start()
    h.stop()
    wait_for(lambda: relay.listener_count(identity.hybrid_connection_name) == 0, what="the listener to close")
