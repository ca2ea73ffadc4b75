"""What the tests' loopback HTTP stand-ins (a webhook, an ingestion endpoint, a listener, IMDS, ARM) share: they log
nothing (a test reads what they recorded) and answer with a status and, for most, a JSON body."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that writes no access log."""

    def respond(self, status: int, body: bytes | None = None) -> None:
        """``status`` with ``body`` as JSON; without one (None), an empty answer with no content type."""
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return
