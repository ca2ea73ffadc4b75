"""Every outbound call ends by its total deadline, however slowly the other side answers (issue 22). A server that
trickles its answer a byte at a time never lets a per-read timeout expire: it held a health gate, and the batch
waiting for it, for over two minutes. Each of the coordinator's outbound callers, pointed at such a server with a
deadline of 1 s, gives up within about that, naming the deadline."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from azure.core.credentials import AccessToken, AzureNamedKeyCredential, AzureSasCredential

from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.deadline import DeadlineExceeded, deadline, session
from coordinator.adapters.delivery_queue import DeliveryQueueError, QueuedDelivery, StorageQueueDeliveries
from coordinator.adapters.gates import AzureMonitorReader, GateReader
from coordinator.adapters.history import HistoryError, LogsIngestionHistory
from coordinator.adapters.relay_admin import HybridConnectionAdmin, RelayAdminError
from coordinator.adapters.relay_sender import RelayApprovalSender
from coordinator.adapters.remote_acknowledge import RemoteAcknowledgeSender
from coordinator.adapters.teams import AlertError, TeamsWebhookSink
from coordinator.domain.controls import AlertGate, Gate, HttpGate
from coordinator.domain.history_rows import dead_letter_row
from tests.coordinator.helpers import DOC_NOW, vm
from tests.loopback import SocketServer

# Within this of the deadline: a thread's wake-up and the shutdown of its socket, on a loaded 2-core machine.
SLACK = 1.5
VM = VmIdentity.model_validate(vm("web_0", index=1))


class Answering(SocketServer):
    """An HTTP server on loopback that counts its requests and gives each connection to ``answer`` on a thread of its
    own, after reading the request; the connection is closed after."""

    def __init__(self) -> None:
        self.requests = 0
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def handle(self, connection: socket.socket) -> None:
        threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        self.requests += 1
        try:
            connection.recv(65536)
            self.answer(connection)
        except OSError:
            pass
        finally:
            connection.close()

    def answer(self, connection: socket.socket) -> None:
        raise NotImplementedError


class Trickle(Answering):
    """Answers every request a byte every 0.2 s (a 200 with a body that never seems to end, for 30 s): each read gets
    a byte well within any per-read timeout. ``stall_after``: sends that many bytes of the answer at once, then
    nothing for 10 s."""

    def __init__(self, stall_after: int | None = None) -> None:
        self.stall_after = stall_after
        super().__init__()

    def answer(self, connection: socket.socket) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n" + b" " * 200
        if self.stall_after is not None:
            connection.sendall(answer[: self.stall_after])
            time.sleep(10)
            return
        for byte in answer:
            connection.sendall(bytes([byte]))
            time.sleep(0.2)


@pytest.fixture
def trickle() -> Iterator[Trickle]:
    server = Trickle()
    yield server
    server.close()


@pytest.fixture
def stall() -> Iterator[Trickle]:
    """A health page that sends its status line and one header, then stalls inside its headers."""
    server = Trickle(stall_after=len(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"))
    yield server
    server.close()


class Token:
    """Stands in for the managed identity."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        return AccessToken("stand-in", int(time.time()) + 3600)


def admin_at(url: str) -> HybridConnectionAdmin:
    """The hybrid connections' ARM client against ``url``, each call within a deadline of 1 s."""
    return HybridConnectionAdmin(
        credential=Token(),
        subscription_id="sub-1",
        resource_group="rg",
        namespace="relay",
        arm=ArmOptions(endpoint=url, deadline_seconds=1),
    )


def timed(call: Any) -> tuple[float, Any]:
    started = time.monotonic()
    try:
        result = call()
    except Exception as error:  # the caller's own error, which the test reads
        result = error
    return time.monotonic() - started, result


