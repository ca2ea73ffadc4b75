"""What the Functions host does for ``function_app``'s HTTP triggers, done locally: an HTTP server on 127.0.0.1 that
turns each request into the ``func.HttpRequest`` the Python worker builds (method, full URL, headers, query, route
parameters, body), calls the function whose route matches, and writes its ``func.HttpResponse`` back.

The routes are function_app's (``ROUTES``; tests/local/test_people_browser.py checks them against the indexed
functions) under the host's default route prefix ``api``. In Azure, App Service Authentication runs in front of
the host; locally ``local/easy_auth.py`` does, as a ``Handler`` wrapped around ``FunctionsHttpHost``.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from urllib.parse import parse_qsl, unquote, urlsplit

import azure.functions as func

log = logging.getLogger("local.http_host")

ROUTE_PREFIX = "/api"
# function_app's HTTP functions: (route template, function name, methods), as their decorators declare them.
ROUTES: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("events", "pending_events", frozenset({"GET"})),
    ("events/{event_id}/approve", "approve_event", frozenset({"GET", "POST"})),
)
MAX_BODY = 64 * 1024  # an approval form is a few hundred bytes


@dataclass(frozen=True)
class Request:
    """One HTTP request as it arrived: ``target`` is the path and query, ``headers`` in the order sent."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    base_url: str

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


Handler = Callable[[Request], Answer]


def _pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", template)
    # Literal text and {name} parameters alternate; a parameter is one path segment.
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)" for i, part in enumerate(parts))
    return re.compile(f"^{re.escape(ROUTE_PREFIX)}/{regex}/?$")


class FunctionsHttpHost:
    """Calls function_app's HTTP functions as the host would. ``app`` gives the function_app module at call time
    (imported once the app settings are in the environment; the local stack may swap its coordinator)."""

    def __init__(self, app: Callable[[], ModuleType]) -> None:
        self._app = app
        self._routes = [(_pattern(template), name, methods) for template, name, methods in ROUTES]

    def __call__(self, request: Request) -> Answer:
        for pattern, name, methods in self._routes:
            matched = pattern.match(request.path)
            if matched is None:
                continue
            if request.method not in methods:
                return Answer(405, [("Allow", ", ".join(sorted(methods)))])
            function: Callable[[func.HttpRequest], func.HttpResponse] = getattr(self._app(), name)
            response = function(
                func.HttpRequest(
                    method=request.method,
                    url=request.base_url + request.target,
                    headers=dict(request.headers),
                    params=dict(parse_qsl(urlsplit(request.target).query)),
                    route_params={key: unquote(value) for key, value in matched.groupdict().items()},
                    body=request.body,
                )
            )
            headers = [(key, value) for key, value in response.headers.items() if key.lower() != "content-type"]
            content_type = response.mimetype + (f"; charset={response.charset}" if response.charset else "")
            return Answer(response.status_code, [("Content-Type", content_type), *headers], response.get_body())
        return Answer(404, [("Content-Type", "text/plain; charset=utf-8")], b"no function has this route\n")


class LocalHttpServer:
    """``handler`` served on 127.0.0.1:``port`` (0: any free port) from a thread per request, as the host serves
    requests concurrently. The port is bound at construction, so ``base_url`` is known before ``start``; or it serves
    ``listening``, a socket bound and listening already (another process's, which it handed over: ``fileno``)."""

    def __init__(self, handler: Handler, *, port: int = 0, listening: socket.socket | None = None) -> None:
        self._handler = handler
        if listening is None:
            self._server = ThreadingHTTPServer(("127.0.0.1", port), self._request_handler())
        else:
            self._server = ThreadingHTTPServer(listening.getsockname(), self._request_handler(), False)
            self._server.socket.close()
            self._server.socket = listening
            self._server.server_address = listening.getsockname()
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fileno(self) -> int:
        """The listening socket, for a process that serves it instead of this one (local/host.py)."""
        return self._server.fileno()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-http-trigger", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def _request_handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    # The body stays unread on the connection: close it rather than read it as the next request.
                    self.close_connection = True
                    self._write(Answer(413, [("Content-Type", "text/plain; charset=utf-8")], b"body too large\n"))
                    return
                request = Request(
                    method=self.command,
                    target=self.path,
                    headers=list(self.headers.items()),
                    body=self.rfile.read(length) if length else b"",
                    base_url=server.base_url,
                )
                try:
                    answer = server._handler(request)
                except Exception:  # the host answers 500 and goes on serving, as the Functions host does
                    log.exception("%s %s failed", self.command, self.path)
                    answer = Answer(500, [("Content-Type", "text/plain; charset=utf-8")], b"function failed\n")
                self._write(answer)

            def _write(self, answer: Answer) -> None:
                self.send_response(answer.status)
                for key, value in answer.headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            do_GET = do_POST = _serve

            def log_message(self, format: str, *args: object) -> None:
                log.debug("%s " + format, self.address_string(), *args)

        return _Handler
