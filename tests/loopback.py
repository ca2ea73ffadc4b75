"""What the tests' loopback stand-ins share: the HTTP ones (a webhook, an ingestion endpoint, a listener, IMDS, ARM)
log nothing (a test reads what they recorded) and answer with a status and, for most, a JSON body; the raw TCP ones
(a server scripted byte by byte) accept connections on a thread of their own."""

from __future__ import annotations

import socket
import threading
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


class SocketServer:
    """A raw TCP server on a free loopback port: a thread accepts each connection and hands it to ``handle`` (which
    owns it), until ``close``. A subclass sets its own state before calling ``__init__``."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed at teardown
            self.handle(connection)

    def handle(self, connection: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()
