"""Bad input over the wire, from a raw AMQP peer (proton's blocking client) since the SDK never sends it:
an undecodable transfer is rejected, set aside with its reason and counted; the stream around it is unaffected."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from azure.eventhub._pyamqp.utils import generate_sas_token
from proton import Delivery, Message, SSLDomain
from proton.utils import BlockingConnection, LinkDetached

from emulators.eventhubs import EventHubsEmulator
from emulators.tls import local_tls
from tests.emulators.eventhubs.conftest import HUB


def _connection(emulator: EventHubsEmulator) -> BlockingConnection:
    """A raw AMQP client (proton's), over TLS with the local CA as the SDK's. By the name ``localhost``: proton
    matches a peer's name against the certificate's DNS names only, not its IP address."""
    domain = SSLDomain(SSLDomain.MODE_CLIENT)
    domain.set_trusted_ca_db(str(local_tls().ca))
    domain.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
    return BlockingConnection(f"amqps://localhost:{emulator.port}", allowed_mechs="ANONYMOUS", ssl_domain=domain)


def _authorized_connection(emulator: EventHubsEmulator) -> BlockingConnection:
    connection = _connection(emulator)
    audience = f"sb://127.0.0.1:{emulator.port}/{HUB}"
    token = generate_sas_token(audience, emulator.sas_key_name, emulator.sas_key, int(time.time()) + 300)  # type: ignore[no-untyped-call]
    replies = connection.create_receiver("$cbs")
    connection.create_sender("$cbs").send(
        Message(
            id=uuid.uuid4(),
            body=token,
            properties={"operation": "put-token", "type": "servicebus.windows.net:sastoken", "name": audience},
        )
    )
    reply = replies.receive(timeout=5)
    status: dict[str, Any] = dict(reply.properties or {})
    assert status["status-code"] == 202
    return connection


def test_an_undecodable_transfer_is_rejected_set_aside_and_counted(emulator: EventHubsEmulator) -> None:
    connection = _authorized_connection(emulator)
    try:
        sender = connection.create_sender(f"{HUB}/Partitions/0")
        sender.send(Message(body=b"good-before"))
        link = sender.link
        garbage = b"\x00\x53\x75\xb0\x00\x00\xff\xff"  # a data section claiming 65535 bytes that are not there
        delivery = link.delivery("bad-1")
        link.stream(garbage)
        link.advance()
        connection.wait(lambda: delivery.settled, timeout=5)  # true once the peer settled it
        assert delivery.remote_state == Delivery.REJECTED
        sender.send(Message(body=b"good-after"))
    finally:
        connection.close()

    assert [event.body for event in emulator.events(HUB, 0)] == [b"good-before", b"good-after"]
    assert emulator.stats.deliveries_rejected == 1
    [rejected] = emulator.rejected()
    assert rejected.hub == HUB
    assert rejected.payload == garbage
    assert "undecodable" in rejected.reason


def test_a_link_without_a_token_is_refused(emulator: EventHubsEmulator) -> None:
    connection = _connection(emulator)
    try:
        with pytest.raises(LinkDetached, match="no valid CBS token"):
            connection.create_sender(HUB)
    finally:
        connection.close()
    assert emulator.stats.links_refused == 1
