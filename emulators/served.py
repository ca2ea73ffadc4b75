"""What every local emulator is as a context manager (started on entry, stopped on exit), and how each of the local
HTTP servers (the emulators', the stack's pages) is served and closed."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class Served:
    """A server with ``start()`` and ``stop()``; ``with`` starts it and stops it however the block ends."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def serve_in_thread(server: ThreadingHTTPServer, *, name: str) -> threading.Thread:
    """Serves ``server`` on a daemon thread of its own, each request on a daemon thread too (a request a test leaves
    hanging never holds up the process's exit), looking for a shutdown every 0.2 s."""
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True, name=name)
    thread.start()
    return thread


def serve_local(handler: type[BaseHTTPRequestHandler], *, name: str, **attributes: Any) -> ThreadingHTTPServer:
    """A server of ``handler`` on a free port of 127.0.0.1, served by ``serve_in_thread``; ``attributes`` are set on
    it for the handler to read (``self.server.<name>``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for key, value in attributes.items():
        setattr(server, key, value)
    serve_in_thread(server, name=name)
    return server


def close(server: ThreadingHTTPServer | None) -> None:
    """Stops serving (the serving thread returns) and closes the listening socket; nothing when not started."""
    if server is not None:
        server.shutdown()
        server.server_close()
