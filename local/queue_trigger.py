"""What the Functions host's queue trigger does for ``function_app.continue_approval``, done locally on Azurite.

The host polls the queue (host.json ``queues``): it takes up to ``batchSize`` messages at a time, each hidden while
its invocation runs, and calls the function once per message, concurrently; a message whose invocation succeeded is
deleted; one whose invocation raised becomes visible again ``visibilityTimeout`` later, and one dequeued
``maxDequeueCount`` times is moved to ``{queue}-poison``. An empty queue is polled again after a delay that doubles
from 100 ms up to ``maxPollingInterval``. This class does the same over Azure Storage's queue REST API (Get Messages,
Delete Message, Update Message, Put Message), with an account SAS of Azurite's development account; the function
gets the worker's ``func.QueueMessage`` with the decoded body and the dequeue count.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote
from xml.etree import ElementTree

import azure.functions as func
import requests
from azure.functions.queue import QueueMessage

log = logging.getLogger("local.queue_trigger")

QueueFunction = Callable[[func.QueueMessage], None]
API_VERSION = "2021-12-02"
FIRST_POLL_DELAY = 0.1
# While an invocation runs its message stays hidden; the host renews that lease, this stand-in takes one longer than
# any continuation (the 30 s approval deadline).
LEASE_SECONDS = 120


@dataclass(frozen=True)
class QueueSettings:
    """host.json's ``extensions.queues``, as the host reads them."""

    batch_size: int = 16
    max_polling_interval: float = 1.0
    visibility_timeout: float = 5.0
    max_dequeue_count: int = 5

    @classmethod
    def from_host_json(cls, path: Path) -> QueueSettings:
        queues = json.loads(path.read_text(encoding="utf-8"))["extensions"]["queues"]
        return cls(
            batch_size=int(queues["batchSize"]),
            max_polling_interval=_seconds(queues["maxPollingInterval"]),
            visibility_timeout=_seconds(queues["visibilityTimeout"]),
            max_dequeue_count=int(queues["maxDequeueCount"]),
        )


def _seconds(text: str) -> float:
    hours, minutes, seconds = text.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


@dataclass
class QueueStats:
    invocations: int = 0
    failed: int = 0
    poisoned: int = 0


class StorageQueue:
    """One queue of Azurite's development account, over the REST API with an account SAS."""

    def __init__(self, *, queue_url: str, sas: str, timeout: float = 10.0) -> None:
        self.url = queue_url.rstrip("/")
        self._sas = sas
        self._timeout = timeout
        self._session = requests.Session()
        self._session.headers["x-ms-version"] = API_VERSION

    def _call(self, method: str, path: str = "", query: str = "", body: str | None = None) -> requests.Response:
        url = f"{self.url}{path}?{query + '&' if query else ''}{self._sas}"
        response = self._session.request(method, url, data=body, timeout=self._timeout)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {self.url}{path}: HTTP {response.status_code} {response.text[:300]}")
        return response

    def create(self) -> None:
        self._call("PUT")

    def put(self, text: str) -> None:
        self._call("POST", "/messages", body=f"<QueueMessage><MessageText>{text}</MessageText></QueueMessage>")

    def get(self, count: int, visibility_timeout: int) -> list[dict[str, str]]:
        answer = self._call("GET", "/messages", f"numofmessages={count}&visibilitytimeout={visibility_timeout}")
        # The answer of the local emulator this class talks to, not input from outside.
        root = ElementTree.fromstring(answer.content)  # noqa: S314
        return [{child.tag: child.text or "" for child in message} for message in root.findall("QueueMessage")]

    def delete(self, message_id: str, pop_receipt: str) -> None:
        self._call("DELETE", f"/messages/{message_id}", f"popreceipt={quote(pop_receipt, safe='')}")

    def release(self, message_id: str, pop_receipt: str, visibility_timeout: int) -> None:
        """Makes a message visible again ``visibility_timeout`` seconds from now (Update Message)."""
        receipt = quote(pop_receipt, safe="")
        self._call("PUT", f"/messages/{message_id}", f"popreceipt={receipt}&visibilitytimeout={visibility_timeout}")

    def close(self) -> None:
        self._session.close()


class QueueTrigger:
    """Polls ``queue`` and calls ``function`` for each message with the host's retry and poison handling."""

    def __init__(
        self, *, queue: StorageQueue, poison: StorageQueue, function: QueueFunction, settings: QueueSettings
    ) -> None:
        self._queue = queue
        self._poison = poison
        self._function = function
        self._settings = settings
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.batch_size, thread_name_prefix="local-queue-trigger"
        )
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stats = QueueStats()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, name="local-queue-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _poll(self) -> None:
        delay = FIRST_POLL_DELAY
        while not self._stopping.is_set():
            try:
                messages = self._queue.get(self._settings.batch_size, LEASE_SECONDS)
            except (requests.RequestException, RuntimeError):
                log.warning("the delivery queue could not be read; polling again", exc_info=True)
                messages = []
            for message in messages:
                self._pool.submit(self._invoke, message)
            if messages:
                delay = FIRST_POLL_DELAY
                continue
            self._stopping.wait(delay)
            delay = min(delay * 2, self._settings.max_polling_interval)

    def _invoke(self, message: dict[str, str]) -> None:
        dequeued = int(message["DequeueCount"])
        # The worker's own class (dequeue count and all), which azure-functions ships untyped.
        item = QueueMessage(  # type: ignore[no-untyped-call]
            id=message["MessageId"],
            body=base64.b64decode(message["MessageText"]),
            dequeue_count=dequeued,
            pop_receipt=message["PopReceipt"],
        )
        try:
            self._function(item)
        except Exception:
            log.exception("continue_approval failed (dequeued %d times)", dequeued)
            with self._lock:
                self.stats.failed += 1
            self._after_failure(message, dequeued)
            return
        finally:
            with self._lock:
                self.stats.invocations += 1
        self._queue.delete(message["MessageId"], message["PopReceipt"])

    def _after_failure(self, message: dict[str, str], dequeued: int) -> None:
        if dequeued >= self._settings.max_dequeue_count:
            self._poison.put(message["MessageText"])
            self._queue.delete(message["MessageId"], message["PopReceipt"])
            with self._lock:
                self.stats.poisoned += 1
            return
        self._queue.release(message["MessageId"], message["PopReceipt"], round(self._settings.visibility_timeout))
