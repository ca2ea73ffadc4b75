"""Just enough HTTP/1.1 for the sender side: read requests (Content-Length or chunked), write responses.

Connections are persistent (HTTP/1.1 keep-alive, no pipelining), because the service ties a rendezvous socket
to the sender's connection.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from emulators.status_error import StatusError

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024


class HttpError(StatusError):
    """The sender's request cannot be read; answer ``status`` and close."""


@dataclass(frozen=True)
class HttpRequest:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    chunked: bool

    @property
    def keep_alive(self) -> bool:
        tokens = {token.strip().lower() for token in (self.header("Connection") or "").split(",")}
        return "keep-alive" in tokens if self.version == "HTTP/1.0" else "close" not in tokens

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> str:
        return urlsplit(self.target).query

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((value for key, value in self.headers if key.lower() == lowered), None)

    def query_value(self, name: str) -> str | None:
        return next((value for key, value in parse_qsl(self.query, keep_blank_values=True) if key == name), None)


def is_websocket_upgrade(head: bytes) -> bool:
    """True when a request head asks for a WebSocket upgrade (so websockets should handle the connection)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"upgrade" and b"websocket" in value.lower():
            return True
    return False


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"malformed request line {lines[0][:100]!r}")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"malformed header line {line[:100]!r}")
        headers.append((name, value.strip()))
    return parts[0], parts[1], parts[2], headers


async def read_request(reader: asyncio.StreamReader, *, send_continue: Callable[[], None]) -> HttpRequest | None:
    """Reads one request, or None when the sender closed the connection between requests.

    ``send_continue`` writes the interim 100 when the sender waits for it before sending the body.
    """
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(431, f"request head larger than {MAX_HEAD_BYTES} bytes") from None
    except asyncio.IncompleteReadError as error:
        if not error.partial.strip():
            return None
        raise HttpError(400, "connection closed before the request head ended") from None
    method, target, version, headers = parse_head(head[:-4])
    names = {name.lower(): value for name, value in headers}
    chunked = "chunked" in names.get("transfer-encoding", "").lower()
    if names.get("expect", "").lower() == "100-continue":
        send_continue()
    try:
        if chunked:
            body = await _read_chunked(reader)
        else:
            length = int(names.get("content-length", "0"))
            if length < 0 or length > MAX_BODY_BYTES:
                raise HttpError(413, f"Content-Length {length} outside 0..{MAX_BODY_BYTES}")
            body = await reader.readexactly(length)
    except ValueError:
        raise HttpError(400, "malformed Content-Length or chunk size") from None
    except asyncio.IncompleteReadError:
        raise HttpError(400, "connection closed before the request body ended") from None
    return HttpRequest(method, target, version, headers, body, chunked)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            # Trailers (ignored) up to the empty line.
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass
            return bytes(body)
        if len(body) + size > MAX_BODY_BYTES:
            raise HttpError(413, f"chunked body larger than {MAX_BODY_BYTES} bytes")
        body += await reader.readexactly(size)
        await reader.readexactly(2)


def render_response(
    status: int,
    reason: str | None,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    head_only: bool = False,
    keep_alive: bool = False,
) -> bytes:
    """A complete HTTP/1.1 response with Content-Length (and ``Connection: close`` unless kept alive)."""
    if reason is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
    # Reason phrases cannot carry line breaks; a listener's statusDescription is untrusted.
    reason = reason.replace("\r", " ").replace("\n", " ")
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{name}: {value}" for name, value in headers if "\n" not in value and "\r" not in value]
    lines += [f"Content-Length: {len(body)}", *([] if keep_alive else ["Connection: close"]), "", ""]
    return "\r\n".join(lines).encode("latin-1", errors="replace") + (b"" if head_only else body)


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    reason: str | None
    headers: list[tuple[str, str]]
    body: bytes


def tracked(description: str) -> str:
    """A description with a tracking id, as the service's error descriptions carry one."""
    return f"{description} TrackingId:{uuid.uuid4()}"


def service_error(status: int, description: str) -> HttpAnswer:
    """An answer generated by the service itself (so without ``Via``), description in reason and body."""
    text = tracked(description)
    return HttpAnswer(status, text[:400], [("Content-Type", "text/plain; charset=utf-8")], (text + "\n").encode())


def json_answer(status: int, document: Any) -> HttpAnswer:
    return HttpAnswer(status, None, [("Content-Type", "application/json")], json.dumps(document).encode())
