"""A health gate's page for the tests that serve one locally (the ``health`` fixture, tests/conftest.py)."""

from __future__ import annotations

import http.server
from typing import Any


class HealthPage(http.server.BaseHTTPRequestHandler):
    """A health gate's page: answers every GET with ``status`` (set it on the class the fixture yields)."""

    status = 200

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return
