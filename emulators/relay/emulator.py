"""``RelayEmulator``: the Relay namespace emulator on a background thread, for tests and the local runner."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

from emulators.relay.auth import ALL_RIGHTS, Right, SasRule, TokenChecker
from emulators.relay.namespace import ACCEPT_TIMEOUT
from emulators.relay.server import RelayService
from emulators.served import Served
from emulators.tls import local_tls

_T = TypeVar("_T")


class RelayEmulator(Served):
    """An Azure Relay namespace with Hybrid Connections on 127.0.0.1, speaking the documented protocol.

    ``sas_keys`` maps SAS rule name → key; ``sas_rights`` optionally restricts a rule's rights (default: all).
    ``role_assignments`` maps an Entra identity (``xms_mirid``/``oid``) → rights; ``None`` lets any valid
    ``https://relay.azure.net`` token listen and send. ``require_known`` makes only declared hybrid connections
    (``create_hybrid_connection`` or ``PUT /_emulator/hybridConnections/{name}``) usable.
    """

    def __init__(
        self,
        *,
        sas_keys: Mapping[str, str] | None = None,
        sas_rights: Mapping[str, frozenset[Right]] | None = None,
        role_assignments: Mapping[str, frozenset[Right]] | None = None,
        response_timeout: float = 60.0,
        accept_timeout: float = ACCEPT_TIMEOUT,
        require_known: bool = False,
        hybrid_connections: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        tls: bool = True,
    ) -> None:
        rules = {
            name: SasRule(key=key, rights=(sas_rights or {}).get(name, ALL_RIGHTS))
            for name, key in (sas_keys or {}).items()
        }
        self._service = RelayService(
            checker=TokenChecker(sas_rules=rules, role_assignments=role_assignments),
            host=host,
            port=port,
            response_timeout=response_timeout,
            accept_timeout=accept_timeout,
            require_known=require_known,
            rng=random.Random(seed),
            tls=local_tls().server_context() if tls else None,
        )
        self._initial = hybrid_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Starts serving on a background thread; returns the base URL ``https://127.0.0.1:PORT``."""
        if self._loop is not None:
            raise RuntimeError("the relay emulator is already running; call stop() first")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="relay-emulator", daemon=True)
        self._thread.start()
        self._call(self._service.start())
        for name in self._initial:
            self._call(self._declare(name, True))
        return self.base_url

    def stop(self) -> None:
        """Closes every listener (1001) and socket, stops the server and its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self._service.stop(), timeout=15)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
            self._loop = self._thread = None

    # ---- addresses -------------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._service.port

    @property
    def base_url(self) -> str:
        return f"{self._service.http_scheme}://{self._service.authority}"

    @property
    def ws_url(self) -> str:
        """The namespace's WebSocket base URL (a listener's endpoint): ``wss://127.0.0.1:PORT``."""
        return f"{self._service.ws_scheme}://{self._service.authority}"

    def listen_url(self, path: str) -> str:
        return f"{self.ws_url}/$hc/{quote(path.strip('/'))}?sb-hc-action=listen"

    def connect_url(self, path: str) -> str:
        return f"{self.ws_url}/$hc/{quote(path.strip('/'))}?sb-hc-action=connect"

    def send_url(self, path: str) -> str:
        return f"{self.base_url}/{quote(path.strip('/'))}"

    def resource_uri(self, path: str = "") -> str:
        """The URI a SAS token is signed for (``sr``): the namespace, or one hybrid connection."""
        return f"http://{self._service.authority}/{quote(path.strip('/'))}"

    # ---- state and management --------------------------------------------------------------------------------

    def listener_count(self, path: str) -> int:
        return self._call(self._count(path))

    def counters(self) -> dict[str, int]:
        """Counts by kind: ``refused.<what>`` for bad input set aside (handshakes, requests, listener frames),
        ``rendezvous.request``/``rendezvous.response`` and ``accepted``/``rejected`` for WebSocket senders, and
        ``listener.<hybrid connection>`` for the listeners that connected to each (an on-demand listener may come
        and go between two looks at ``listener_count``)."""
        return self._call(self._counters())

    def set_listener_fault(self, name: str, *, delay_seconds: float = 0.0, dead: bool = False) -> None:
        """Requests to hybrid connection ``name`` are held ``delay_seconds`` before they reach its listener, or
        never reach it (``dead``: the sender waits out the response timeout or its own deadline); both unset: as
        normal. What a slow or hung listener looks like to a sender."""
        self._call(self._listener_fault(name, delay_seconds, dead))

    async def _listener_fault(self, name: str, delay: float, dead: bool) -> None:
        if delay > 0 or dead:
            self._service.listener_faults[name] = (delay, dead)
        else:
            self._service.listener_faults.pop(name, None)

    def create_hybrid_connection(self, name: str, *, requires_client_authorization: bool = True) -> None:
        self._call(self._declare(name, requires_client_authorization))

    def delete_hybrid_connection(self, name: str) -> bool:
        """Deletes it: its listeners and relayed sockets are closed with 1001. False if it did not exist."""
        return self._call(self._service.delete(name))

    async def _count(self, path: str) -> int:
        return self._service.listener_count(path)

    async def _counters(self) -> dict[str, int]:
        return dict(self._service.counters)

    async def _declare(self, name: str, requires: bool) -> None:
        self._service.declare(name, requires_client_authorization=requires)

    def _call(self, coroutine: Coroutine[Any, Any, _T], *, timeout: float = 10) -> _T:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the relay emulator is not running; call start() first")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)
