"""A health gate's page for the tests that serve one locally (the ``health`` fixture, tests/conftest.py)."""

from __future__ import annotations

from tests.loopback import QuietHandler


class HealthPage(QuietHandler):
    """A health gate's page: answers every GET with ``status`` (set it on the class the fixture yields)."""

    status = 200

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.end_headers()
