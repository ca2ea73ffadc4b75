"""The production send path: `EventHubSink`, Event Hubs' REST API to the local Event Hubs emulator, with the VM's
managed identity from the IMDS emulator (audience and role checked) — including an outage (the emulator stopped),
with the spool replaying in order afterwards, and the events read back over AMQP as the coordinator reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import certifi
import pytest

from emulators.eventhubs import EventHubsEmulator, consumer_client
from emulators.imds import ImdsEmulator
from emulators.tls import TlsHTTPServer, local_tls
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
    consumer = consumer_client(eventhubs.connection_string(HUB), consumer_group="$Default")

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


def test_over_https_the_server_certificate_is_verified() -> None:
    """The sink verifies the server: one whose certificate the public CAs do not vouch for (the local CA's,
    emulators/tls.py) is refused; the same server, trusted through SSL_CERT_FILE alone (in a process of its own: the
    TLS context is made once per process), gets the batch over HTTPS."""
    received: list[bytes] = []

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.respond(201)

    server = TlsHTTPServer(("127.0.0.1", 0), Handler, context=local_tls().server_context())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    send = (
        "from forwarder.eventhub import EventHubSink; from forwarder.durable_state import SpooledEnvelope;"
        f"sink = EventHubSink(endpoint='https://{endpoint}', eventhub_name='hub', authorization=lambda: 'Bearer t');"
        "sink.send([SpooledEnvelope(1, 0, 'heartbeat', b'{}')], partition_key='pk'); print('sent')"
    )

    def send_trusting(cafile: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SSL_CERT_FILE": cafile}
        command = [sys.executable, "-c", send]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False, env=env)

    try:
        untrusted = send_trusting(certifi.where())
        assert untrusted.returncode != 0
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
        assert received == []
        trusted = send_trusting(str(local_tls().bundle))
        assert trusted.stdout.strip() == "sent", trusted.stderr[-1000:]
    finally:
        server.shutdown()
    assert json.loads(received[0]) == [{"Body": "{}", "BrokerProperties": {"PartitionKey": "pk"}}]