def request() -> ApprovalRequest:
    return ApprovalRequest(
        eventId="EV-" + uuid.uuid4().hex,
        decisionId=str(uuid.uuid4()),
        rule="test",
        issuedAt=DOC_NOW,
        expiresAt=DOC_NOW + timedelta(days=36500),
        facts=ApprovalFacts(
            eventType="Freeze", eventSource="Platform", durationInSeconds=5, notBefore=None, resources=["web_0"]
        ),
    )


def test_the_deadline_cuts_a_trickling_answer_that_per_read_timeouts_let_through(trickle):
    match = r"trickle: no complete answer within its total deadline of 1 s"
    with pytest.raises(DeadlineExceeded, match=match), deadline(1.0, "trickle"):
        session().get(trickle.url, timeout=0.5)


def test_a_request_made_after_the_deadline_fails_before_it_is_sent(trickle):
    """The block's deadline passed before its request was made (a slow token, a retry's backoff, a starved thread):
    the connection is not open yet, so there is no socket to shut; the request must not run its course (a trickling
    answer held such a call for 55 s)."""

    def late() -> None:
        with deadline(0.2, "late"):
            time.sleep(0.4)
            session().get(trickle.url, timeout=5)

    elapsed, error = timed(late)
    assert elapsed < 0.4 + SLACK
    assert isinstance(error, DeadlineExceeded)
    assert "late: no complete answer" in str(error)
    assert trickle.requests == 0


def test_a_trickling_health_gate_is_an_error_at_its_timeout(trickle):
    elapsed, results = timed(
        lambda: GateReader({"health": Gate(http=HttpGate(url=trickle.url, timeoutSeconds=1))}).results(["health"])
    )
    assert elapsed < 1 + SLACK  # held a batch for over two minutes
    assert results["health"].state == "error"
    assert "total deadline of 1 s" in results["health"].detail


def test_an_answer_cut_inside_its_headers_is_no_answer(stall):
    """The deadline shuts the socket; http.client takes the end of the stream for the end of the headers, and a
    200 stood on a status line alone."""
    with pytest.raises(DeadlineExceeded, match="total deadline of 1 s"), deadline(1.0, "stall"):
        session().get(stall.url, timeout=5)


def test_a_health_gate_that_stalls_inside_its_headers_holds_at_its_timeout(stall):
    """It passed at its 5 s deadline: an expired deadline is an unreadable answer, whatever was received."""
    elapsed, results = timed(
        lambda: GateReader({"health": Gate(http=HttpGate(url=stall.url, timeoutSeconds=1))}).results(["health"])
    )
    assert elapsed < 1 + SLACK
    assert results["health"].state == "error"
    assert "total deadline of 1 s" in results["health"].detail


def test_a_trickling_azure_monitor_is_an_error_at_its_deadline(trickle):
    monitor = AzureMonitorReader(credential=Token(), arm_endpoint=trickle.url, deadline_seconds=1)
    rule = "/subscriptions/s/resourceGroups/rg/providers/microsoft.insights/metricAlerts/cpu"
    elapsed, results = timed(
        lambda: GateReader({"cpu": Gate(alert=AlertGate(alertRuleId=rule))}, monitor=monitor).results(["cpu"])
    )
    assert elapsed < 1 + SLACK
    assert results["cpu"].state == "error"
    assert "total deadline of 1 s" in results["cpu"].detail


def test_a_trickling_teams_webhook_fails_the_card_at_its_deadline(trickle):
    sink = TeamsWebhookSink(webhook_url=trickle.url + "/?sig=secret", deadline_seconds=1, sleep=lambda _: None)
    elapsed, error = timed(lambda: sink.send({"type": "AdaptiveCard"}, key="card-1"))
    assert elapsed < 1 + SLACK
    assert isinstance(error, AlertError)
    assert "no answer within the 1 s deadline" in str(error)
    assert "secret" not in str(error)


