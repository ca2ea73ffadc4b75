"""What the Functions host does for ``function_app``, done locally: an Event Hubs consumer hands batches to
``ingest_envelopes``, a timer calls ``reevaluate`` and the delivery queue's trigger calls ``continue_approval``
(local/queue_trigger.py).

The consumer is the real ``azure-eventhub`` ``EventHubConsumerClient`` with checkpoints in Azurite through
``BlobCheckpointStore``, as the host's Event Hubs extension keeps them in the app's storage account. Batches have the
host's shape for ``cardinality=many``: up to ``max_batch_size`` ``func.EventHubEvent`` of one partition, each with
partition key, sequence number, enqueued time and offset, sharing the batch's trigger metadata whose
``PropertiesArray`` holds the messages' application properties (the forwarder's W3C trace context). A batch the
function raises on is retried with backoff (the app's ``@app.retry`` policy); when retries run out it is counted as
failed and the checkpoint moves on, as the host does. Each partition's batches run on a thread of their own, in
order, as the host runs partitions side by side: on the consumer's one thread, a batch waiting for its approval's
answer held up every other partition's envelopes (the pipeline's added p99 was 429 ms against 26 ms for Event Hubs
alone, 8 ms for the coordinator and 22 ms for the Relay approval, benchmarks/eventhub_hop.py, hop.py,
approval_latency.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import azure.functions as func
from azure.eventhub import EventData, PartitionContext
from azure.eventhub.amqp import AmqpMessageBodyType
from azure.eventhub.extensions.checkpointstoreblob import BlobCheckpointStore
from azure.functions.meta import Datum
from azure.functions.timer import TimerRequest
from azure.storage.blob import BlobServiceClient

from emulators.eventhubs import consumer_client
from forwarder.retry import Backoff
from local.queue_trigger import QueueTrigger

log = logging.getLogger("local.runner")

# Azurite 3.35 accepts blob API versions up to this one (docs: local-tooling.md §3).
AZURITE_BLOB_API_VERSION = "2025-11-05"
# A function invocation running longer than this gets its thread's stack logged (once, as a warning; a run's
# pipeline.log keeps warnings): a partition that stalls then says where.
SLOW_INVOCATION_SECONDS = 8.0
# A batch reaching the trigger this long after Event Hubs stored its first message is noted in ``RunnerStats.stalls``
# (a benchmark's run logs nothing below ERROR, and a partition stalled for 14 s once with nothing to say why).
LATE_BATCH_SECONDS = 2.0
# The stalls kept: the last ones, with the partitions' claims and closes and the consumer's errors between them.
STALLS_KEPT = 50

IngestFunction = Callable[[list[func.EventHubEvent]], None]
TimerFunction = Callable[[func.TimerRequest], None]


def to_function_event(event: EventData, metadata: dict[str, Datum] | None = None) -> func.EventHubEvent:
    """The ``func.EventHubEvent`` the Functions worker would build from this message (``metadata``: the batch's trigger
    metadata, which the worker hands every event of a cardinality-many batch)."""
    offset = event.offset
    return func.EventHubEvent(
        body=_body_bytes(event),
        trigger_metadata=metadata,
        enqueued_time=event.enqueued_time,
        partition_key=event.partition_key.decode() if isinstance(event.partition_key, bytes) else event.partition_key,
        sequence_number=event.sequence_number,
        offset=None if offset is None else str(offset),
    )


def to_function_batch(events: Sequence[EventData]) -> list[func.EventHubEvent]:
    """A cardinality-many batch as the worker builds it: each event, and one trigger metadata for all of them whose
    ``PropertiesArray`` holds each message's application properties in order (the W3C trace context among them)."""
    properties = [{_text(k): _text(v) for k, v in (event.properties or {}).items()} for event in events]
    metadata = {"PropertiesArray": Datum(type="json", value=json.dumps(properties))}
    return [to_function_event(event, metadata) for event in events]


def _text(value: object) -> str:
    # AMQP application properties arrive as bytes or str keys and values; the host hands them on as JSON strings.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _body_bytes(event: EventData) -> bytes:
    # A data body arrives as sections of bytes; the host hands the function their concatenation.
    body: Any = event.body
    if isinstance(body, bytes):
        return body
    if event.body_type == AmqpMessageBodyType.DATA:
        return b"".join(body)
    return event.body_as_str(encoding="utf-8").encode("utf-8")


@dataclass
class RunnerStats:
    batches: int = 0
    events: int = 0
    failed_batches: int = 0
    retries: int = 0
    ticks: int = 0
    failed_ticks: int = 0
    # The longest invocation of each trigger, in seconds: what one run kept its partition (or the timer) waiting.
    slowest_batch: float = 0.0
    slowest_tick: float = 0.0
    errors: list[str] = field(default_factory=list)
    # What held a partition up, with the time it was seen (UTC): batches reaching the trigger late, invocations
    # still running after SLOW_INVOCATION_SECONDS (with their stacks), partitions claimed and closed (the reason:
    # ownership lost, shutdown), the consumer's errors. The last STALLS_KEPT.
    stalls: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        hidden = ("errors", "stalls")
        return {k: v for k, v in self.__dict__.items() if k not in hidden} | {
            "errors": self.errors[-5:],
            "stalls": self.stalls[-5:],
        }


