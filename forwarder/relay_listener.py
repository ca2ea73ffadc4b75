"""Azure Relay Hybrid Connections listener (the HTTP request/response gesture), on the forwarder's small WebSocket
client over ``wsproto`` (forwarder/websocket.py says why not the ``websockets`` package).

There is no maintained Python data-plane SDK for Hybrid Connections, so this speaks the protocol itself
(learn: azure-relay/relay-hybrid-connections-protocol):

- control channel ``{endpoint}/$hc/{hc}?sb-hc-action=listen``, token in the ``ServiceBusAuthorization`` header;
- ``request`` messages (JSON text frame, then the body as one binary message — the WebSocket library reassembles
  fragments until FIN), answered with a ``response`` text frame and the body as a binary message. Each request is
  framed on its own: one that announces a body and is followed by a text frame is refused (400) and that frame is
  read as the next message, never as the body (it is the next request: taking it as a body swallowed it); one
  that is JSON but not a valid request is refused (400) by its id;
- a ``request`` with only ``address`` is a rendezvous: the request arrives on a WebSocket opened to that address
  and is answered there; a response larger than 64 kB is sent on a rendezvous socket as well;
- ``accept`` (a WebSocket sender) is not part of our protocol and is declined with the documented reject gesture;
- ``renewToken`` is sent before the token expires; reconnects use exponential backoff with equal jitter
  (``forwarder.retry.Backoff``, the forwarder's one place for retry timing).

This module moves the messages: it holds the control channel (connect, renew, reconnect, stop) and serves each
request on it or on a rendezvous socket. What the messages say is in ``forwarder/relay_protocol.py`` (no I/O), where
the token comes from in ``forwarder/relay_tokens.py``.

Why threads and the sync client rather than asyncio: the forwarder daemon is synchronous (a 1 s IMDS poll loop),
the handler does blocking IMDS calls, and a thread with blocking ``recv(timeout=...)`` is the smallest thing that
can be started and stopped from it. The client's ``send`` is thread-safe, so handler threads answer while the listener
thread sits in ``recv``; a lock keeps each response's frames together.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote, urlsplit

from contracts.checks import Invalid
from forwarder.relay_protocol import (
    ControlMessage,
    Handler,
    RelayResponse,
    WireAccept,
    WireRequest,
    relay_request,
    request_id_of,
    response_frame,
    with_query,
)
from forwarder.relay_tokens import RelayToken, TokenProvider
from forwarder.retry import Backoff
from forwarder.websocket import (
    ClientConnection,
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    WebSocketException,
    connect,
)

logger = logging.getLogger(__name__)

CONTROL_CHANNEL_LIMIT = 64 * 1024
# The service answers a request with 504 after 60 s without a response; we give up on a body a little earlier.
REQUEST_DEADLINE_SECONDS = 60.0


StatName = Literal[
    "connects", "requests", "rendezvous", "declined_accepts", "token_renewals", "protocol_errors", "handler_errors"
]


@dataclass
class ListenerStats:
    """Counters for health checks and tests; handler threads and the listener thread both update them."""

    connects: int = 0
    requests: int = 0
    rendezvous: int = 0
    declined_accepts: int = 0
    token_renewals: int = 0
    protocol_errors: int = 0
    handler_errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: StatName) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


class RelayListener:
    """Listens on one hybrid connection in a background thread and answers each request with ``handler``.

    ``endpoint`` is the namespace base URL, ``wss://{ns}.servicebus.windows.net`` in Azure or ``ws://127.0.0.1:P``
    for the emulator. ``handler`` runs on a small thread pool so that a slow request does not hold up the control
    channel (token renewal, other requests); it must answer well within the relay's 60 s deadline.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        hybrid_connection: str,
        token_provider: TokenProvider,
        handler: Handler,
        max_workers: int = 4,
        backoff: Backoff | None = None,
        open_timeout: float = 10.0,
        ping_interval: float | None = 30.0,
        renew_fraction: float = 0.75,
    ) -> None:
        if not 0.0 < renew_fraction < 1.0:
            raise ValueError(f"renew_fraction={renew_fraction} must be between 0 and 1")
        scheme = urlsplit(endpoint).scheme
        if scheme not in ("ws", "wss"):
            raise ValueError(f"relay endpoint {endpoint!r} must start with wss:// (or ws:// for a local emulator)")
        self.hybrid_connection = hybrid_connection
        self.listen_url = f"{endpoint.rstrip('/')}/$hc/{quote(hybrid_connection, safe='')}?sb-hc-action=listen"
        self._tokens = token_provider
        self._handler = handler
        self._max_workers = max_workers
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self._open_timeout = open_timeout
        self._ping_interval = ping_interval
        self._renew_fraction = renew_fraction
        self._stopping = threading.Event()
        self._connected = threading.Event()
        self._state_lock = threading.Lock()
        self._control: ClientConnection | None = None
        self._thread: threading.Thread | None = None
        self._in_flight = 0
        self._idle = threading.Condition()
        self._drain_seconds = 0.0
        self.stats = ListenerStats()

    # -- lifecycle

    def start(self) -> RelayListener:
        if self._thread is not None:
            raise RuntimeError("this RelayListener was already started; create a new one")
        self._thread = threading.Thread(target=self._run, name=f"relay-listener-{self.hybrid_connection}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Let requests in flight finish and answer (up to half of ``timeout``), then close the control channel
        cleanly (close code 1000) and wait for the thread."""
        self._drain_seconds = timeout / 2
        self._stopping.set()
        self._drain()
        with self._state_lock:
            control = self._control
        if control is not None:
            control.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("relay listener for %s did not stop within %.1f s", self.hybrid_connection, timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    # -- control channel

    def _run(self) -> None:
        with ThreadPoolExecutor(self._max_workers, thread_name_prefix="relay-request") as pool:
            while not self._stopping.is_set():
                try:
                    if self._listen_once(pool):
                        self._backoff.reset()
                except Exception:  # whatever a session raised, this VM's approvals must not stop: connect again
                    logger.exception("relay listener %s: session failed; connecting again", self.hybrid_connection)
                if not self._stopping.is_set():
                    self._stopping.wait(self._backoff.next_delay())

    def _listen_once(self, pool: ThreadPoolExecutor) -> bool:
        """One control-channel session. True when the channel was established (so backoff starts over)."""
        try:
            token = self._tokens.get_token()
        except Exception as error:
            logger.error("relay listener %s: cannot get a token: %s", self.hybrid_connection, error)
            return False
        try:
            control = connect(
                self.listen_url,
                additional_headers={"ServiceBusAuthorization": token.token},
                open_timeout=self._open_timeout,
                ping_interval=self._ping_interval,
                max_size=CONTROL_CHANNEL_LIMIT + 32 * 1024,
            )
        except InvalidStatus as error:
            status = error.response.status_code
            hint = {
                401: "the token was refused: check the listener identity / SAS key",
                403: "the token lacks Listen on this hybrid connection: assign 'Azure Relay Listener'",
                404: "the hybrid connection does not exist (yet): the coordinator creates it",
            }.get(status, "relay service error")
            logger.error("relay listener %s: handshake refused with HTTP %d: %s", self.hybrid_connection, status, hint)
            return False
        except (OSError, InvalidHandshake, TimeoutError) as error:
            logger.warning("relay listener %s: cannot connect: %s", self.hybrid_connection, error)
            return False
        with self._state_lock:
            self._control = control
        if self._stopping.is_set():  # stop() ran while we were connecting
            control.close()
        self.stats.add("connects")
        self._connected.set()
        logger.info("relay listener %s: control channel open", self.hybrid_connection)
        try:
            self._serve(control, token, pool)
        except ConnectionClosed as closed:
            if not self._stopping.is_set():
                rcvd = closed.rcvd
                code, reason = (rcvd.code, rcvd.reason) if rcvd else (None, "")
                logger.warning("relay listener %s: channel closed (%s %s)", self.hybrid_connection, code, reason)
        except WebSocketException as error:  # frames that are not WebSocket (a reserved opcode...): the channel is over
            self.stats.add("protocol_errors")
            logger.warning("relay listener %s: channel failed: %s; connecting again", self.hybrid_connection, error)
        finally:
            self._connected.clear()
            if self._stopping.is_set():
                # stop() may land between a request's dispatch and its answer; the answer goes out on this channel.
                self._drain()
            with self._state_lock:
                self._control = None
            control.close()
        return True

    def _drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, self._drain_seconds)

    def _serve(self, control: ClientConnection, token: RelayToken, pool: ThreadPoolExecutor) -> None:
        send_lock = threading.Lock()
        renew_at = self._renew_time(token)
        # A text frame read where a request's body was due: the next message, read next.
        pending: str | None = None
        while not self._stopping.is_set():
            try:
                receive = functools.partial(control.recv, timeout=max(0.0, renew_at - time.time()))
                message = self._next_text(pending, receive)
            except TimeoutError:
                renew_at = self._renew(control, send_lock)
                continue
            pending = None
            if message is None:
                continue
            parsed = self._parse(control, send_lock, message)
            if parsed is None:
                continue
            if parsed.request is not None:
                pending = self._on_request(control, send_lock, parsed.request, pool)
            elif parsed.accept is not None:
                self._submit(pool, self._decline_accept, parsed.accept)
            else:
                logger.info("relay listener %s: unknown control message ignored", self.hybrid_connection)

    def _next_text(self, pending: str | None, receive: Callable[[], str | bytes]) -> str | None:
        """The next text message of a channel: ``pending`` (read where a request's body was due), else received; a
        binary frame where a text one is due is counted and ignored (None)."""
        message = pending if pending is not None else receive()
        if isinstance(message, bytes):
            self.stats.add("protocol_errors")
            logger.warning("relay listener %s: unexpected binary frame ignored", self.hybrid_connection)
            return None
        return message

    def _submit(self, pool: ThreadPoolExecutor, work: Callable[..., None], *args: Any) -> None:
        with self._idle:
            self._in_flight += 1

        def run() -> None:
            try:
                work(*args)
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

        pool.submit(run)

    def _renew_time(self, token: RelayToken) -> float:
        now = time.time()
        return now + max(1.0, (token.expires_on - now) * self._renew_fraction)

    def _renew(self, control: ClientConnection, send_lock: threading.Lock) -> float:
        try:
            token = self._tokens.get_token()
        except Exception as error:
            logger.error("relay listener %s: token renewal failed: %s", self.hybrid_connection, error)
            return time.time() + self._backoff.next_delay()
        with send_lock:
            control.send(json.dumps({"renewToken": {"token": token.token}}))
        self.stats.add("token_renewals")
        return self._renew_time(token)

    def _parse(self, socket: ClientConnection, lock: threading.Lock, message: str) -> ControlMessage | None:
        """The control message, or None when it is not one: counted, and refused by its id when it has one."""
        try:
            return ControlMessage.from_json_bytes(message)
        except Invalid as error:
            self.stats.add("protocol_errors")
            logger.warning("relay listener %s: malformed control message ignored: %s", self.hybrid_connection, error)
            request_id = request_id_of(message, max_bytes=CONTROL_CHANNEL_LIMIT + 32 * 1024)
            if request_id is not None:
                self._refuse(socket, lock, request_id, "malformed request message")
            return None

    def _read_body(self, socket: ClientConnection, wire: WireRequest) -> tuple[bytes | None, str | None]:
        """The request's body (b"" when it announced none), or None when it did not arrive as the next frame, a
        binary one; and a text frame read in its place, which is the next message and not this body."""
        if not wire.body:
            return b"", None
        try:
            payload = socket.recv(timeout=REQUEST_DEADLINE_SECONDS)
        except TimeoutError:
            self.stats.add("protocol_errors")
            logger.warning("relay listener %s: request %s body never arrived", self.hybrid_connection, wire.id)
            return None, None
        if isinstance(payload, bytes):
            return payload, None
        self.stats.add("protocol_errors")
        logger.warning(
            "relay listener %s: request %s announced a body but a text frame came; refused, the frame read as the "
            "next message",
            self.hybrid_connection,
            wire.id,
        )
        return None, payload

    def _refuse(self, socket: ClientConnection, lock: threading.Lock, request_id: str, why: str) -> None:
        try:
            self._send_response(socket, lock, request_id, RelayResponse.json(400, {"error": why}))
        except (ConnectionClosed, OSError, WebSocketException) as error:
            logger.warning("relay listener %s: refusal of %s lost: %s", self.hybrid_connection, request_id, error)

    def _on_request(
        self, control: ClientConnection, send_lock: threading.Lock, wire: WireRequest, pool: ThreadPoolExecutor
    ) -> str | None:
        """Serves one request; gives back a text frame read where its body was due (the next message)."""
        if wire.method is None:
            # Too large or streamed for the control channel: the request waits for us at the rendezvous address.
            self.stats.add("rendezvous")
            self._submit(pool, self._serve_rendezvous, wire.address)
            return None
        body, following = self._read_body(control, wire)
        if body is None:
            self._refuse(control, send_lock, wire.id, "the request's body did not arrive as one binary frame")
            return following
        self._submit(pool, self._answer_on_control, control, send_lock, wire, body)
        return None

    def _answer_on_control(
        self, control: ClientConnection, send_lock: threading.Lock, wire: WireRequest, body: bytes
    ) -> None:
        response = self._handle(wire, body)
        try:
            if len(response.body) > CONTROL_CHANNEL_LIMIT:
                with connect(wire.address, open_timeout=self._open_timeout, max_size=None) as rendezvous:
                    self._send_response(rendezvous, threading.Lock(), wire.id, response)
            else:
                self._send_response(control, send_lock, wire.id, response)
        except (ConnectionClosed, OSError, WebSocketException) as error:
            logger.warning("relay listener %s: response to %s lost: %s", self.hybrid_connection, wire.id, error)

    def _serve_rendezvous(self, address: str) -> None:
        try:
            with connect(address, open_timeout=self._open_timeout, max_size=None, ping_interval=None) as socket:
                lock = threading.Lock()
                pending: str | None = None
                while not self._stopping.is_set():
                    message = self._next_text(pending, functools.partial(socket.recv, timeout=REQUEST_DEADLINE_SECONDS))
                    pending = None
                    if message is None:
                        continue
                    parsed = self._parse(socket, lock, message)
                    if parsed is None:
                        continue
                    wire = parsed.request
                    if wire is None or wire.method is None:
                        self.stats.add("protocol_errors")
                        continue
                    body, pending = self._read_body(socket, wire)
                    if body is None:
                        self._refuse(socket, lock, wire.id, "the request's body did not arrive as one binary frame")
                        continue
                    self._send_response(socket, lock, wire.id, self._handle(wire, body))
        except ConnectionClosed:
            pass  # the sender is done; dropping the socket is how a rendezvous ends
        except (OSError, TimeoutError, WebSocketException) as error:
            logger.warning("relay listener %s: rendezvous failed: %s", self.hybrid_connection, error)

    def _handle(self, wire: WireRequest, body: bytes) -> RelayResponse:
        self.stats.add("requests")
        try:
            return self._handler(relay_request(wire, body, hybrid_connection=self.hybrid_connection))
        except Exception:
            self.stats.add("handler_errors")
            logger.exception("relay listener %s: handler failed on request %s", self.hybrid_connection, wire.id)
            return RelayResponse.json(500, {"error": "the listener failed to handle the request"})

    @staticmethod
    def _send_response(
        socket: ClientConnection, lock: threading.Lock, request_id: str, response: RelayResponse
    ) -> None:
        with lock:
            socket.send(response_frame(request_id, response))
            if response.body:
                socket.send(response.body)

    def _decline_accept(self, accept: WireAccept) -> None:
        """WebSocket senders are not part of our protocol: reject with the documented gesture (the handshake is
        expected to fail with HTTP 410)."""
        self.stats.add("declined_accepts")
        reject = with_query(
            accept.address,
            {"sb-hc-statusCode": "403", "sb-hc-statusDescription": "WebSocket senders are not accepted"},
        )
        try:
            with connect(reject, open_timeout=self._open_timeout):
                logger.warning(
                    "relay listener %s: reject of %s was accepted as a connection", self.hybrid_connection, accept.id
                )
        except InvalidStatus as error:
            if error.response.status_code != 410:
                logger.warning(
                    "relay listener %s: reject answered HTTP %d", self.hybrid_connection, error.response.status_code
                )
        except (OSError, InvalidHandshake, TimeoutError) as error:
            logger.warning("relay listener %s: reject of %s failed: %s", self.hybrid_connection, accept.id, error)