def test_a_trickling_logs_ingestion_gives_the_rows_back_at_its_deadline(trickle):
    sink = LogsIngestionHistory(
        endpoint=trickle.url, rule_id="dcr-1", credential=Token(), enforce_https=False, deadline_seconds=1
    )
    rows = [dead_letter_row(now=DOC_NOW, reason="r", details={})]
    elapsed, error = timed(lambda: sink.write(rows))
    assert elapsed < 1 + SLACK
    assert isinstance(error, HistoryError)  # the rows stay in the outbox for the timer


def test_a_trickling_relay_gives_up_the_approval_at_its_deadline(trickle):
    sender = RelayApprovalSender(
        endpoint=trickle.url,
        credential=AzureNamedKeyCredential("send", "key"),
        attempt_timeout=1,
        max_retry_seconds=1,
    )
    elapsed, error = timed(lambda: sender.send(request(), vm=VM))
    assert elapsed < 1 + SLACK
    assert isinstance(error, ApprovalDeliveryError)
    assert "total deadline of 1 s" in str(error)


def test_a_trickling_arm_gives_up_the_acknowledge_at_its_deadline(trickle):
    sender = RemoteAcknowledgeSender(credential=Token(), endpoint=trickle.url, deadline_seconds=1, attempt_timeout=1)
    elapsed, error = timed(lambda: sender.send(request(), vm=VM))
    assert elapsed < 1 + SLACK
    assert isinstance(error, ApprovalDeliveryError)
    assert "total deadline of 1 s" in str(error)


def test_a_trickling_arm_gives_up_the_hybrid_connection_call_at_its_deadline(trickle):
    admin = admin_at(trickle.url)
    elapsed, error = timed(lambda: admin.get("vm-1"))
    assert elapsed < 1 + SLACK
    assert isinstance(error, RelayAdminError)
    assert "total deadline of 1 s" in str(error)


def test_a_trickling_delivery_queue_fails_the_handover_at_its_deadline(trickle):
    """The timer takes an approval the queue did not take over: the run that hands it over waits no longer."""
    url = f"{trickle.url}/approval-deliveries"
    # A SAS: azure-core sends no bearer token over plain HTTP.
    sas = AzureSasCredential("sv=2019-02-02&sig=x")
    queue = StorageQueueDeliveries(queue_url=url, credential=sas, deadline_seconds=1)
    delivery = QueuedDelivery(eventId="EV-1", decisionId="d-1", handedOverAt=DOC_NOW)
    elapsed, error = timed(lambda: queue.put(delivery))
    assert elapsed < 1 + SLACK
    assert isinstance(error, DeliveryQueueError)
    assert "total deadline of 1 s" in str(error)


class Throttling(Answering):
    """Answers every request 429 Too Many Requests, Retry-After 30 s (ARM's and Storage's throttling)."""

    def answer(self, connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 30\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture
def throttling() -> Iterator[Throttling]:
    server = Throttling()
    yield server
    server.close()


def test_a_retry_after_longer_than_the_deadline_is_not_waited_out(throttling: Throttling) -> None:
    """azure-core's RetryPolicy sleeps a Retry-After whole (30 s here) before its next attempt; a wait that would
    outlast the call's deadline fails the call at once, naming the deadline."""
    admin = admin_at(throttling.url)
    elapsed, error = timed(lambda: admin.get("vm-1"))
    assert elapsed < SLACK  # at once, not at the deadline
    assert isinstance(error, RelayAdminError)
    assert "total deadline of 1 s" in str(error)
    assert throttling.requests == 1
    sas = AzureSasCredential("sv=2019-02-02&sig=x")
    queue = StorageQueueDeliveries(queue_url=f"{throttling.url}/deliveries", credential=sas, deadline_seconds=1)
    elapsed, error = timed(lambda: queue.put(QueuedDelivery(eventId="EV-1", decisionId="d-1", handedOverAt=DOC_NOW)))
    assert elapsed < SLACK
    assert isinstance(error, DeliveryQueueError)
    assert "total deadline of 1 s" in str(error)
    assert throttling.requests == 2
