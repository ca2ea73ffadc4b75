"""The scenario's health pages, served for the policy's gates while a local run lasts."""

from __future__ import annotations

import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from emulators.imds.local_steps import HealthPage
from emulators.served import close, serve_local

log = logging.getLogger("local.stack")


class HealthPages:
    """The scenario's health pages, each served on its own free loopback port: a GET of any path answers the
    page's current status, which the scenario's ``healthPage`` steps change."""

    def __init__(self, pages: dict[str, HealthPage]) -> None:
        self._status = {name: page.status for name, page in pages.items()}
        self._servers: dict[str, ThreadingHTTPServer] = {}
        self.served: dict[str, str] = {}  # the URL as the policy names it -> the URL it is served on
        for name, page in pages.items():
            server = serve_local(self._handler(name), name=f"health-page-{name}")
            self._servers[name] = server
            served = urlsplit(page.url)._replace(netloc=f"127.0.0.1:{server.server_address[1]}")
            self.served[page.url] = urlunsplit(served)

    def _handler(self, name: str) -> type[BaseHTTPRequestHandler]:
        status = self._status

        class Page(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(status[name])
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return  # the coordinator's gate reads are not the run's output

        return Page

    def set(self, name: str, status: int) -> None:
        self._status[name] = status
        log.info("health page %s answers %d from now on", name, status)

    def stop(self) -> None:
        for server in self._servers.values():
            close(server)
        self._servers.clear()
