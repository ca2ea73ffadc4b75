"""Raw HTTP on the sender port (bad requests, Expect: 100-continue, HEAD) and the control-message models."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

import pytest

from emulators.relay import RelayEmulator
from emulators.relay.messages import ControlMessageError, ResponseMessage, parse_listener_message
from tests.emulators.relay.raw import RawListener, raw_connection, sas


def _exchange(relay: RelayEmulator, data: bytes, *, wait_for_continue: bool = False, rest: bytes = b"") -> bytes:
    with raw_connection(relay) as conn:
        conn.sendall(data)
        if wait_for_continue:
            assert conn.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            conn.sendall(rest)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        return received


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NONSENSE\r\n\r\n", b"400"),
        (b"GET /vm-a HTTP/1.1\r\nbad header line\r\n\r\n", b"400"),
        (b"POST /vm-a HTTP/1.1\r\nContent-Length: -4\r\n\r\n", b"413"),
        (b"POST /vm-a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", b"400"),
        (b"GET /" + b"a" * (70 * 1024) + b" HTTP/1.1\r\n\r\n", b"431"),
        (b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nConnection: close\r\n\r\n", b"405"),
        (b"GET /$hc/vm-a HTTP/1.0\r\n\r\n", b"400"),
    ],
)
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_malformed_requests_get_a_clear_status(
    make_relay: Callable[..., RelayEmulator], request_bytes: bytes, status: bytes, tls: bool
) -> None:
    relay = make_relay(response_timeout=5.0, tls=tls)
    answer = _exchange(relay, request_bytes)
    assert answer.split(b" ", 2)[1] == status, answer[:200]
    assert b"TrackingId:" in answer
    assert relay.counters()["refused.http_request"] == 1


def test_expect_100_continue_and_head(relay: RelayEmulator) -> None:
    token = sas(relay, "vm-a").encode()

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        head = (
            b"POST /vm-a/x HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\nConnection: close\r\n"
            b"ServiceBusAuthorization: " + token + b"\r\n\r\n"
        )
        sending = asyncio.create_task(asyncio.to_thread(_exchange, relay, head, wait_for_continue=True, rest=b"hello"))
        incoming = await listener.next_request()
        assert incoming.body == b"hello"
        assert "expect" not in {name.lower() for name in incoming.request["requestHeaders"]}
        await listener.respond(incoming.request["id"], 200, b"done", headers={"X-Count": "1"})
        answer = await sending
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert answer.endswith(b"\r\n\r\ndone")

        head = b"HEAD /vm-a HTTP/1.1\r\nConnection: close\r\nServiceBusAuthorization: " + token + b"\r\n\r\n"
        sending = asyncio.create_task(asyncio.to_thread(_exchange, relay, head))
        incoming = await listener.next_request()
        assert incoming.request["method"] == "HEAD"
        await listener.respond(incoming.request["id"], 200, b"not sent")
        answer = await sending
        assert answer.endswith(b"\r\n\r\n")
        assert b"Content-Length: 8" in answer
        await listener.close()

    asyncio.run(scenario())


def test_response_message_accepts_the_documented_shapes() -> None:
    # The doc's example writes statusCode as a string; Node sends header values as numbers or arrays.
    message = parse_listener_message(
        json.dumps(
            {
                "response": {
                    "requestId": "r1",
                    "statusCode": "200",
                    "responseHeaders": {"Content-Length": 5, "Set-Cookie": ["a=1", "b=2"], "X-None": None},
                    "body": True,
                }
            }
        )
    )
    assert isinstance(message, ResponseMessage)
    assert message.status_code == 200
    assert message.response_headers == {"Content-Length": "5", "Set-Cookie": "a=1, b=2"}


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("[]", "exactly one of"),
        ('{"response": {}, "renewToken": {}}', "exactly one of"),
        ('{"ping": {}}', "unknown control message 'ping'"),
        ('{"response": {"statusCode": 200}}', "requestId"),
        ('{"response": {"requestId": "r", "statusCode": 504}}', "reserved for the service"),
        ('{"response": {"requestId": "r", "statusCode": 42}}', "statusCode"),
        ('{"renewToken": {"token": ""}}', "token"),
    ],
)
def test_invalid_listener_messages_name_the_problem(frame: str, reason: str) -> None:
    with pytest.raises(ControlMessageError, match=reason):
        parse_listener_message(frame)


def test_a_sender_that_half_closes_after_its_request_still_gets_the_answer(
    make_relay: Callable[..., RelayEmulator],
) -> None:
    # Plain TCP: TLS has no half-close (a FIN without close_notify ends the TLS session; asyncio then closes).
    relay = make_relay(response_timeout=5.0, tls=False)

    def half_closed_exchange() -> bytes:
        with raw_connection(relay) as conn:
            conn.sendall(b"GET /vm-a HTTP/1.1\r\nServiceBusAuthorization: " + sas(relay).encode() + b"\r\n\r\n")
            conn.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := conn.recv(65536):
                received += chunk
            return received

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = asyncio.create_task(asyncio.to_thread(half_closed_exchange))
        incoming = await listener.next_request()
        await listener.respond(incoming.request["id"], 200, b"answered")
        answer = await sending
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert answer.endswith(b"answered")
        await listener.close()

    asyncio.run(scenario())
