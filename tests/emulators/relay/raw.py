"""A raw Hybrid Connections listener on ``websockets`` (the protocol spelled out, no library), for the tests."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
import requests
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from emulators.relay import RelayEmulator, create_sas_token

KEY_NAME = "RootManageSharedAccessKey"
KEY = "local-test-key-not-a-secret"


def sas(relay: RelayEmulator, path: str = "", *, key_name: str = KEY_NAME, key: str = KEY, ttl: float = 3600) -> str:
    return create_sas_token(relay.resource_uri(path), key_name=key_name, key=key, expires_in=ttl)


@dataclass
class Incoming:
    request: dict[str, Any]
    body: bytes


class RawListener:
    """One control channel. ``next_request`` reads a ``request`` (and its body); ``respond`` answers it."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    @classmethod
    async def on(cls, relay: RelayEmulator, path: str = "vm-a", *, ttl: float = 3600) -> RawListener:
        """A listener on ``path`` with a valid token for it."""
        return await cls.open(relay.listen_url(path), sas(relay, path, ttl=ttl))

    @classmethod
    async def open(cls, url: str, token: str | None, *, in_query: bool = False) -> RawListener:
        headers = {}
        if token is not None and in_query:
            url += "&sb-hc-token=" + quote(token, safe="")
        elif token is not None:
            headers["ServiceBusAuthorization"] = token
        return cls(await connect(url, additional_headers=headers, max_size=None))

    async def next_message(self) -> dict[str, Any]:
        frame = await self.ws.recv()
        assert isinstance(frame, str), f"expected a control message, got {len(frame)} binary bytes"
        message: dict[str, Any] = json.loads(frame)
        return message

    async def next_request(self) -> Incoming:
        request = (await self.next_message())["request"]
        body = b""
        if request.get("body"):
            frame = await self.ws.recv()
            assert isinstance(frame, bytes)
            body = frame
        return Incoming(request, body)

    async def respond(
        self,
        request_id: str,
        status: int = 200,
        body: bytes = b"",
        *,
        headers: dict[str, str] | None = None,
        ws: ClientConnection | None = None,
        fragments: int = 1,
    ) -> None:
        channel = ws or self.ws
        response = {"requestId": request_id, "statusCode": status, "responseHeaders": headers or {}, "body": True}
        await channel.send(json.dumps({"response": response}))
        if fragments == 1:
            await channel.send(body)
        else:
            # Fragmented, ending with an empty final fragment the way hyco-https ends a response.
            step = max(1, len(body) // fragments)
            await channel.send([body[i : i + step] for i in range(0, len(body), step)] + [b""])

    async def close(self) -> None:
        await self.ws.close()


def raw_connection(relay: RelayEmulator, *, timeout: float = 10) -> socket.socket:
    """A socket to the relay's port for bytes spelled out by hand: through TLS (verified with the usual CA settings,
    tests/conftest.py) when the relay serves it, as it does by default."""
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=timeout)
    if relay.base_url.startswith("https://"):
        return ssl.create_default_context().wrap_socket(conn, server_hostname="127.0.0.1")
    return conn


async def http(method: str, url: str, **kwargs: Any) -> requests.Response:
    """A real HTTP request from a worker thread, so that listeners on this loop keep running."""
    kwargs.setdefault("timeout", 20)
    return await asyncio.to_thread(requests.request, method, url, **kwargs)


def send_get(relay: RelayEmulator, path: str = "vm-a") -> asyncio.Task[requests.Response]:
    """A sender's GET to ``path`` with a valid token, under way: its response is awaited later, while a listener on
    this loop takes the request."""
    return asyncio.create_task(http("GET", relay.send_url(path), headers={"Authorization": sas(relay)}))


async def round_trip(
    relay: RelayEmulator, listener: RawListener, status: int = 200, body: bytes = b"", *, fragments: int = 1
) -> requests.Response:
    """One GET to vm-a through the relay, answered by ``listener`` with ``status`` and ``body``: what the sender
    got."""
    sending = send_get(relay)
    incoming = await listener.next_request()
    await listener.respond(incoming.request["id"], status, body, fragments=fragments)
    return await sending


async def assert_deleted(relay: RelayEmulator, listener: RawListener, path: str) -> None:
    """``path``'s hybrid connection is gone: its listener's control channel was closed with 1001 (going away) and a
    new listener is refused with 404."""
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(listener.ws.recv(), 5)
    assert listener.ws.close_code == 1001
    with pytest.raises(InvalidStatus) as refused:
        await RawListener.on(relay, path)
    assert refused.value.response.status_code == 404
