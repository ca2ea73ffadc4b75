"""WebSocket senders: the accept control message, the rendezvous accept socket, the bridge, reject → 410."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from emulators.relay import RelayEmulator
from tests.emulators.relay.raw import RawListener, sas


async def _connect_sender(relay: RelayEmulator, suffix: str = "", query: str = "") -> ClientConnection:
    url = relay.connect_url("vm-a" + suffix) + query + "&sb-hc-token=" + quote(sas(relay, "vm-a"), safe="")
    return await connect(url, additional_headers={"X-App": "approver"})


@asynccontextmanager
async def _bridged(
    relay: RelayEmulator, suffix: str = "", query: str = ""
) -> AsyncIterator[tuple[RawListener, dict[str, Any], ClientConnection, ClientConnection]]:
    """A sender to vm-a accepted by a listener there: (the listener, its accept message, the sender's socket, the
    accepted socket), the two sockets bridged; the listener's control channel is closed after."""
    listener = await RawListener.on(relay)
    sender_task = asyncio.create_task(_connect_sender(relay, suffix, query))
    accept = (await listener.next_message())["accept"]
    async with connect(accept["address"]) as accepted:
        yield listener, accept, await sender_task, accepted
    await listener.close()


def test_accepted_sender_is_bridged_to_the_listener(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        async with _bridged(relay, "/approve", "&round=3") as (_, accept, sender, accepted):
            assert accept["connectHeaders"]["X-App"] == "approver"
            assert "sb-hc-token" not in accept["address"]
            address = f"wss://127.0.0.1:{relay.port}/$hc/vm-a/approve?round=3&sb-hc-action=accept"
            assert accept["address"].startswith(address)
            await sender.send("approve E1")
            assert await accepted.recv() == "approve E1"
            await accepted.send(b"\x00done")
            assert await sender.recv() == b"\x00done"
            # The listener ends the conversation; the sender sees the same close code.
            await accepted.close(4000, "finished")
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(sender.recv(), 5)
            assert sender.close_code == 4000
            assert sender.close_reason == "finished"

    asyncio.run(scenario())
    assert relay.counters()["accepted"] == 1


def test_sender_closing_closes_the_listener_side(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        async with _bridged(relay) as (_, _, sender, accepted):
            await sender.close()
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(accepted.recv(), 5)
            assert accepted.close_code == 1000

    asyncio.run(scenario())


def test_rejecting_listener_gets_410_and_the_sender_gets_its_status(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sender_task = asyncio.create_task(_connect_sender(relay))
        accept = (await listener.next_message())["accept"]
        reject = accept["address"] + "&sb-hc-statusCode=409&sb-hc-statusDescription=" + quote("busy approving")
        with pytest.raises(InvalidStatus) as rejected:
            await connect(reject)
        assert rejected.value.response.status_code == 410
        with pytest.raises(InvalidStatus) as refused:
            await sender_task
        assert refused.value.response.status_code == 409
        assert refused.value.response.reason_phrase.startswith("busy approving")
        # The accept address was single-use.
        with pytest.raises(InvalidStatus) as again:
            await connect(accept["address"])
        assert again.value.response.status_code == 403
        await listener.close()

    asyncio.run(scenario())
    assert relay.counters()["rejected"] == 1


def test_sender_times_out_when_the_listener_never_accepts(make_relay) -> None:
    relay = make_relay(accept_timeout=0.5)

    async def scenario() -> None:
        listener = await RawListener.on(relay)
        with pytest.raises(InvalidStatus) as refused:
            await _connect_sender(relay)
        assert refused.value.response.status_code == 504
        assert "accept" in (await listener.next_message())
        await listener.close()

    asyncio.run(scenario())


def test_sender_without_listener_or_token_is_refused(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        with pytest.raises(InvalidStatus) as refused:
            await _connect_sender(relay)
        assert refused.value.response.status_code == 503
        with pytest.raises(InvalidStatus) as refused:
            await connect(relay.connect_url("vm-a"))
        assert refused.value.response.status_code == 401

    asyncio.run(scenario())


def test_deleting_the_hybrid_connection_closes_bridged_sockets_with_1001(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        async with _bridged(relay) as (listener, _, sender, accepted):
            relay_delete = asyncio.to_thread(relay.delete_hybrid_connection, "vm-a")
            assert await relay_delete
            for socket in (sender, accepted, listener.ws):
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(socket.recv(), 5)
                assert socket.close_code == 1001

    asyncio.run(scenario())


def test_unknown_actions_and_paths_are_refused(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        base = relay.ws_url
        for url, status in [
            (f"{base}/$hc/vm-a?sb-hc-action=dance", 400),
            (f"{base}/vm-a?sb-hc-action=listen", 404),
            (f"{base}/$hc/?sb-hc-action=listen", 404),
            (f"{base}/$hc/vm-a?sb-hc-action=accept&sb-hc-id=forged", 403),
            (f"{base}/$hc/vm-a?sb-hc-action=request&sb-hc-id=forged", 403),
        ]:
            with pytest.raises(InvalidStatus) as refused:
                await connect(url)
            assert refused.value.response.status_code == status, url

    asyncio.run(scenario())


def test_senders_sharing_an_sb_hc_id_get_separate_rendezvous(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        senders = [asyncio.create_task(_connect_sender(relay, query="&sb-hc-id=same")) for _ in range(2)]
        accepts = [(await listener.next_message())["accept"] for _ in range(2)]
        assert [item["id"] for item in accepts] == ["same", "same"]
        assert accepts[0]["address"] != accepts[1]["address"]
        accepted = [await connect(item["address"]) for item in accepts]
        connected = [await task for task in senders]
        for index, sender in enumerate(connected):
            await sender.send(f"from sender {index}")
        received = sorted([await accepted[0].recv(), await accepted[1].recv()])
        assert received == ["from sender 0", "from sender 1"]
        for socket in [*connected, *accepted]:
            await socket.close()
        await listener.close()

    asyncio.run(scenario())


def test_sender_gets_502_at_once_when_the_listener_leaves_before_accepting(relay: RelayEmulator) -> None:
    async def scenario() -> None:
        listener = await RawListener.on(relay)
        sender_task = asyncio.create_task(_connect_sender(relay))
        assert "accept" in await listener.next_message()
        await listener.close()
        with pytest.raises(InvalidStatus) as refused:
            await asyncio.wait_for(sender_task, 5)
        assert refused.value.response.status_code == 502

    asyncio.run(scenario())
