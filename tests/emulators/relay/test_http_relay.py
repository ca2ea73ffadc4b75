"""HTTP senders through the emulator to a raw-protocol listener: control channel, rendezvous, deadlines, errors."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator

import pytest
import requests
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from emulators.relay import RelayEmulator
from tests.emulators.relay.raw import RawListener, http, round_trip, sas, send_get


def test_request_and_response_travel_on_the_control_channel(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = asyncio.create_task(
            http(
                "POST",
                relay.send_url("vm-a") + "/approve/E1?x=1&sb-hc-id=trace-1",
                data=b'{"EventId":"E1"}',
                headers={
                    "ServiceBusAuthorization": sas(relay, "vm-a"),
                    "Authorization": "Bearer end-to-end",
                    "X-Custom": "kept",
                    "Content-Type": "application/json",
                },
            )
        )
        incoming = await listener.next_request()
        request = incoming.request
        assert request["method"] == "POST"
        assert request["requestTarget"] == "/vm-a/approve/E1?x=1"
        assert request["body"] is True
        assert incoming.body == b'{"EventId":"E1"}'
        headers = {name.lower(): value for name, value in request["requestHeaders"].items()}
        # Relay auth and connection headers are stripped; end-to-end Authorization is the listener's business.
        assert "servicebusauthorization" not in headers
        assert {"host", "content-length", "connection"}.isdisjoint(headers)
        assert headers["authorization"] == "Bearer end-to-end"
        assert headers["x-custom"] == "kept"
        assert request["address"].startswith(f"wss://127.0.0.1:{relay.port}/$hc/vm-a?sb-hc-action=request")
        await listener.respond(
            request["id"], 202, b"approved", headers={"Content-Type": "text/plain", "Connection": "keep-alive"}
        )
        response = await sending
        assert response.status_code == 202
        assert response.content == b"approved"
        assert response.headers["Content-Type"] == "text/plain"
        assert response.headers["Via"] == f"1.1 127.0.0.1:{relay.port}"
        await listener.close()

    asyncio.run(scenario())


def test_authorization_header_carrying_the_relay_token_is_stripped(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = asyncio.create_task(
            http("GET", relay.send_url("vm-a"), headers={"Authorization": sas(relay, "vm-a")})
        )
        incoming = await listener.next_request()
        assert "authorization" not in {name.lower() for name in incoming.request["requestHeaders"]}
        assert incoming.request["body"] is False
        await listener.respond(incoming.request["id"], 204)
        assert (await sending).status_code == 204
        await listener.close()

    asyncio.run(scenario())


def test_fragmented_response_body_is_reassembled(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        response = await round_trip(relay, listener, 200, b"0123456789" * 300, fragments=7)
        assert response.content == b"0123456789" * 300
        await listener.close()

    asyncio.run(scenario())


def test_large_request_is_announced_and_delivered_over_rendezvous(relay: RelayEmulator) -> None:
    payload = bytes(range(256)) * 400  # 100 kB: above the 64 kB control-channel limit

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = asyncio.create_task(
            http("PUT", relay.send_url("vm-a") + "/blob", data=payload, headers={"Authorization": sas(relay)})
        )
        announcement = (await listener.next_message())["request"]
        assert set(announcement) == {"address", "id"}
        async with connect(announcement["address"], max_size=None) as rendezvous:
            frame = await rendezvous.recv()
            assert isinstance(frame, str)
            request = json.loads(frame)["request"]
            assert request["method"] == "PUT"
            assert request["id"] == announcement["id"]
            body = await rendezvous.recv()
            assert body == payload
            await listener.respond(request["id"], 201, b"stored", ws=rendezvous)
            response = await sending
        assert response.status_code == 201
        assert response.content == b"stored"
        await listener.close()

    asyncio.run(scenario())


def test_listener_may_answer_a_control_channel_request_over_rendezvous(relay: RelayEmulator) -> None:
    big = b"x" * (200 * 1024)

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = asyncio.create_task(
            http("GET", relay.send_url("vm-a"), headers={"Authorization": sas(relay), "Connection": "close"})
        )
        incoming = await listener.next_request()
        async with connect(incoming.request["address"], max_size=None) as rendezvous:
            await listener.respond(incoming.request["id"], 200, big, ws=rendezvous)
            response = await sending
            # The socket lives as long as the sender's connection, which ends here ("Connection: close").
            await asyncio.wait_for(rendezvous.wait_closed(), 5)
            assert rendezvous.close_code == 1001
        assert response.content == big
        # The rendezvous address is single-use.
        with pytest.raises(InvalidStatus) as refused:
            await connect(incoming.request["address"])
        assert refused.value.response.status_code == 403
        await listener.close()

    asyncio.run(scenario())


def test_later_requests_of_a_sender_connection_follow_its_rendezvous_socket(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        with requests.Session() as session:
            session.headers["Authorization"] = sas(relay)
            sending = asyncio.create_task(asyncio.to_thread(session.get, relay.send_url("vm-a") + "/1", timeout=10))
            first = await listener.next_request()
            rendezvous = await connect(first.request["address"], max_size=None)
            await listener.respond(first.request["id"], 200, b"one", ws=rendezvous)
            assert (await sending).content == b"one"

            # Same TCP connection: the request arrives on the rendezvous socket, not on the control channel.
            sending = asyncio.create_task(asyncio.to_thread(session.post, relay.send_url("vm-a") + "/2", data=b"b2"))
            second = json.loads(await rendezvous.recv())["request"]
            assert (second["requestTarget"], second["method"], second["body"]) == ("/vm-a/2", "POST", True)
            assert "address" not in second
            assert await rendezvous.recv() == b"b2"
            await listener.respond(second["id"], 201, b"two", ws=rendezvous)
            assert (await sending).status_code == 201

            # The listener drops the rendezvous: the service drops the sender's connection, and the sender's
            # next connection starts again on the control channel.
            await rendezvous.close()
            await asyncio.sleep(0.2)
            sending = asyncio.create_task(asyncio.to_thread(session.get, relay.send_url("vm-a") + "/3", timeout=10))
            third = await listener.next_request()
            assert third.request["requestTarget"] == "/vm-a/3"
            await listener.respond(third.request["id"], 200, b"three")
            assert (await sending).content == b"three"
        await listener.close()

    asyncio.run(scenario())
    assert relay.counters()["rendezvous.response"] == 1


def test_no_listener_answers_503_without_via(relay: RelayEmulator) -> None:
    response = asyncio.run(http("GET", relay.send_url("nobody-home"), headers={"Authorization": sas(relay)}))
    assert response.status_code == 503
    assert "Via" not in response.headers
    assert "no listener" in response.text


def test_listener_that_does_not_respond_yields_504(make_relay) -> None:
    relay = make_relay(response_timeout=0.4)

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        response = await http("GET", relay.send_url("vm-a"), headers={"Authorization": sas(relay)})
        assert response.status_code == 504
        assert "Via" not in response.headers
        await listener.close()

    asyncio.run(scenario())


def test_listener_answering_502_or_garbage_is_a_protocol_error(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = send_get(relay)
        incoming = await listener.next_request()
        await listener.ws.send(json.dumps({"response": {"requestId": incoming.request["id"], "statusCode": 502}}))
        response = await sending
        assert response.status_code == 502
        assert "Via" not in response.headers
        assert "502 and 504 are reserved" in response.text

        sending = send_get(relay)
        incoming = await listener.next_request()
        await listener.ws.send('{"response": {"requestId": "' + incoming.request["id"] + '", "statusCode": "x"}}')
        assert (await sending).status_code == 502
        # The control channel survives bad frames: the next request is served normally.
        assert (await round_trip(relay, listener, 200, b"ok")).content == b"ok"
        await listener.close()

    asyncio.run(scenario())
    assert relay.counters()["refused.listener_frame"] == 2


def test_listener_disconnecting_mid_request_yields_502(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sending = send_get(relay)
        await listener.next_request()
        await listener.close()
        assert (await sending).status_code == 502

    asyncio.run(scenario())


def test_requests_are_spread_at_random_among_listeners(relay: RelayEmulator) -> None:
    async def scenario() -> Counter[int]:
        listeners = [await RawListener.on(relay, "fleet") for _ in range(3)]
        served: Counter[int] = Counter()

        async def serve(index: int, listener: RawListener) -> None:
            while True:
                incoming = await listener.next_request()
                served[index] += 1
                await listener.respond(incoming.request["id"], 200, str(index).encode())

        servers = [asyncio.create_task(serve(i, item)) for i, item in enumerate(listeners)]
        answers = [
            (await http("GET", relay.send_url("fleet"), headers={"Authorization": sas(relay)})).text for _ in range(45)
        ]
        for task in servers:
            task.cancel()
        for listener in listeners:
            await listener.close()
        assert Counter(int(answer) for answer in answers) == served
        return served

    served = asyncio.run(scenario())
    # 3 listeners x 45 requests: a listener left out entirely has probability 3 * (2/3)^45 < 1e-7.
    assert sorted(served) == [0, 1, 2]
    assert sum(served.values()) == 45


def test_response_body_above_64kb_on_the_control_channel_is_refused(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        response = await round_trip(relay, listener, 200, b"y" * (64 * 1024 + 1))
        assert response.status_code == 502
        assert "rendezvous" in response.text
        await listener.close()

    asyncio.run(scenario())


def test_chunked_or_header_heavy_requests_go_over_rendezvous(relay: RelayEmulator) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"part-1;"
        yield b"part-2"

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        cases: list[tuple[Iterator[bytes] | bytes, dict[str, str]]] = [
            (chunks(), {}),
            (b"small", {"X-Big": "h" * (33 * 1024)}),
        ]
        for data, extra in cases:
            headers = {"Authorization": sas(relay), **extra}
            sending = asyncio.create_task(http("POST", relay.send_url("vm-a"), headers=headers, data=data))
            announcement = (await listener.next_message())["request"]
            assert set(announcement) == {"address", "id"}
            async with connect(announcement["address"], max_size=None) as rendezvous:
                request = json.loads(await rendezvous.recv())["request"]
                body = await rendezvous.recv()
                assert isinstance(body, bytes)
                await listener.respond(request["id"], 200, b"echo:" + body, ws=rendezvous)
                response = await sending
            assert response.content in (b"echo:part-1;part-2", b"echo:small")
        await listener.close()

    asyncio.run(scenario())
    assert relay.counters()["rendezvous.request"] == 2


def test_an_injected_slow_listener_gets_the_request_late_and_a_dead_one_never(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        await asyncio.to_thread(relay.set_listener_fault, "vm-a", delay_seconds=0.5)
        started = asyncio.get_running_loop().time()
        sending = send_get(relay)
        incoming = await listener.next_request()
        assert asyncio.get_running_loop().time() - started >= 0.5
        await listener.respond(incoming.request["id"], 200)
        assert (await sending).status_code == 200
        await asyncio.to_thread(relay.set_listener_fault, "vm-a", dead=True)
        response = await http("GET", relay.send_url("vm-a"), headers={"Authorization": sas(relay)})
        assert response.status_code == 504  # the response timeout (5 s here); the listener saw nothing
        await asyncio.to_thread(relay.set_listener_fault, "vm-a")
        assert (await round_trip(relay, listener, 204)).status_code == 204
        await listener.close()

    asyncio.run(scenario())
