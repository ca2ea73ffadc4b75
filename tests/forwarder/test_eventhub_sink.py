"""The production send path: `EventHubSink`, Event Hubs' REST API to the local Event Hubs emulator, with the VM's
managed identity from the IMDS emulator (audience and role checked) — including an outage (the emulator stopped),
with the spool replaying in order afterwards, and the events read back over AMQP as the coordinator reads them."""

from __future__ import annotations

import ipaddress
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator
from emulators.tokens import verify_token
from forwarder.credential import EVENTHUBS_SCOPE, RELAY_SCOPE, ImdsManagedIdentityCredential
from forwarder.durable_state import SpooledEnvelope
from forwarder.eventhub import EventHubSink
from forwarder.imds import ImdsClient, ImdsInvalidResponse
from forwarder.retry import RateLimiter
from forwarder.sinks import SinkError
from tests.forwarder.conftest import HUB, Harness, hub_envelopes
from tests.loopback import QuietHandler
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_batches_go_to_one_partition_in_order(eventhubs: EventHubsEmulator) -> None:
    sink = EventHubSink.from_connection_string(eventhubs.rest_connection_string(HUB))
    try:
        items = [SpooledEnvelope(i, i, "heartbeat", json.dumps({"sequence": i}).encode()) for i in range(5)]
        sink.send(items[:2], partition_key="/subscriptions/s/vm/a")
        sink.send(items[2:], partition_key="/subscriptions/s/vm/a")
    finally:
        sink.close()
    stored = eventhubs.all_events(HUB)
    assert [json.loads(e.body)["sequence"] for e in stored] == [0, 1, 2, 3, 4]
    assert {e.partition_key for e in stored} == {"/subscriptions/s/vm/a"}
    assert len({e.partition_id for e in stored}) == 1


def test_unreachable_hub_is_a_sink_error(eventhubs: EventHubsEmulator) -> None:
    connection_string = eventhubs.rest_connection_string(HUB)
    eventhubs.stop()
    sink = EventHubSink.from_connection_string(connection_string)
    try:
        with pytest.raises(SinkError, match="Event Hubs send failed"):
            sink.send([SpooledEnvelope(1, 0, "heartbeat", b"{}")], partition_key="pk")
    finally:
        sink.close()


def test_outage_spools_and_replays_in_order(
    imds: ImdsEmulator, eventhubs: EventHubsEmulator, harness: Callable[..., Harness]
) -> None:
    sink = EventHubSink.from_connection_string(eventhubs.rest_connection_string(HUB))
    h = harness(imds.url_for("web_0"), sink=sink, heartbeat_interval=0.3)
    wait_for(lambda: any(e["kind"] == "incarnation" for e in hub_envelopes(eventhubs)), what="first envelope")
    eventhubs.stop()
    for changes in (2, 3, 4):
        imds.create_event(EventType="Reboot", Resources=["web_1"], NoticeSeconds=900)
        wait_for(lambda: h.forwarder.counters["changes"] >= changes, what="a change while the hub is down")  # noqa: B023
    wait_for(lambda: h.store.depth() >= 3 and h.forwarder.counters["send_failures"] >= 1, what="a growing spool")
    eventhubs.start()  # same port: the producer reconnects, the sender's backoff brings it back
    wait_for(lambda: h.store.depth() == 0, timeout=30, what="the spool to drain")
    h.stop()
    delivered = hub_envelopes(eventhubs)
    sequences = [e["sequence"] for e in delivered]
    assert sequences == list(range(len(sequences))), "every envelope once, in order, none lost"
    incarnations = [e["document"]["DocumentIncarnation"] for e in delivered if e["kind"] == "incarnation"]
    assert incarnations == sorted(incarnations)
    assert incarnations[0] == 1
    assert incarnations[-1] == imds.document("web_0")["DocumentIncarnation"]


def test_managed_identity_from_imds_end_to_end(imds: ImdsEmulator, eventhubs: EventHubsEmulator) -> None:
    """The production auth path: an Entra token from the VM's IMDS token endpoint, put to the hub's CBS node."""
    imds_client = ImdsClient(base_url=imds.url_for("web_0"), limiter=RateLimiter(requests=100))
    credential = ImdsManagedIdentityCredential(imds=imds_client)
    sink = EventHubSink.with_credential(
        fully_qualified_namespace=eventhubs.rest_namespace, eventhub_name=HUB, credential=credential
    )
    try:
        sink.send([SpooledEnvelope(1, 0, "heartbeat", b'{"sequence":0}')], partition_key="pk")
    finally:
        sink.close()
    assert [json.loads(e.body) for e in eventhubs.all_events(HUB)] == [{"sequence": 0}]
    # The token is cached: a second request for the same scope does not go back to IMDS.
    before = imds.requests_served["web_0"]
    first = credential.get_token("https://eventhubs.azure.net//.default")
    assert credential.get_token("https://eventhubs.azure.net//.default") == first
    assert imds.requests_served["web_0"] == before


def test_user_assigned_identity_must_exist(imds: ImdsEmulator) -> None:
    imds_client = ImdsClient(base_url=imds.url_for("web_0"), limiter=RateLimiter(requests=100))
    credential = ImdsManagedIdentityCredential(imds=imds_client, client_id="00000000-0000-0000-0000-000000000000")
    with pytest.raises(ImdsInvalidResponse, match="Identity not found"):
        credential.get_token("https://eventhubs.azure.net//.default")


