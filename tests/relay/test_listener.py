"""RelayListener protocol behaviour against the Relay emulator: reconnects, token renewal, rendezvous, accept."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect
from websockets.sync.server import ServerConnection, serve

from contracts.sas import sas_token
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from emulators.relay.auth import create_sas_token
from forwarder.relay_listener import RelayListener
from forwarder.relay_protocol import RelayRequest, RelayResponse
from forwarder.relay_tokens import RelayToken
from tests.polling import wait_for
from tests.relay.conftest import LISTEN_KEY, SEND_KEY, VM_A0, Vm, approval, scheduled_event


def send(relay: RelayEmulator, hc: str, path: str, body: bytes = b"", method: str = "POST") -> requests.Response:
    token = create_sas_token(relay.resource_uri(hc), key_name="send", key=SEND_KEY)
    return requests.request(
        method, f"{relay.base_url}/{hc}{path}", data=body, headers={"ServiceBusAuthorization": token}, timeout=10
    )


def echo(request: RelayRequest) -> RelayResponse:
    if request.path == "/big":
        return RelayResponse(200, "OK", {"Content-Type": "application/octet-stream"}, b"y" * 200_000)
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path == "/slow":
        time.sleep(0.5)
    if request.path == "/gateway":
        return RelayResponse(502, "Bad Gateway")
    headers = {"X-Path": request.path, "X-Method": request.method, "X-Query": request.target.partition("?")[2]}
    return RelayResponse(201, "Created", headers, request.body[::-1])


class ShortLivedSas:
    """Namespace-scoped SAS tokens that live 3 s, so the relay closes the channel (1008) unless they are renewed."""

    def __init__(self, relay: RelayEmulator) -> None:
        self.relay = relay
        self.issued = 0

    def get_token(self) -> RelayToken:
        self.issued += 1
        expires_on = int(time.time()) + 3
        token = sas_token(resource_uri=self.relay.resource_uri(), key_name="listen", key=LISTEN_KEY,
                          expires_on=expires_on)  # fmt: skip
        return RelayToken(token, expires_on)


def test_requests_and_bodies_round_trip(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    vm = start_vm(VM_A0, auth="sas", handler=echo)
    hc = vm.identity.hybrid_connection_name
    body = bytes(range(256)) * 200  # 51 kB: on the control channel, sent by the relay as several fragments
    response = send(relay, hc, "/some/path?x=1&sb-hc-id=trace", body)
    assert response.status_code == 201
    assert response.content == body[::-1]
    assert response.headers["X-Path"] == "/some/path"
    assert response.headers["X-Method"] == "POST"
    assert response.headers["X-Query"] == "x=1"  # sb-hc-* parameters are the relay's, not ours
    assert vm.listener.stats.rendezvous == 0


def test_large_requests_and_responses_use_rendezvous(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    vm = start_vm(VM_A0, auth="sas", handler=echo)
    hc = vm.identity.hybrid_connection_name
    body = b"z" * 150_000
    response = send(relay, hc, "/upload", body)
    assert response.status_code == 201
    assert response.content == body[::-1]
    assert vm.listener.stats.rendezvous == 1
    big = send(relay, hc, "/big", method="GET")
    assert big.status_code == 200
    assert big.content == b"y" * 200_000


def test_handler_failures_and_reserved_statuses_become_500(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    vm = start_vm(VM_A0, auth="sas", handler=echo)
    hc = vm.identity.hybrid_connection_name
    assert send(relay, hc, "/boom").status_code == 500
    assert send(relay, hc, "/gateway").status_code == 500
    assert vm.listener.stats.handler_errors == 1
    assert send(relay, hc, "/still-alive").status_code == 201


def test_listener_reconnects_after_the_relay_restarts(
    imds: ImdsEmulator, relay: RelayEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    vm = start_vm(VM_A0)
    hc = vm.identity.hybrid_connection_name
    relay.stop()
    assert wait_for(lambda: not vm.listener.connected)
    time.sleep(0.3)  # a few refused reconnect attempts while the relay is down
    relay.start()  # same port
    assert vm.listener.wait_connected(10)
    assert wait_for(lambda: relay.listener_count(hc) == 1)
    assert vm.listener.stats.connects == 2
    assert sender.send(approval(scheduled_event(imds, VM_A0)), vm=vm.identity).outcome == "approved"
    assert len(imds.approvals()) == 1


def test_token_is_renewed_before_it_expires(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    provider = ShortLivedSas(relay)
    vm = start_vm(VM_A0, token_provider=provider, handler=echo)
    time.sleep(4.5)  # longer than one token's life
    assert vm.listener.connected
    assert vm.listener.stats.connects == 1
    assert vm.listener.stats.token_renewals >= 2
    assert provider.issued == vm.listener.stats.token_renewals + 1
    assert send(relay, vm.identity.hybrid_connection_name, "/ping", b"abc").status_code == 201


def test_websocket_senders_are_declined(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    vm = start_vm(VM_A0, auth="sas", handler=echo)
    hc = vm.identity.hybrid_connection_name
    token = create_sas_token(relay.resource_uri(hc), key_name="send", key=SEND_KEY)
    with pytest.raises(InvalidStatus) as refused:
        connect(relay.connect_url(hc), additional_headers={"ServiceBusAuthorization": token}, open_timeout=10,
                legacy=True)  # fmt: skip
    assert refused.value.response.status_code == 403
    assert vm.listener.stats.declined_accepts == 1
    assert vm.listener.connected


def test_stop_closes_the_control_channel(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    vm = start_vm(VM_A0, auth="sas", handler=echo)
    hc = vm.identity.hybrid_connection_name
    assert relay.listener_count(hc) == 1
    started = time.monotonic()
    vm.listener.stop(timeout=5)
    assert time.monotonic() - started < 2
    assert not vm.listener.connected
    assert wait_for(lambda: relay.listener_count(hc) == 0)
    assert send(relay, hc, "/ping").status_code == 503


def test_stop_lets_a_request_in_flight_answer_first(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    release = threading.Event()

    def held(request: RelayRequest) -> RelayResponse:
        if request.path == "/held":
            release.wait(10)
        return echo(request)

    vm = start_vm(VM_A0, auth="sas", handler=held)
    hc = vm.identity.hybrid_connection_name
    answers: dict[str, int] = {}

    def call(path: str) -> None:
        answers[path] = send(relay, hc, path, b"x").status_code

    callers = [threading.Thread(target=call, args=("/held",))]
    callers[0].start()
    assert wait_for(lambda: vm.listener.stats.requests == 1)
    stopper = threading.Thread(target=vm.listener.stop, kwargs={"timeout": 10})
    stopper.start()
    assert wait_for(vm.listener._stopping.is_set)  # stop() has begun: it is waiting for /held
    # A message after stop() began ends the control loop while /held is still being handled: the channel stays
    # open until /held (and this one) have answered.
    callers.append(threading.Thread(target=call, args=("/ping",)))
    callers[1].start()
    assert wait_for(lambda: vm.listener.stats.requests == 2)
    release.set()
    stopper.join(10)
    for caller in callers:
        caller.join(10)
    assert answers == {"/held": 201, "/ping": 201}
    assert not vm.listener.connected


def test_refused_handshake_is_retried_with_backoff(relay: RelayEmulator, start_vm: Callable[..., Vm]) -> None:
    class Wrong:
        calls = 0

        def get_token(self) -> RelayToken:
            Wrong.calls += 1
            expires_on = int(time.time()) + 3600
            token = sas_token(resource_uri=relay.resource_uri(), key_name="listen", key="d3Jvbmc=",
                              expires_on=expires_on)  # fmt: skip
            return RelayToken(token, expires_on)

    with pytest.raises(AssertionError, match="did not connect"):
        start_vm(VM_A0, token_provider=Wrong(), handler=echo, wait=1.5)
    assert Wrong.calls >= 3  # kept trying, with backoff (capped at 0.5 s in these tests)


class StaticToken:
    def get_token(self) -> RelayToken:
        return RelayToken("SharedAccessSignature sr=x&sig=y&se=9999999999&skn=z", 9_999_999_999)


def test_garbage_from_the_relay_is_counted_and_skipped() -> None:
    """FAKE relay: the emulator never misbehaves, so a bare websockets server plays one that sends garbage before
    a valid request; the listener must set each bad frame aside, count it, and still answer the valid request."""
    answers: list[object] = []

    def misbehave(connection: ServerConnection) -> None:
        connection.send(b"\x00binary before any request")
        connection.send("this is not JSON")
        connection.send(json.dumps({"request": {"id": 5, "method": ["POST"]}}))
        connection.send(json.dumps({"request": {"id": "r1", "method": "POST", "requestTarget": "/vm-x/hi",
                                                 "requestHeaders": {}, "body": True}}))  # fmt: skip
        connection.send(b"payload")
        answers.append(json.loads(connection.recv(timeout=5)))
        answers.append(connection.recv(timeout=5))
        connection.recv(timeout=5)  # until the listener closes

    with serve(misbehave, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.socket.getsockname()[1]
        listener = RelayListener(
            endpoint=f"ws://127.0.0.1:{port}",
            hybrid_connection="vm-x",
            token_provider=StaticToken(),
            handler=echo,
        ).start()
        try:
            assert wait_for(lambda: len(answers) == 2)
        finally:
            listener.stop(timeout=5)
            server.shutdown()
    assert answers[0] == {
        "response": {
            "requestId": "r1",
            "statusCode": 201,
            "statusDescription": "Created",
            "responseHeaders": {"X-Path": "/hi", "X-Method": "POST", "X-Query": ""},
            "body": True,
        }
    }
    assert answers[1] == b"daolyap"
    assert listener.stats.protocol_errors == 3


def fake_relay(script: Callable[[ServerConnection], None]) -> Callable[[], None]:
    """Runs ``script`` as the relay's side of a control channel against a RelayListener (echo handler) until it
    returns; gives the function that stops both."""
    server = serve(script, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.socket.getsockname()[1]
    listener = RelayListener(
        endpoint=f"ws://127.0.0.1:{port}", hybrid_connection="vm-x", token_provider=StaticToken(), handler=echo
    ).start()

    def stop() -> None:
        listener.stop(timeout=5)
        server.shutdown()

    return stop


def request_frame(request_id: str, *, body: bool) -> str:
    wire = {"id": request_id, "method": "POST", "requestTarget": f"/vm-x/{request_id}", "requestHeaders": {}}
    return json.dumps({"request": {**wire, "body": body}})


def test_a_request_whose_body_is_not_a_binary_frame_is_refused_alone_and_the_next_is_answered() -> None:
    """FAKE relay: a request that announces a body, followed by the next request's text frame instead of it. The
    listener took that frame for the body: the first was answered with the second's JSON reversed, and the second
    was never answered. Each request is now framed on its own."""
    answers: dict[str, tuple[dict[str, Any], bytes]] = {}

    def script(connection: ServerConnection) -> None:
        connection.send(request_frame("r1", body=True))
        connection.send(request_frame("r2", body=True))  # where r1's body was due
        connection.send(b"second")
        # A request that is JSON but not a valid one, with an id to refuse it by; its body frame is set aside.
        connection.send(json.dumps({"request": {"id": "r3", "method": "POST", "requestHeaders": {"x": 5}}}))
        connection.send(b"orphan")
        connection.send(request_frame("r4", body=False))
        while len(answers) < 4:
            frame = json.loads(connection.recv(timeout=5))["response"]
            body = connection.recv(timeout=5) if frame["body"] else b""
            answers[frame["requestId"]] = (frame, body if isinstance(body, bytes) else body.encode())
        connection.recv(timeout=5)  # until the listener closes

    stop = fake_relay(script)
    try:
        assert wait_for(lambda: len(answers) == 4)
    finally:
        stop()
    assert answers["r1"][0]["statusCode"] == 400
    assert json.loads(answers["r1"][1]) == {"error": "the request's body did not arrive as one binary frame"}
    assert (answers["r2"][0]["statusCode"], answers["r2"][1]) == (201, b"dnoces")
    assert answers["r3"][0]["statusCode"] == 400
    assert json.loads(answers["r3"][1]) == {"error": "malformed request message"}
    assert answers["r4"][0]["statusCode"] == 201


def test_frames_that_are_not_websocket_end_the_channel_and_the_listener_connects_again() -> None:
    """A reserved opcode on the control channel (wsproto: "Invalid opcode 0x7"; seen once in a fresh-clone run)
    ended the listener's thread: the VM's approvals stopped until its forwarder restarted. Now the channel is failed
    and counted, and the listener connects again and answers."""
    connections: list[int] = []
    answers: list[object] = []

    def relay(connection: ServerConnection) -> None:
        connections.append(1)
        if len(connections) == 1:
            connection.socket.sendall(b"\x87\x00")  # FIN, opcode 7 (reserved), no payload
            connection.recv(timeout=5)  # until the listener fails the channel
            return
        connection.send(request_frame("r2", body=False))
        answers.append(json.loads(connection.recv(timeout=5)))
        connection.recv(timeout=5)

    stop = fake_relay(relay)
    try:
        assert wait_for(lambda: answers, timeout=15, what="an answer on the second channel")
    finally:
        stop()
    assert len(connections) >= 2
    assert answers[0]["response"]["requestId"] == "r2"  # type: ignore[index]
