"""The broker's TLS over memory buffers (emulators/eventhubs/tls_pipe.py) against a real client TLS session, and AMQP
over TLS as the SDK's clients and a hostile one meet it."""

from __future__ import annotations

import socket
import ssl

import certifi
import pytest
from azure.eventhub import EventData, EventHubProducerClient
from azure.eventhub.exceptions import ConnectError

from emulators.eventhubs import EventHubsEmulator, client_options
from emulators.eventhubs.tls_pipe import TlsPipe
from emulators.tls import local_tls
from tests.emulators.eventhubs.conftest import FAST_CLIENT, HUB, producer
from tests.polling import wait_for


class _Client:
    """A client TLS session over memory buffers, trusting the local CA, wired to a pipe by hand."""

    def __init__(self, pipe: TlsPipe, cafile: str) -> None:
        self.pipe = pipe
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        context = ssl.create_default_context(cafile=cafile)
        self.session = context.wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        self.received = bytearray()  # plaintext the pipe handed to "proton"

    def exchange(self) -> None:
        """Moves every pending record both ways until neither side has more to say."""
        for _ in range(20):
            to_server = self.outgoing.read()
            if to_server:
                self.received += self.pipe.receive(to_server)
            to_client = self.pipe.outgoing()
            if to_client:
                self.incoming.write(to_client)
            if not to_server and not to_client:
                return

    def handshake(self) -> None:
        for _ in range(20):
            try:
                self.session.do_handshake()
                return
            except ssl.SSLWantReadError:
                self.exchange()
        raise AssertionError("no handshake")

    def read(self) -> bytes:
        self.exchange()
        data = bytearray()
        while True:
            try:
                data += self.session.read(65536)
            except ssl.SSLWantReadError:
                return bytes(data)


def test_plaintext_crosses_both_ways_and_what_proton_wrote_early_waits_for_the_handshake() -> None:
    pipe = TlsPipe(local_tls().server_context())
    client = _Client(pipe, str(local_tls().ca))
    pipe.send(b"AMQP\x03\x01\x00\x00")  # proton's header, written before any TLS record arrived
    assert pipe.outgoing() == b""  # nothing in the clear, and no application data before the handshake
    client.handshake()
    client.exchange()  # the client's Finished, which completes the server's side
    assert pipe.ready
    assert client.read() == b"AMQP\x03\x01\x00\x00"
    body = bytes(range(256)) * 400  # 100 KiB: several TLS records (16 KiB each)
    client.session.write(body)
    client.exchange()
    assert bytes(client.received) == body
    with pytest.raises(ssl.SSLWantReadError):
        client.session.unwrap()  # sends close_notify, then waits for the server's
    client.exchange()
    assert pipe.closed


def test_a_client_that_does_not_trust_the_certificate_fails_the_handshake_with_an_error() -> None:
    pipe = TlsPipe(local_tls().server_context())
    client = _Client(pipe, certifi.where())
    with pytest.raises(ssl.SSLCertVerificationError):
        client.handshake()
    # The client's alert reaches the server: its next receive raises, which the broker counts and drops.
    with pytest.raises(ssl.SSLError):
        pipe.receive(client.outgoing.read())


def test_an_sdk_client_with_only_the_public_cas_is_refused_and_counted(emulator: EventHubsEmulator) -> None:
    options = {**client_options(emulator.connection_string()), "connection_verify": certifi.where()}
    untrusting = EventHubProducerClient.from_connection_string(
        emulator.connection_string(HUB), **{**FAST_CLIENT, "retry_total": 0, **options}
    )
    with untrusting, pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusting.send_batch([EventData("refused")])
    wait_for(lambda: emulator.stats.tls_refused == 1, what="the refused handshake counted")
    with producer(emulator.connection_string(HUB)) as client:
        client.send_batch([EventData("trusted")], partition_id="0")
    assert [event.body for event in emulator.all_events(HUB)] == [b"trusted"]


def test_plain_amqp_on_the_tls_port_is_not_answered_and_a_silent_peer_holds_up_no_one(
    emulator: EventHubsEmulator,
) -> None:
    silent = socket.create_connection(("127.0.0.1", emulator.port), timeout=10)  # connects, never says a word
    plain = socket.create_connection(("127.0.0.1", emulator.port), timeout=10)
    try:
        plain.sendall(b"AMQP\x03\x01\x00\x00")  # SASL header in the clear, as UseDevelopmentEmulator would send
        assert plain.recv(64) == b""  # dropped without a byte of AMQP
        wait_for(lambda: emulator.stats.tls_refused == 1, what="the plain client counted")
        with producer(emulator.connection_string(HUB)) as client:
            client.send_batch([EventData("while one waits")], partition_id="1")
        assert [event.body for event in emulator.events(HUB, 1)] == [b"while one waits"]
    finally:
        silent.close()
        plain.close()
