"""The IMDS emulator's HTTP plumbing: one request handler (the body read whole first), the answers that end a request
early (a status and a JSON body, or no answer at all), and the request bodies parsed into the emulator's models."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from emulators.imds.models import (
    describe_validation_error,
)
from emulators.imds.records import EmulatorInputError

MAX_BODY = 64 * 1024
JSON = "application/json; charset=utf-8"
_M = TypeVar("_M", bound=BaseModel)


class Reply(Exception):
    """Ends a request with a status, a JSON body (none for 204) and headers: the error shapes of the real service,
    and ARM's answers that carry headers (a long-running operation's ``Azure-AsyncOperation``)."""

    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or {}


class NoAnswer(Exception):
    """Ends a request with no response at all: the connection is closed (the VM is gone)."""


def bad_request(message: str) -> Reply:
    return Reply(400, {"error": f"Bad request. {message}"})


def parse_model(model: type[_M], data: Any, *, source: str) -> _M:
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise EmulatorInputError(describe_validation_error(error, source=source)) from error


def json_body(handler: RequestHandler) -> Any:
    raw = handler.read_body()
    try:
        return json.loads(raw or b"null")
    except json.JSONDecodeError as error:
        raise EmulatorInputError(f"request body is not JSON: {error}") from error


class _Emulator(Protocol):
    def handle_request(self, handler: RequestHandler, method: str) -> tuple[int, bytes, str]: ...


class RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; without this, Nagle + delayed ACK add ~40 ms per response.
    disable_nagle_algorithm = True
    server_version = "Microsoft-IIS/10.0"  # what IMDS answers with; some clients log it
    sys_version = ""

    def read_body(self) -> bytes:
        return self._body

    def _take_body(self) -> None:
        # Read the whole body before anything can answer early (a fault, a refused header): a body left unread
        # on a keep-alive connection would be parsed as the next request.
        self._body = b""
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            raise bad_request(f"body of {length} bytes is larger than {MAX_BODY}")
        if length:
            self._body = self.rfile.read(length)

    def _dispatch(self) -> None:
        """Any method the emulator serves: the emulator answers the request (its method is ``self.command``)."""
        emulator: _Emulator = self.server.emulator  # type: ignore[attr-defined]
        headers: dict[str, str] = {}
        try:
            self._take_body()
            status, body, content_type = emulator.handle_request(self, self.command)
        except NoAnswer:
            self.close_connection = True
            return
        except Reply as reply:
            status, content_type = reply.status, JSON
            body = b"" if status == 204 else json.dumps(reply.body).encode()
            headers = reply.headers
        except EmulatorInputError as error:
            status, body, content_type = 400, json.dumps({"error": str(error)}).encode(), JSON
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = do_PUT = _dispatch

    def log_message(self, format: str, *args: Any) -> None:
        # Silence the per-request stderr lines; the control API and /_emulator/vms carry the counts.
        return
