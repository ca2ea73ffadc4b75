"""Structured logs: one JSON object per line (ts, level, msg, logger, fields) on stderr, for journald; and
`FailureLog`, so that a failure that repeats every second is not a log line every second.

Stdout is left alone because the stdout sink writes envelopes there.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

# While something keeps failing, repeat its log line at most this often (the first failure is always logged).
FAILURE_LOG_INTERVAL = 60.0


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "msg": record.getMessage(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if fields:
            line["fields"] = fields
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


def configure(*, level: str = "INFO", stream: TextIO | None = None) -> None:
    """Route every logger of the process through one JSON handler (idempotent)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The AMQP stack logs every frame at INFO; keep its warnings only.
    for noisy in ("azure", "uamqp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fields(**values: Any) -> dict[str, Any]:
    """`log.info("msg", extra=fields(a=1))` puts a=1 under "fields" in the JSON line."""
    return {"fields": values}


class FailureLog:
    """Logs the first failure, then at most once a minute while failing, then the recovery."""

    def __init__(self, what: str, *, logger: logging.Logger) -> None:
        self._what = what
        self._log = logger
        self._failures = 0
        self._last_logged = 0.0

    def failed(self, error: BaseException, **extra: Any) -> None:
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1 or now - self._last_logged >= FAILURE_LOG_INTERVAL:
            self._last_logged = now
            self._log.warning(f"{self._what} failing", extra=fields(error=str(error), failures=self._failures, **extra))

    def succeeded(self) -> None:
        if self._failures:
            self._log.info(f"{self._what} recovered", extra=fields(failures=self._failures))
        self._failures = 0
