"""Structured logs: one JSON object per line (ts, level, msg, logger, fields) on stderr, for journald.

Stdout is left alone because the stdout sink writes envelopes there.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO


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
