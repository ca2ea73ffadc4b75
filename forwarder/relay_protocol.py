"""The Hybrid Connections HTTP gesture as data: the control messages a listener reads, the response frame it writes,
and the request and response its handler sees. No I/O: the listener (forwarder/relay_listener.py) moves these over
the WebSocket, the handler (forwarder/approver.py) works on `RelayRequest` and `RelayResponse` only.

Protocol reference: learn, azure-relay/relay-hybrid-connections-protocol (the ``request``, ``accept`` and
``response`` messages).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

from contracts import bounded_json
from contracts.checks import Flag, Maybe, Nested, Record, Text, TextMap, spec

# RFC 7230 connection headers must not appear in a response (protocol doc, "response" message).
_HOP_BY_HOP = frozenset({"connection", "content-length", "host", "te", "trailer", "transfer-encoding", "upgrade"})
_HOP_BY_HOP_CLOSE = _HOP_BY_HOP | {"close"}
# 502 and 504 are reserved for the service itself.
_RESERVED_STATUS = frozenset({502, 504})


@dataclass(frozen=True, kw_only=True)
class WireRequest(Record):
    """A ``request`` control message. Only ``address`` and ``id`` are present when a rendezvous is required."""

    EXTRA = "ignore"

    address: str = spec(Text(), "")
    id: str = spec(Text(), "")
    requestTarget: str = spec(Text(), "/")
    method: str | None = spec(Maybe(Text()), None)
    requestHeaders: dict[str, str] = spec(TextMap(), factory=dict)
    body: bool = spec(Flag(), False)


@dataclass(frozen=True, kw_only=True)
class WireAccept(Record):
    EXTRA = "ignore"

    address: str = spec(Text())
    id: str = spec(Text(), "")


@dataclass(frozen=True, kw_only=True)
class ControlMessage(Record):
    EXTRA = "ignore"

    request: WireRequest | None = spec(Maybe(Nested(WireRequest)), None)
    accept: WireAccept | None = spec(Maybe(Nested(WireAccept)), None)


@dataclass(frozen=True)
class RelayRequest:
    """One HTTP request relayed to this listener. ``path`` is relative to the hybrid connection, without query."""

    id: str
    method: str
    target: str
    path: str
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class RelayResponse:
    status_code: int
    status_description: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    @classmethod
    def json(cls, status_code: int, payload: Any, *, description: str = "") -> RelayResponse:
        body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
        return cls(status_code, description, {"Content-Type": "application/json"}, body)


Handler = Callable[[RelayRequest], RelayResponse]


def relay_request(wire: WireRequest, body: bytes, *, hybrid_connection: str) -> RelayRequest:
    """The request as the handler sees it: method upper case, header names lower case, path relative."""
    return RelayRequest(
        id=wire.id,
        method=(wire.method or "GET").upper(),
        target=wire.requestTarget,
        path=relative_path(wire.requestTarget, hybrid_connection),
        headers={k.lower(): v for k, v in wire.requestHeaders.items()},
        body=body,
    )


def relative_path(target: str, hybrid_connection: str) -> str:
    path = urlsplit(target).path or "/"
    prefix = "/" + hybrid_connection.lower()
    if path.lower() == prefix:
        return "/"
    if path.lower().startswith(prefix + "/"):
        return path[len(prefix) :]
    return path


def response_frame(request_id: str, response: RelayResponse) -> str:
    status = 500 if response.status_code in _RESERVED_STATUS else response.status_code
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP_CLOSE}
    message = {
        "response": {
            "requestId": request_id,
            "statusCode": status,
            "statusDescription": response.status_description,
            "responseHeaders": headers,
            "body": bool(response.body),
        }
    }
    return json.dumps(message, separators=(",", ":"))


def request_id_of(message: str, *, max_bytes: int) -> str | None:
    """The ``request.id`` of a control message that is JSON but not a valid request, so that it can be refused
    on its own; None when there is none to answer."""
    try:
        data = bounded_json.loads(message, max_bytes=max_bytes)
    except bounded_json.JsonRefused:
        return None
    request = data.get("request") if isinstance(data, dict) else None
    request_id = request.get("id") if isinstance(request, dict) else None
    return request_id if isinstance(request_id, str) and request_id else None


def with_query(address: str, params: Mapping[str, str]) -> str:
    return f"{address}{'&' if '?' in address else '?'}{urlencode(params)}"
