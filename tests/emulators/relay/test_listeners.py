"""Listener control channels: the 25-listener cap, renewToken, token expiry, deletion, known hybrid connections."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from websockets.exceptions import ConnectionClosed, InvalidStatus

from emulators.relay import RelayEmulator
from emulators.tokens import mint_token
from tests.emulators.relay.raw import RawListener, assert_deleted, http, round_trip, sas


def test_the_26th_listener_is_refused_and_a_freed_slot_is_reusable(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        token = sas(relay, "crowded")
        listeners = await asyncio.gather(*(RawListener.open(relay.listen_url("crowded"), token) for _ in range(25)))
        assert relay.listener_count("crowded") == 25
        with pytest.raises(InvalidStatus) as refused:
            await RawListener.open(relay.listen_url("crowded"), token)
        assert refused.value.response.status_code == 403
        assert b"QuotaExceeded" in refused.value.response.body
        # Other hybrid connections are not affected by one being full.
        other = await RawListener.on(relay, "quiet")
        await listeners[0].close()
        for _ in range(100):
            if relay.listener_count("crowded") == 24:
                break
            await asyncio.sleep(0.01)
        replacement = await RawListener.open(relay.listen_url("crowded"), token)
        assert relay.listener_count("crowded") == 25
        for listener in [*listeners[1:], other, replacement]:
            await listener.close()

    asyncio.run(scenario())
    assert relay.counters()["refused.listener"] == 1


def test_concurrent_handshakes_cannot_exceed_the_cap(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        token = sas(relay, "race")
        results = await asyncio.gather(
            *(RawListener.open(relay.listen_url("race"), token) for _ in range(30)), return_exceptions=True
        )
        opened = [item for item in results if isinstance(item, RawListener)]
        refused = [item for item in results if isinstance(item, InvalidStatus)]
        assert (len(opened), len(refused)) == (25, 5)
        assert {item.response.status_code for item in refused} == {403}
        for listener in opened:
            await listener.close()

    asyncio.run(scenario())


def test_idle_control_channel_is_closed_with_1008_when_its_token_expires(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay, ttl=2.0)
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(listener.ws.recv(), 5)
        assert listener.ws.close_code == 1008
        assert "expired" in (listener.ws.close_reason or "")

    asyncio.run(scenario())


def test_renew_token_keeps_the_channel_open_past_the_first_expiry(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay, ttl=2.0)
        await listener.ws.send(json.dumps({"renewToken": {"token": sas(relay, "vm-a", ttl=60)}}))
        # No reply to a successful renewal; the channel outlives the first token and still serves requests.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(listener.ws.recv(), 2.5)
        assert (await round_trip(relay, listener, 200, b"still here")).content == b"still here"
        await listener.close()

    asyncio.run(scenario())


def test_renew_token_with_an_entra_token(relay: RelayEmulator) -> None:
    token, _ = mint_token(audience="https://relay.azure.net", identity_resource_id="/vm/a", lifetime_seconds=2)

    async def scenario() -> None:
        listener = await RawListener.open(relay.listen_url("vm-a"), token)
        fresh, _ = mint_token(audience="https://relay.azure.net", identity_resource_id="/vm/a", lifetime_seconds=60)
        await listener.ws.send(json.dumps({"renewToken": {"token": fresh}}))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(listener.ws.recv(), 3.0)
        await listener.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", ["not-a-token", "wrong-key", "other-path", "expired"])
def test_invalid_renew_token_closes_the_channel_with_1008(relay: RelayEmulator, bad: str) -> None:
    replacement = {
        "not-a-token": "not-a-token",
        "wrong-key": sas(relay, "vm-a", key="wrong"),
        "other-path": sas(relay, "vm-b"),
        "expired": sas(relay, "vm-a", ttl=-1),
    }[bad]

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        await listener.ws.send(json.dumps({"renewToken": {"token": replacement}}))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(listener.ws.recv(), 5)
        assert listener.ws.close_code == 1008
        assert "renewToken refused" in (listener.ws.close_reason or "")

    asyncio.run(scenario())
    assert relay.counters()["refused.renew_token"] == 1


def test_deleting_a_hybrid_connection_closes_its_listeners_with_1001(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        doomed = [await RawListener.on(relay, "vm-gone") for _ in range(2)]
        survivor = await RawListener.on(relay, "vm-kept")
        response = await http("DELETE", relay.base_url + "/_emulator/hybridConnections/vm-gone")
        assert response.status_code == 200
        for listener in doomed:
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(listener.ws.recv(), 5)
            assert listener.ws.close_code == 1001
        assert relay.listener_count("vm-kept") == 1
        assert (await http("DELETE", relay.base_url + "/_emulator/hybridConnections/vm-gone")).status_code == 404
        await survivor.close()

    asyncio.run(scenario())


def test_require_known_serves_only_declared_hybrid_connections(make_relay) -> None:
    relay: RelayEmulator = make_relay(require_known=True, hybrid_connections=("vm-0",))
    control = relay.base_url + "/_emulator/hybridConnections/"

    async def scenario() -> None:
        with pytest.raises(InvalidStatus) as refused:
            await RawListener.on(relay, "vm-1")
        assert refused.value.response.status_code == 404
        assert (await http("GET", relay.send_url("vm-1"), headers={"Authorization": sas(relay)})).status_code == 404

        created = await http("PUT", control + "vm-1")
        assert created.status_code == 201
        assert created.json() == {
            "name": "vm-1",
            "declared": True,
            "requiresClientAuthorization": True,
            "listenerCount": 0,
        }
        assert (await http("PUT", control + "vm-1")).status_code == 200
        listener = await RawListener.on(relay, "vm-1")
        assert (await http("GET", control + "vm-1")).json()["listenerCount"] == 1
        listing = (await http("GET", control.rstrip("/"))).json()
        assert sorted(item["name"] for item in listing) == ["vm-0", "vm-1"]

        assert (await http("DELETE", control + "vm-1")).status_code == 200
        await assert_deleted(relay, listener, "vm-1")

    asyncio.run(scenario())


def test_control_api_refuses_bad_input(relay: RelayEmulator) -> None:
    control = relay.base_url + "/_emulator/hybridConnections/"
    assert requests.put(control + "bad%20name", timeout=5).status_code == 400
    assert requests.put(control + "vm-x", data=b"[1]", timeout=5).status_code == 400
    assert requests.put(control + "vm-x", json={"requiresClientAuthorization": "yes"}, timeout=5).status_code == 400
    assert requests.post(control + "vm-x", timeout=5).status_code == 405
    assert requests.get(control + "vm-x", timeout=5).status_code == 404
    assert relay.counters()["refused.control_api"] == 3


def test_unknown_control_messages_and_stray_frames_are_counted_not_fatal(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        await listener.ws.send('{"hello": {}}')
        await listener.ws.send("{not json")
        await listener.ws.send(b"stray bytes")
        await listener.ws.send(json.dumps({"response": {"requestId": "nobody", "statusCode": 200, "body": False}}))
        assert (await round_trip(relay, listener, 200, b"fine")).content == b"fine"
        await listener.close()

    asyncio.run(scenario())
    assert relay.counters()["refused.listener_frame"] == 4
