"""The forwarder daemon: its lifecycle (the identity, the threads, the companions, a clean stop) and the poll loop,
which keeps the cadence of the polls, the heartbeats and the hook ledger's pruning.

Three threads, so that no slow part holds up the 1/s poll: the poll loop (here, on the caller's thread; each poll is
forwarder/poller.py's, which spools an envelope per change), the sender (forwarder/sender.py: spool -> sink, with
backoff while the sink is down) and the hook worker (forwarder/hook_worker.py: one phase at a time). What a heartbeat
carries is forwarder/heartbeat.py's. Companions — the relay listener — are started after the identity is known, told
the document after every poll (the listener connects only while an event it could approve is pending:
forwarder/on_demand.py) and stopped first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from contracts.wire import ScheduledEventsDocument, VmIdentity
from forwarder import __version__
from forwarder.attestor import Attestor
from forwarder.config import ForwarderSettings
from forwarder.durable_state import Store, StoreFull
from forwarder.force import ForceHooks
from forwarder.heartbeat import PollHealth, spool_heartbeat
from forwarder.hook_worker import HookWorker
from forwarder.hooks import HookRunner
from forwarder.imds import ImdsClient, ImdsError, ImdsInvalidResponse, ImdsUnavailable
from forwarder.impact import ImpactMeter
from forwarder.logs import FailureLog, fields
from forwarder.poller import Poller
from forwarder.retry import Backoff
from forwarder.sender import SHUTDOWN_FLUSH_SECONDS, Sender
from forwarder.sinks import Sink
from forwarder.telemetry import Telemetry
from forwarder.worker_parts import WorkerParts

log = logging.getLogger("forwarder")

# The hook ledger is pruned at start and then this often: a DELETE over a table of a few rows per event.
PRUNE_INTERVAL = 24 * 3600.0


class Companion(Protocol):
    """Something that lives as long as the daemon (the relay listener)."""

    def start(self) -> Any: ...

    def stop(self) -> None: ...


@runtime_checkable
class Listener(Companion, Protocol):
    """A companion with a connection whose state the heartbeat reports (the relay listener)."""

    @property
    def connected(self) -> bool: ...


@runtime_checkable
class OnDemand(Protocol):
    """A companion told, after every poll, the document the daemon holds (forwarder/on_demand.py: the listener
    connects only while that document holds an event it could approve)."""

    def update(self, document: ScheduledEventsDocument | None) -> None: ...


# Given this VM's identity, the IMDS client and its force hooks (forwarder/force.py: the daemon's hooks folder and
# sender), the companions to run.
CompanionFactory = Callable[[VmIdentity, ImdsClient, ForceHooks], Sequence[Companion]]


class Forwarder:
    """One VM's forwarder. `run()` blocks until `stop()` (the CLI calls it from SIGTERM/SIGINT)."""

    def __init__(
        self,
        *,
        settings: ForwarderSettings,
        imds: ImdsClient,
        store: Store,
        sink: Sink,
        companions: CompanionFactory | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.imds = imds
        self.store = store
        self.sink = sink
        # Owned by the daemon (shut down with it); given when the listener shares it (cli.main).
        self.telemetry = telemetry or Telemetry(spans_file=settings.telemetry_spans_file)
        self.hooks = HookRunner(
            hooks_dir=settings.hooks_dir,
            timeout=settings.hook_timeout,
            margin=settings.hook_deadline_margin,
            grace=settings.hook_kill_grace,
        )
        self._companion_factory = companions
        self._companions: list[Companion] = []
        # Those told of every poll's document, sorted out once: a runtime Protocol check costs tens of µs, and it
        # was a fifth of an idle poll's CPU (py-spy on the footprint benchmark's forwarder).
        self._on_demand: list[OnDemand] = []
        self._stop = threading.Event()
        # The sender's own stop, set once nothing more can be spooled (`_shutdown`): a heartbeat the poll loop was
        # writing when the signal came, or a hook report, goes out with the stop's flush, not after the restart.
        self._drain = threading.Event()
        self._threads: list[threading.Thread] = []
        self.identity: VmIdentity | None = None
        # One dict for the three threads: each key is written by one of them (the poll loop, the sender, the hook
        # worker), and the heartbeat reads them all.
        self.counters: dict[str, int] = dict.fromkeys(
            ("polls", "changes", "imds_errors", "sent", "send_failures", "hooks_run"), 0
        )
        self._polls = PollHealth()
        self._imds_failures = FailureLog("IMDS poll", logger=log)
        self.attestor = Attestor(imds=imds, state_id=store.state_id) if settings.attest else None
        self._state_failures = FailureLog("writing the state (full disk)", logger=log)
        parts = WorkerParts(store=store, tracer=self.telemetry.tracer, counters=self.counters, spooled=self._spooled)
        self._parts = parts
        self.force: ForceHooks | None = None  # once the identity is known (_start_companions)
        self._sender = Sender(
            parts, sink=sink, batch_max=settings.send_batch_max, stop=self._drain, attestor=self.attestor
        )
        self._hook_worker = HookWorker(parts, runner=self.hooks, stop=self._stop)
        self._impact = ImpactMeter(
            parts, tick=settings.impact_tick, boot_time_file=settings.boot_time_file, stop=self._stop
        )
        self._poller = Poller(parts, imds=imds, queued=self._hook_worker.wake)

    def _spooled(self) -> None:
        """Something new is in the spool: the sender sends it now."""
        self._sender.wake()

    # --- lifecycle ---------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()
        self._hook_worker.wake()
        self._impact.wake()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        log.info(
            "forwarder starting",
            extra=fields(
                version=__version__, imds=self.imds.base_url, spool=str(self.store.path), spool_depth=self.store.depth()
            ),
        )
        self._prune_hook_ledger()
        identity = self._wait_for_identity()
        if identity is None:
            self._shutdown()
            return
        self.identity = identity
        log.info(
            "identity",
            extra=fields(
                name=identity.name, resource_id=identity.resourceId, vm_id=identity.vmId, state_id=self.store.state_id
            ),
        )
        if self.attestor is not None:
            # Before the first poll, which may wait two minutes for IMDS on the one IMDS connection: the start-up
            # heartbeat goes out attested. A failure here is asked again by the sender and the poll loop.
            self.attestor.tick()
        for target, name in ((self._sender.run, "sender"), (self._run_hooks, "hooks")):
            thread = threading.Thread(target=target, args=(identity,), name=f"forwarder-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        impact = threading.Thread(target=self._impact.run, name="forwarder-impact", daemon=True)
        impact.start()
        self._threads.append(impact)
        try:
            # "This VM's forwarder is up" as soon as it knows who it is: the first scheduled-events call may take
            # two minutes while IMDS wakes the service up, and the coordinator should not think the VM silent.
            self._heartbeat(identity)
            self._start_companions(identity)
            self._poll_loop(identity)
        finally:
            self._shutdown()

    def _run_hooks(self, identity: VmIdentity) -> None:
        # Phases a crash cut short are reported first, on this thread: with a full disk their reports wait for
        # room, and the poll loop must not.
        self._hook_worker.recover_interrupted(identity)
        self._hook_worker.run(identity)

    def _wait_for_identity(self) -> VmIdentity | None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        failures = FailureLog("reading instance metadata", logger=log)
        while not self._stop.is_set():
            try:
                identity = self.imds.get_identity()
            except ImdsError as exc:
                failures.failed(exc)
                self._stop.wait(backoff.next_delay())
            else:
                failures.succeeded()
                return identity
        return None

    def _start_companions(self, identity: VmIdentity) -> None:
        if self._companion_factory is None:
            return
        # A force request's hook runs through the daemon's runner and is reported through its spool and sender.
        self.force = ForceHooks(self.hooks, identity=identity, parts=self._parts, stop=self._stop)
        try:
            companions = self._companion_factory(identity, self.imds, self.force)
        except Exception:
            # A broken listener setup must not take the forwarding of events down with it.
            log.exception("the companions could not be built; forwarding continues without them")
            return
        for companion in companions:
            try:
                companion.start()
            except Exception:
                log.exception("a companion failed to start", extra=fields(companion=type(companion).__name__))
            else:
                self._companions.append(companion)
                if isinstance(companion, OnDemand):
                    self._on_demand.append(companion)

    def _shutdown(self) -> None:
        self.stop()
        for companion in self._companions:
            try:
                companion.stop()
            except Exception:
                log.exception("a companion failed to stop", extra=fields(companion=type(companion).__name__))
        self.hooks.stop()
        if self.force is not None:
            self.force.join(SHUTDOWN_FLUSH_SECONDS)  # their hooks killed: each records its refusal and its report
        # The sender (the first thread) last: it flushes what the others spooled.
        for thread in reversed(self._threads):
            if thread is self._threads[0]:
                self._drain.set()
                self._sender.wake()
            thread.join(SHUTDOWN_FLUSH_SECONDS + 5)
        self._drain.set()
        self._impact.mark_alive()  # a clean stop (a shutdown, a reboot) is the exact start of a downtime
        self.sink.close()
        self.imds.close()
        depth = self.store.depth()
        self.store.close()
        log.info("forwarder stopped", extra=fields(unsent=depth, **self.counters))

    # --- polling -----------------------------------------------------------------------------------------
    def _poll_loop(self, identity: VmIdentity) -> None:
        interval = self.settings.poll_interval
        backoff = Backoff(initial=max(interval, 1.0), maximum=60.0)
        next_heartbeat = time.monotonic() + self.settings.heartbeat_interval  # the first one went out in run()
        next_prune = time.monotonic() + PRUNE_INTERVAL
        next_poll = time.monotonic()
        while not self._stop.is_set():
            delay = interval
            # Before the poll: a pause or a restart is reported ahead of the change that shows its event gone.
            self._impact.before_poll(identity, due=next_poll)
            try:
                self._poller.poll_once(identity)
            except ImdsUnavailable as exc:
                self.counters["imds_errors"] += 1
                self._polls.failed(exc)
                self._imds_failures.failed(exc, status=exc.status)
                delay = backoff.next_delay(retry_after=exc.retry_after)
            except ImdsInvalidResponse as exc:
                self.counters["imds_errors"] += 1
                self._polls.failed(exc)
                self._imds_failures.failed(exc)
            except StoreFull as exc:
                # The change could not be spooled: it is read again from IMDS at the next poll, after a backoff
                # (a full disk does not clear in a second). Heartbeats go on, from memory, and say so.
                self._state_failures.failed(exc)
                delay = backoff.next_delay()
            else:
                self._polls.succeeded()
                self._imds_failures.succeeded()
                if self._poller.document is not None:
                    self._impact.polled(self._poller.document, identity)
                if self.store.full_since is None:
                    self._state_failures.succeeded()
                backoff.reset()
            # After the poll, so that the first poll is not held up by the first attested document.
            if self.attestor is not None:
                self.attestor.tick()
            # After a failed poll too: the last document read still says whether an event is pending.
            self._update_companions()
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat(identity)
                next_heartbeat = now + self.settings.heartbeat_interval
            if now >= next_prune:
                self._prune_hook_ledger()
                next_prune = now + PRUNE_INTERVAL
            # Keep a steady cadence; after a stall, start again from now rather than catching up in a burst.
            next_poll = max(next_poll + delay, now) if delay == interval else now + delay
            self._stop.wait(max(0.0, next_poll - time.monotonic()))

    def _update_companions(self) -> None:
        for companion in self._on_demand:
            try:
                companion.update(self._poller.document)
            except Exception:
                log.exception("a companion failed to update", extra=fields(companion=type(companion).__name__))

    def _prune_hook_ledger(self) -> None:
        try:
            pruned = self.store.prune_hooks()
        except StoreFull:
            return  # tomorrow, or at the next start
        if pruned:
            log.info("hook ledger pruned", extra=fields(forgotten=pruned))

    def _heartbeat(self, identity: VmIdentity) -> None:
        self._impact.mark_alive()  # a hard reset's downtime is measured from here: at most a heartbeat early
        unspooled = spool_heartbeat(
            self.store,
            identity,
            counters=self.counters,
            polls=self._polls,
            listener_connected=self._listener_connected(),
        )
        if unspooled is not None:
            self._sender.hold(unspooled)
        self._sender.wake()

    def _listener_connected(self) -> bool | None:
        """Whether the relay listener's control channel is up; None when no listener is configured. A listener
        configured but not (yet) running counts as not connected."""
        states = [c.connected for c in self._companions if isinstance(c, Listener)]
        if states:
            return all(states)
        return False if self.settings.relay_enabled else None