def test_a_token_for_another_audience_is_refused(imds: ImdsEmulator, eventhubs: EventHubsEmulator) -> None:
    """The emulator checks the audience as Event Hubs does: a Relay token is no Event Hubs token (401)."""
    imds_client = ImdsClient(base_url=imds.url_for("web_0"), limiter=RateLimiter(requests=100))
    relay_only = ImdsManagedIdentityCredential(imds=imds_client)

    class WrongAudience:
        def get_token(self, *scopes: str, **_: Any) -> Any:
            return relay_only.get_token(RELAY_SCOPE)

    sink = EventHubSink.with_credential(
        fully_qualified_namespace=eventhubs.rest_namespace, eventhub_name=HUB, credential=WrongAudience()
    )
    try:
        with pytest.raises(SinkError, match=r"401.*[Aa]udience"):
            sink.send([SpooledEnvelope(1, 0, "heartbeat", b"{}")], partition_key="pk")
    finally:
        sink.close()
    assert eventhubs.all_events(HUB) == []


def test_an_identity_without_the_data_sender_role_is_refused(imds: ImdsEmulator) -> None:
    """Role assignments as RBAC has them: web_0's identity holds "Azure Event Hubs Data Sender", another does not."""
    imds_client = ImdsClient(base_url=imds.url_for("web_0"), limiter=RateLimiter(requests=100))
    credential = ImdsManagedIdentityCredential(imds=imds_client)
    token = credential.get_token(EVENTHUBS_SCOPE).token
    identity = verify_token(token, audience="https://eventhubs.azure.net")["xms_mirid"]
    for senders, delivered in (([identity], 1), (["/subscriptions/s/someone-else"], 0)):
        with EventHubsEmulator(hubs={HUB: 2}, data_senders=senders) as emulator:
            sink = EventHubSink.with_credential(
                fully_qualified_namespace=emulator.rest_namespace,
                eventhub_name=HUB,
                credential=credential,
            )
            try:
                if delivered:
                    sink.send([SpooledEnvelope(1, 0, "heartbeat", b"{}")], partition_key="pk")
                else:
                    with pytest.raises(SinkError, match=r"403.*Data Sender"):
                        sink.send([SpooledEnvelope(1, 0, "heartbeat", b"{}")], partition_key="pk")
            finally:
                sink.close()
            assert len(emulator.all_events(HUB)) == delivered


def test_the_trace_context_travels_as_application_properties(eventhubs: EventHubsEmulator) -> None:
    """Read back over AMQP, as the coordinator's trigger reads it: the body, the key and the W3C properties."""
    from azure.eventhub import EventHubConsumerClient

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sink = EventHubSink.from_connection_string(eventhubs.rest_connection_string(HUB))
    try:
        sink.send(
            [SpooledEnvelope(1, 0, "incarnation", b'{"sequence":0}', traceparent=parent, tracestate="k=v")],
            partition_key="/subscriptions/s/vm/a",
        )
    finally:
        sink.close()
    received: list[Any] = []
    consumer = EventHubConsumerClient.from_connection_string(
        eventhubs.connection_string(HUB), consumer_group="$Default"
    )

    def on_event(_: Any, event: Any) -> None:
        if event is not None:
            received.append(event)

    with consumer:
        thread = threading.Thread(
            target=consumer.receive, kwargs={"on_event": on_event, "starting_position": "-1", "max_wait_time": 0.5}
        )
        thread.start()
        wait_for(lambda: bool(received), what="the event over AMQP")
        consumer.close()
        thread.join(10)
    event = received[0]
    assert event.body_as_json() == {"sequence": 0}
    assert event.partition_key == b"/subscriptions/s/vm/a"  # as the SDK gives it
    assert event.properties == {b"traceparent": parent.encode(), b"tracestate": b"k=v"}


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def test_over_https_the_server_certificate_is_verified(tmp_path: Path) -> None:
    """The production path speaks TLS (the emulators do not): a server the system CAs do not vouch for is refused;
    the same server, trusted (SSL_CERT_FILE, in a process of its own: the TLS context is made once per process),
    gets the batch over HTTPS."""
    cert_file, key_file = _self_signed(tmp_path)
    received: list[bytes] = []

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.respond(201)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    send = (
        "from forwarder.eventhub import EventHubSink; from forwarder.durable_state import SpooledEnvelope;"
        f"sink = EventHubSink(endpoint='https://{endpoint}', eventhub_name='hub', authorization=lambda: 'Bearer t');"
        "sink.send([SpooledEnvelope(1, 0, 'heartbeat', b'{}')], partition_key='pk'); print('sent')"
    )
    try:
        untrusted = subprocess.run(
            [sys.executable, "-c", send], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
        )
        assert untrusted.returncode != 0
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
        assert received == []
        trusted = subprocess.run(
            [sys.executable, "-c", send],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
            env={**os.environ, "SSL_CERT_FILE": str(cert_file)},
        )
        assert trusted.stdout.strip() == "sent", trusted.stderr[-1000:]
    finally:
        server.shutdown()
    assert json.loads(received[0]) == [{"Body": "{}", "BrokerProperties": {"PartitionKey": "pk"}}]
