"""Card sinks: ``TeamsWebhookSink`` (HTTPS POST to a Teams Workflows webhook, "When a Teams webhook request is
received", retried with the one backoff; the URL is a secret and never logged) and ``FolderCardSink`` (local mode: one
JSON file per card). Cards themselves are built in ``coordinator/domain/cards.py``.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import requests

from coordinator.adapters import deadline
from coordinator.domain.cards import card_bytes
from coordinator.domain.retry import Backoff

__all__ = ["AlertError", "AlertSink", "FolderCardSink", "TeamsWebhookSink"]


class AlertError(RuntimeError):
    """The card could not be delivered (after retries); the caller keeps it pending and tries again later."""


class AlertSink(Protocol):
    def send(self, card: dict[str, Any], *, key: str) -> None: ...


_SIGNATURE = re.compile(r"([?&](?:sig|code)=)[^&\s\"]+", re.IGNORECASE)


class _RedactSignatures(logging.Filter):
    """urllib3 logs request lines (with the query string) at DEBUG: keep the webhook signature out of logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _SIGNATURE.sub(r"\1***", message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


_REDACT = _RedactSignatures()


class TeamsWebhookSink:
    """POSTs cards to a Teams Workflows webhook. The URL carries a signature (``sig=``): never log it."""

    def __init__(
        self,
        *,
        webhook_url: str,
        attempts: int = 3,
        timeout: float = 10.0,
        deadline_seconds: float = 30.0,
        backoff_initial: float = 0.5,
        backoff_maximum: float = 8.0,
        session: requests.Session | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._url = webhook_url
        self._attempts = attempts
        self._timeout = timeout
        # The total deadline of one card's send, its retries included: cards are posted by the run's tail.
        self._deadline = deadline_seconds
        self._backoff = Backoff(backoff_initial, backoff_maximum, rng or random.Random())  # noqa: S311 -- jitter
        self._session = session or deadline.session()
        self._sleep = sleep
        for name in ("urllib3.connectionpool", "requests"):
            if _REDACT not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_REDACT)

    def send(self, card: dict[str, Any], *, key: str) -> None:
        body = card_bytes(card)
        last = ""
        attempts = 0
        # The exception texts name the card, never the URL (it is a secret).
        try:
            with deadline.deadline(self._deadline, f"Teams webhook (card {key})") as limit:
                for attempt in range(self._attempts):
                    if attempt:
                        delay = self._backoff.delay(attempt - 1)
                        if delay >= limit.remaining():
                            break
                        self._sleep(delay)
                    attempts += 1
                    try:
                        response = self._session.post(
                            self._url,
                            data=body,
                            headers={"Content-Type": "application/json"},
                            timeout=min(self._timeout, max(0.1, limit.remaining())),
                        )
                    except requests.RequestException as error:
                        last = type(error).__name__  # past the deadline, the block's end says so
                        continue
                    if response.status_code < 300:
                        return
                    last = f"HTTP {response.status_code}"
                    if response.status_code < 500 and response.status_code != 429:
                        break
        except deadline.DeadlineExceeded:  # whatever the last attempt seemed to get, it was not read whole
            last = f"no answer within the {self._deadline:g} s deadline"
        raise AlertError(f"Teams webhook refused card {key}: {last} after {attempts} attempts")


class FolderCardSink:
    """Local mode: writes each card as ``{key}.json`` into a folder."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def send(self, card: dict[str, Any], *, key: str) -> None:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:180]
        try:
            (self.folder / f"{name}.json").write_bytes(card_bytes(card))
        except OSError as error:
            raise AlertError(f"cannot write card {key} to {self.folder}: {error.strerror}") from error
