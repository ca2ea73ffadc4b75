"""The Hybrid Connections control messages as pydantic models (the JSON in WebSocket text frames).

Service → listener: ``accept``, ``request``. Listener → service: ``response``, ``renewToken``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# RFC 7230 headers that concern one hop only; the service neither forwards them to the listener nor takes them from
# the listener's response (it computes its own framing).
HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "host",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "close",
        "keep-alive",
        "proxy-connection",
    }
)
FORBIDDEN_LISTENER_STATUS = frozenset({502, 504})
# The sender's relay token: checked by the service, never forwarded to the listener.
AUTH_HEADERS = frozenset({"servicebusauthorization"})


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    def to_json(self, envelope: str) -> str:
        return json.dumps({envelope: self.model_dump(by_alias=True, exclude_none=True)}, separators=(",", ":"))


class AcceptMessage(_Wire):
    address: str
    id: str
    connect_headers: dict[str, str] = Field(alias="connectHeaders")
    remote_endpoint: dict[str, Any] | None = Field(default=None, alias="remoteEndpoint")


class RequestMessage(_Wire):
    """A ``request``; for a rendezvous announcement only ``address`` and ``id`` are set."""

    address: str | None = None
    id: str
    request_target: str | None = Field(default=None, alias="requestTarget")
    method: str | None = None
    request_headers: dict[str, str] | None = Field(default=None, alias="requestHeaders")
    body: bool | None = None


class ResponseMessage(_Wire):
    """A listener's ``response``. ``statusCode`` is a number on the wire; the doc's string example is tolerated."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    request_id: str = Field(alias="requestId", min_length=1)
    status_code: int = Field(alias="statusCode", ge=100, le=999)
    status_description: str | None = Field(default=None, alias="statusDescription")
    response_headers: dict[str, str] = Field(default_factory=dict, alias="responseHeaders")
    body: bool = False

    @field_validator("status_code")
    @classmethod
    def _not_a_gateway_status(cls, value: int) -> int:
        if value in FORBIDDEN_LISTENER_STATUS:
            raise ValueError(f"a listener may not answer {value}; 502 and 504 are reserved for the service")
        return value

    @field_validator("response_headers", mode="before")
    @classmethod
    def _header_values_as_text(cls, value: Any) -> Any:
        # Node's setHeader keeps numbers and arrays; the wire JSON then carries them as such.
        if isinstance(value, dict):
            return {
                str(name): ", ".join(map(str, item)) if isinstance(item, list) else str(item)
                for name, item in value.items()
                if item is not None
            }
        return value


class RenewTokenMessage(_Wire):
    token: str = Field(min_length=1)


class ControlMessageError(ValueError):
    """A listener's text frame that is not a valid control message."""


def parse_listener_message(text: str) -> ResponseMessage | RenewTokenMessage:
    """Parses a listener → service text frame; raises ControlMessageError naming what is wrong."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ControlMessageError(f"control frame is not JSON: {error}") from None
    if not isinstance(document, dict) or len(document) != 1:
        raise ControlMessageError("control frame must be a JSON object with exactly one of: response, renewToken")
    (kind, payload), *_ = document.items()
    model: type[ResponseMessage] | type[RenewTokenMessage]
    if kind == "response":
        model = ResponseMessage
    elif kind == "renewToken":
        model = RenewTokenMessage
    else:
        raise ControlMessageError(f"unknown control message {kind!r} (expected response or renewToken)")
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ControlMessageError(f"invalid {kind}: {details}") from None


def request_id_of(text: str) -> str | None:
    """Best effort: the requestId of a malformed response, so that its sender can be told instead of timing out."""
    try:
        document = json.loads(text)
        value = document["response"]["requestId"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def strip_sb_query(query: str) -> str:
    """The query string without any ``sb-hc-`` parameter, otherwise byte-for-byte as the sender wrote it."""
    kept = [part for part in query.split("&") if part and not unquote(part).lower().startswith("sb-hc-")]
    return "&".join(kept)


def merge_headers(headers: Iterable[tuple[str, str]], drop: Callable[[str], bool]) -> dict[str, str]:
    merged: dict[str, str] = {}
    names: dict[str, str] = {}
    for name, value in headers:
        if drop(name.lower()):
            continue
        first = names.setdefault(name.lower(), name)
        merged[first] = f"{merged[first]}, {value}" if first in merged else value
    return merged
