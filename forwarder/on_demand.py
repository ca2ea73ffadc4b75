"""The relay listener, connected only while this VM could execute an approval (or always, by configuration).

Takes each document the poll loop holds (``update``) and a factory of listener sessions (``forwarder.relay_listener.
RelayListener``, built when an event wants one; its modules loaded by ``warm`` at start, forwarder/cli.py); gives a
daemon companion whose ``connected`` the heartbeat reports (``ForwarderHealth.listenerConnected``).

Why: Azure bills a hybrid-connection listener per hour it is connected (about $0.0134/h, $9.78 a month always on),
and an approval can only be executed for a Scheduled event in this VM's document that its listener would accept
(``ScheduledEvent.executable_by``: its own Terminate, any other event of its group). So the listener connects when
such an event appears and leaves ``grace_seconds`` after the last one is gone or Started. The coordinator's sender
keeps retrying "no listener" (503) meanwhile (``relay_sender.py``); a connect that fails is retried by
the session itself (``RelayListener``: backoff, token renewal), for as long as the event is pending.

A session is closed on a helper thread: ``RelayListener.stop`` lets requests in flight finish (up to seconds), and
the 1 s poll must not wait for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from contracts.wire import ScheduledEventsDocument
from forwarder.logs import fields

log = logging.getLogger("forwarder.listener")

# After a factory failure (bad settings, a missing package), try again at most this often while still wanted.
FACTORY_RETRY_SECONDS = 30.0


class ListenerSession(Protocol):
    """One connection's lifetime (``RelayListener``): started once, stopped once."""

    def start(self) -> Any: ...

    def stop(self) -> None: ...

    @property
    def connected(self) -> bool: ...


def wants_listener(document: ScheduledEventsDocument | None, *, vm_name: str) -> bool:
    """Whether this document holds a Scheduled event whose approval this VM's listener could execute."""
    return document is not None and any(event.executable_by(vm_name) for event in document.Events)


class OnDemandListener:
    """A daemon companion holding at most one listener session, opened and closed as ``update`` says.

    :keyword factory: builds a new, unstarted session (a ``RelayListener`` cannot be restarted).
    :keyword always_on: open at ``start`` and keep it; ``update`` then changes nothing.
    :keyword grace_seconds: how long the session stays after the last executable event left the document.
    :keyword warm: called once, in the background, at ``start`` (load the session's modules, fetch the Relay token
        into the credential's cache), so that the first session opened for an event does not pay for it while its
        approval waits.
    """

    def __init__(
        self,
        *,
        factory: Callable[[], ListenerSession],
        vm_name: str,
        always_on: bool = False,
        grace_seconds: float = 60.0,
        warm: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if grace_seconds < 0:
            raise ValueError(f"grace_seconds={grace_seconds} must be >= 0")
        self._factory = factory
        self._vm_name = vm_name
        self._always_on = always_on
        self._grace = grace_seconds
        self._clock = clock
        self._warm = warm
        self._lock = threading.Lock()
        self._session: ListenerSession | None = None
        self._closing: list[threading.Thread] = []
        self._wanted_until = float("-inf")
        self._retry_factory_at = float("-inf")
        self._stopped = False
        self.sessions = 0  # how many sessions were opened (tests, logs)

    def start(self) -> OnDemandListener:
        if self._always_on:
            self._open("always-on")
        elif self._warm is not None:
            threading.Thread(target=self._warm_up, name="relay-warm-up", daemon=True).start()
        return self

    def _warm_up(self) -> None:
        assert self._warm is not None
        try:
            self._warm()
        except Exception as error:  # only a head start: the session fetches what it needs itself
            log.warning("relay listener warm-up failed; the first session will do it", extra=fields(error=str(error)))

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            session, self._session = self._session, None
        if session is not None:
            session.stop()
        for thread in self._closing:
            thread.join()

    @property
    def connected(self) -> bool:
        session = self._session
        return session is not None and session.connected

    @property
    def open(self) -> bool:
        """Whether a session is open (connected, or connecting / reconnecting with backoff)."""
        return self._session is not None

    def update(self, document: ScheduledEventsDocument | None) -> None:
        """Called after every poll with the document the daemon holds (the last one read)."""
        if self._always_on or self._stopped:
            return
        now = self._clock()
        if wants_listener(document, vm_name=self._vm_name):
            self._wanted_until = now + self._grace
            if self._session is None and now >= self._retry_factory_at:
                self._open("a Scheduled event this VM could approve")
        elif self._session is not None and now >= self._wanted_until:
            self._close()

    def _open(self, reason: str) -> None:
        try:
            session = self._factory()
            session.start()
        except Exception:
            # A broken listener setup must not take the forwarding of events down with it.
            self._retry_factory_at = self._clock() + FACTORY_RETRY_SECONDS
            log.exception("the relay listener could not be started; retrying while it is needed")
            return
        with self._lock:
            if self._stopped:
                session.stop()
                return
            self._session = session
        self.sessions += 1
        log.info("relay listener opened", extra=fields(reason=reason, sessions=self.sessions))

    def _close(self) -> None:
        with self._lock:
            session, self._session = self._session, None
        if session is None:
            return
        log.info("relay listener closing: no Scheduled event to approve", extra=fields(grace_s=self._grace))
        self._closing = [t for t in self._closing if t.is_alive()]
        thread = threading.Thread(target=session.stop, name="relay-listener-close", daemon=True)
        thread.start()
        self._closing.append(thread)