# A failed checkpoint write is retried as the Functions host's storage client retries (Azure.Core's defaults: 3
# retries, exponential from 0.8 s), not with the Python blob client's 15 s (±3) first wait: a partition's next batch
# waits for its checkpoint, and one failed write to Azurite held a partition for ~15 s and cost a pipeline_latency
# round 15 of its 300 approvals (e3c0816's record).
CHECKPOINT_RETRY: dict[str, Any] = {
    "retry_total": 3,
    "initial_backoff": 0.8,
    "increment_base": 2,
    "random_jitter_range": 0.2,
}


def _checkpoint_store(storage_connection_string: str, container_name: str) -> BlobCheckpointStore:
    """The trigger's checkpoint store in its blob container, made if it does not exist yet (as the host does)."""
    blobs = BlobServiceClient.from_connection_string(storage_connection_string, api_version=AZURITE_BLOB_API_VERSION)
    container = blobs.get_container_client(container_name)
    if not container.exists():
        container.create_container()
    blobs.close()
    return BlobCheckpointStore.from_connection_string(storage_connection_string, container_name, **CHECKPOINT_RETRY)


class FunctionHost:
    """Consumes ``eventhub_name`` and calls ``ingest`` per batch; calls ``timer`` every ``timer_interval`` seconds.

    :keyword eventhub_connection_string: namespace connection string (the Event Hubs emulator's).
    :keyword storage_connection_string: Azurite; checkpoints and ownership go to ``checkpoint_container``.
    :keyword max_batch_size: the host's ``maxEventBatchSize`` (host.json); 200 by default, as in Azure.
    :keyword max_attempts: tries per batch (1 + the app's retry count).
    :keyword socket_timeout: the consumer's AMQP socket read timeout; it bounds how long a delivery waits.
    :keyword ownership_expiry: seconds before another instance may take a partition this one stopped renewing.
    """

    def __init__(
        self,
        *,
        eventhub_connection_string: str,
        eventhub_name: str,
        storage_connection_string: str,
        ingest: IngestFunction,
        timer: TimerFunction | None = None,
        timer_interval: float = 2.0,
        queue_trigger: QueueTrigger | None = None,
        consumer_group: str = "$Default",
        checkpoint_container: str = "azure-webjobs-eventhub",
        max_batch_size: int = 200,
        socket_timeout: float = 0.005,
        max_attempts: int = 6,
        retry_initial: float = 0.2,
        retry_maximum: float = 2.0,
        ownership_expiry: float | None = None,
    ) -> None:
        self._ingest = ingest
        self._timer = timer
        self._timer_interval = timer_interval
        # The delivery queue's trigger (continue_approval), polled beside the Event Hubs trigger and the timer.
        self.queue_trigger = queue_trigger
        self._max_batch_size = max_batch_size
        self._max_attempts = max_attempts
        self._retry = (retry_initial, retry_maximum)
        store = _checkpoint_store(storage_connection_string, checkpoint_container)
        self._client = consumer_client(
            eventhub_connection_string,
            consumer_group=consumer_group,
            eventhub_name=eventhub_name,
            checkpoint_store=store,
            load_balancing_strategy="greedy",
            load_balancing_interval=2.0,
            # How long a partition stays claimed by an instance that stopped renewing it (None: the SDK's 12 s).
            partition_ownership_expiration_interval=ownership_expiry,
            # The sync client visits its partitions in turn on one thread and each visit waits up to socket_timeout
            # (0.2 s by default) for a delivery, so an event waited for the other partitions' waits (~0.5 s at the
            # default, ~70 ms at 20 ms); the Functions host's consumer has no such wait. 5 ms costs about 200
            # wake-ups per second per partition. (One client per partition, each on its own thread, slowed the
            # in-process Event Hubs emulator down to seconds per send at start-up: GIL contention.)
            socket_timeout=socket_timeout,
            retry_total=3,
            retry_backoff_factor=0.2,
            retry_backoff_max=2.0,
        )
        self.stats = RunnerStats()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._rng = random.Random()  # noqa: S311 -- jitter, not security
        # One queue and thread per partition: batches of a partition in order, partitions side by side.
        Work = tuple[PartitionContext, EventData, list[func.EventHubEvent]] | None
        self._partitions: dict[str, queue.SimpleQueue[Work]] = {}

    def start(self) -> None:
        receive = threading.Thread(target=self._receive, name="local-eventhub-trigger", daemon=True)
        self._threads.append(receive)
        receive.start()
        if self._timer is not None:
            tick = threading.Thread(target=self._tick_loop, name="local-timer-trigger", daemon=True)
            self._threads.append(tick)
            tick.start()
        if self.queue_trigger is not None:
            self.queue_trigger.start()

    def stop(self) -> None:
        self._stopping.set()
        self._client.close()
        with self._lock:
            for work in self._partitions.values():
                work.put(None)
        for thread in self._threads:
            thread.join(timeout=15)
        if self.queue_trigger is not None:
            self.queue_trigger.stop()

    def _receive(self) -> None:
        # No max_wait_time: the SDK then hands over what has arrived at once instead of holding it for the wait.
        self._client.receive_batch(
            on_event_batch=self._on_batch,
            on_error=self._on_error,
            on_partition_initialize=lambda context: self.note(f"partition {context.partition_id} claimed"),
            on_partition_close=lambda context, reason: self.note(
                f"partition {context.partition_id} closed: {getattr(reason, 'name', reason)}"
            ),
            max_batch_size=self._max_batch_size,
            starting_position="-1",
        )

    def _on_error(self, context: PartitionContext | None, error: Exception) -> None:
        partition = context.partition_id if context is not None else "-"
        log.warning("event hub consumer error on partition %s: %s", partition, error)
        self.note(f"partition {partition}: consumer error {type(error).__name__}: {str(error)[:300]}")

    def note(self, stall: str) -> None:
        """Keeps ``stall`` in ``stats.stalls`` with the time it was seen."""
        with self._lock:
            self.stats.stalls.append(f"{datetime.now(UTC).isoformat(timespec='milliseconds')} {stall}")
            del self.stats.stalls[:-STALLS_KEPT]

    def _on_batch(self, context: PartitionContext, events: Sequence[EventData]) -> None:
        if not events:
            return
        enqueued = events[0].enqueued_time
        waited = (datetime.now(UTC) - enqueued).total_seconds() if enqueued is not None else 0.0
        if waited > LATE_BATCH_SECONDS:  # the consumer, or the partition's batch before it, held it up
            self.note(f"partition {context.partition_id}: {len(events)} events reached the trigger {waited:.1f} s late")
        if waited > SLOW_INVOCATION_SECONDS:  # say so in pipeline.log too
            log.warning("partition %s: a batch enqueued %.1f s ago reached the trigger", context.partition_id, waited)
        with self._lock:
            work = self._partitions.get(context.partition_id)
            if work is None:
                work = self._partitions[context.partition_id] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._partition_loop, args=(work,), name=f"partition-{context.partition_id}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        work.put((context, events[-1], to_function_batch(events)))

    def _partition_loop(self, work: queue.SimpleQueue[Any]) -> None:
        """One partition's batches, in order; its checkpoint after each (the host checkpoints after the function)."""
        while (item := work.get()) is not None:
            context, last, batch = item
            self.deliver(batch)
            if not self._stopping.is_set():
                with _stack_if_slow("update_checkpoint", self.note):
                    context.update_checkpoint(last)

    def deliver(self, batch: list[func.EventHubEvent]) -> bool:
        """One invocation of the trigger with the host's retry policy; True if the function succeeded."""
        backoff = Backoff(initial=self._retry[0], maximum=self._retry[1], rng=self._rng)
        for attempt in range(1, self._max_attempts + 1):
            started = time.monotonic()
            try:
                with _stack_if_slow(f"ingest_envelopes ({len(batch)} events, attempt {attempt})", self.note):
                    self._ingest(batch)
            except Exception as error:
                with self._lock:
                    self.stats.retries += 1
                    self.stats.errors.append(f"ingest_envelopes: {type(error).__name__}: {error}")
                log.exception("ingest_envelopes failed (attempt %d of %d)", attempt, self._max_attempts)
                if attempt == self._max_attempts or self._stopping.is_set():
                    break
                self._stopping.wait(backoff.next_delay())
                continue
            with self._lock:
                self.stats.batches += 1
                self.stats.events += len(batch)
                self.stats.slowest_batch = max(self.stats.slowest_batch, time.monotonic() - started)
            return True
        with self._lock:
            self.stats.failed_batches += 1
        return False

    def _tick_loop(self) -> None:
        assert self._timer is not None
        while not self._stopping.wait(self._timer_interval):
            self.tick()

    def tick(self) -> None:
        assert self._timer is not None
        started = time.monotonic()
        try:
            with _stack_if_slow("reevaluate", self.note):
                self._timer(TimerRequest(past_due=False))
        except Exception as error:
            with self._lock:
                self.stats.failed_ticks += 1
                self.stats.errors.append(f"reevaluate: {type(error).__name__}: {error}")
            log.exception("reevaluate failed")
            return
        with self._lock:
            self.stats.ticks += 1
            self.stats.slowest_tick = max(self.stats.slowest_tick, time.monotonic() - started)


@contextlib.contextmanager
def _stack_if_slow(what: str, note: Callable[[str], None]) -> Iterator[None]:
    """Logs (and ``note``s) where the calling thread is if ``what`` is still running after
    ``SLOW_INVOCATION_SECONDS``."""
    thread = threading.get_ident()

    def report() -> None:
        frame = sys._current_frames().get(thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)"
        log.warning("%s still running after %g s, at:\n%s", what, SLOW_INVOCATION_SECONDS, stack)
        note(f"{what} still running after {SLOW_INVOCATION_SECONDS:g} s, at: {stack[-1500:]}")

    timer = threading.Timer(SLOW_INVOCATION_SECONDS, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def wait_until(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
