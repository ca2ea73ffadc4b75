"""IMDS client: the scheduled-events document, this VM's identity, and approvals (StartRequests).

Public and reusable: the poll loop and the relay listener share it (and its process-wide rate limiter).
One kept-alive connection with prebuilt requests (forwarder/keepalive.py says why not http.client): it never consults
proxy settings (IMDS must never go through a proxy, and a request carrying X-Forwarded-For is refused), and it keeps
the per-poll cost small.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from contracts import bounded_json
from contracts.attested import ATTESTED_API_VERSION, AttestationError
from contracts.checks import Invalid
from contracts.wire import (
    MAX_TAG_NAME,
    MAX_TAG_VALUE,
    MAX_TAGS,
    Attestation,
    ScheduledEvent,
    ScheduledEventsDocument,
    VmIdentity,
    read_content,
)
from forwarder.keepalive import KeepAliveConnection, build_request
from forwarder.logs import fields
from forwarder.retry import IMDS_LIMITER, Backoff, RateLimiter

DEFAULT_IMDS_URL = "http://169.254.169.254"
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
COMPUTE_PATH = "/metadata/instance/compute?api-version=2021-02-01"
IDENTITY_TOKEN_PATH = "/metadata/identity/oauth2/token?api-version=2018-02-01"  # noqa: S105 - a path
ATTESTED_PATH = f"/metadata/attested/document?api-version={ATTESTED_API_VERSION}"
# The first scheduled-events request switches the service on and may take up to two minutes.
FIRST_CALL_TIMEOUT = 130.0
# IMDS switches Scheduled Events off after 24 hours without a request; the next call is a first call again.
IDLE_DISABLE_SECONDS = 24 * 3600.0
MAX_BODY = 1 << 20

log = logging.getLogger("forwarder.imds")


class ImdsError(Exception):
    """IMDS could not give a usable answer."""


class ImdsUnavailable(ImdsError):
    """A transient failure (connection, timeout, 429, 5xx): try again after a backoff."""

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class ImdsDeadlinePassed(ImdsError):
    """A StartRequests POST that could only start after its deadline (its approval lapsed while it waited for the
    rate limiter or a retry): not sent, since the coordinator may by then have sent the event to a peer."""


class ImdsInvalidResponse(ImdsError):
    """IMDS answered, but with something that is not a valid document (or a 4xx): never act on it."""

    def __init__(self, message: str, *, body: bytes = b"") -> None:
        super().__init__(message)
        self.body = body


@dataclass(frozen=True)
class ManagedIdentityToken:
    """The IMDS token endpoint's answer (the fields the forwarder uses; IMDS sends numbers as strings)."""

    access_token: str
    expires_on: int

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> ManagedIdentityToken:
        data: Any = bounded_json.loads(raw, max_bytes=MAX_BODY)
        token, expires = (data.get("access_token"), data.get("expires_on")) if isinstance(data, dict) else (None, None)
        if not isinstance(token, str) or not token or not isinstance(expires, int | str) or isinstance(expires, bool):
            raise ValueError("access_token and expires_on are required")
        return cls(token, int(expires))


@dataclass(frozen=True)
class InvalidEvent:
    """One event of an otherwise valid document that failed validation: set aside, never forwarded or hooked."""

    event_id: str | None  # when the event has a string EventId, even if something else is wrong
    reason: str  # names the EventId (or the position) and the fields
    body: bytes  # the event as canonical JSON: equal bodies are the same bad content


@dataclass(frozen=True)
class ParsedDocument:
    document: ScheduledEventsDocument  # the valid events only
    invalid: tuple[InvalidEvent, ...]


def read_document(raw: bytes) -> ParsedDocument:
    """Validate a scheduled-events body event by event.

    A document that is not JSON, not an object, or lacks a valid DocumentIncarnation or Events list is
    ImdsInvalidResponse, as a whole. Within a valid document, each event is validated on its own: one bad event
    is set aside (in `invalid`) and the others are kept, so that it costs nobody their maintenance window.
    """
    try:
        data: Any = bounded_json.loads(raw, max_bytes=MAX_BODY)
    except bounded_json.JsonRefused as exc:  # not JSON, or nested too deep to walk safely
        raise ImdsInvalidResponse(f"scheduled-events document is invalid: {exc}", body=raw) from None
    if not isinstance(data, dict):
        raise ImdsInvalidResponse("scheduled-events document is invalid: document: not a JSON object", body=raw)
    items = data.get("Events", [])
    try:
        # The document without its events: DocumentIncarnation, Events being a list, and the unknown fields.
        ScheduledEventsDocument.from_mapping({**data, "Events": items if not isinstance(items, list) else []})
    except Invalid as exc:
        raise ImdsInvalidResponse(f"scheduled-events document is invalid: {exc}", body=raw) from None
    valid: list[Any] = []
    invalid: list[InvalidEvent] = []
    for index, item in enumerate(items):
        try:
            ScheduledEvent.from_mapping(item)
        except Invalid as exc:
            event_id = item.get("EventId") if isinstance(item, dict) else None
            event_id = event_id[:128] if isinstance(event_id, str) and event_id else None
            which = f"event {event_id!r} (Events[{index}])" if event_id else f"event at Events[{index}] (no EventId)"
            body = json.dumps(item, sort_keys=True, separators=(",", ":")).encode("utf-8")
            invalid.append(InvalidEvent(event_id, f"{which} is invalid: {exc}", body))
        else:
            valid.append(item)
    document = ScheduledEventsDocument.from_mapping({**data, "Events": valid})
    return ParsedDocument(document, tuple(invalid))


def parse_document(raw: bytes) -> ScheduledEventsDocument:
    """A scheduled-events body's valid events (see `read_document`); ImdsInvalidResponse names what is wrong
    with a document that is invalid as a whole."""
    return read_document(raw).document


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def tags_of(compute: dict[str, Any]) -> dict[str, str]:
    """The VM's tags from instance metadata: ``tagsList`` (name/value pairs, exact) when present, else ``tags``
    ('name:value;...', ambiguous when a value holds ';' or a name ':'). Kept within Azure's own limits (the first
    MAX_TAGS by name, each bounded), so a VM's odd metadata never costs it its envelopes."""
    pairs: list[tuple[str, str]] = []
    listed = compute.get("tagsList")
    if isinstance(listed, list):
        pairs = [
            (str(item.get("name", "")), str(item.get("value", "")))
            for item in listed
            if isinstance(item, dict) and item.get("name")
        ]
    elif isinstance(compute.get("tags"), str):
        for part in str(compute["tags"]).split(";"):
            name, sep, value = part.partition(":")
            if sep and name:
                pairs.append((name, value))
    bounded = {name[:MAX_TAG_NAME]: value[:MAX_TAG_VALUE] for name, value in sorted(pairs)}
    return dict(list(bounded.items())[:MAX_TAGS])


def identity_of(compute: dict[str, Any]) -> VmIdentity:
    """A VM's identity from its instance metadata's ``compute`` object. Raises Invalid."""
    # Only the identity fields: the rest of compute (osProfile, ...) has no business in envelopes; IMDS's ``tags``
    # is a 'name:value;...' string, the identity's a mapping (tags_of).
    known = {f.name for f in VmIdentity.specs()}
    fields_ = {k: v for k, v in compute.items() if k in known and k != "tags"}
    return VmIdentity.from_mapping({**fields_, "tags": tags_of(compute)})


class ImdsClient:
    """A small, thread-safe IMDS client on one kept-alive HTTP connection.

    :keyword base_url: IMDS root, or an emulator's per-VM base URL (`http://127.0.0.1:P/vm/web_0`).
    :keyword timeout: socket timeout for every call after the first successful one.
    :keyword first_call_timeout: timeout of the first scheduled-events call, whatever was called before it (the
        instance-metadata call does not wake Scheduled Events up), and of the first one after IDLE_DISABLE_SECONDS
        without an answer; also of the first call to the other endpoints.
    :keyword limiter: request rate limiter; the process-wide one by default so that every caller shares it.
    :keyword clock: monotonic seconds (tests move it past the 24-hour idle disable).
    """

    def __init__(
        self,
        *,
        base_url: str = DEFAULT_IMDS_URL,
        timeout: float = 10.0,
        first_call_timeout: float = FIRST_CALL_TIMEOUT,
        limiter: RateLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"imds base_url {base_url!r} must be an http:// URL (IMDS does not speak TLS)")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._timeout = timeout
        self._first_call_timeout = first_call_timeout
        self._limiter = limiter or IMDS_LIMITER
        self._lock = threading.Lock()
        self._conn = KeepAliveConnection(self._host, self._port, max_body=MAX_BODY)
        self._clock = clock
        self._answered = False  # any endpoint but scheduled events has answered
        self._events_answered_at: float | None = None  # clock() when scheduled events last answered
        self._authority = parts.netloc
        self._requests: dict[tuple[str, str], bytes] = {}

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self._port}{self._prefix}"

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        self._conn.close()

    def _request(self, method: str, path: str, body: bytes | None = None, *, before: float | None = None) -> bytes:
        """One request; returns the 200 body or raises ImdsUnavailable / ImdsInvalidResponse, or ImdsDeadlinePassed
        when it could go out only at or after ``before`` (monotonic)."""
        if body is None:
            request = self._requests.get((method, path))
            if request is None:
                request = build_request(method, self._authority, self._prefix + path)
                self._requests[(method, path)] = request
        else:
            request = build_request(
                method, self._authority, self._prefix + path, body=body, content_type="application/json"
            )
        events = path.startswith(SCHEDULED_EVENTS_PATH.partition("?")[0])
        self._limiter.acquire()
        if before is not None and time.monotonic() >= before:
            raise ImdsDeadlinePassed(f"IMDS {method} {path} not sent: its deadline passed while it waited its turn")
        with self._lock:
            timeout = self._timeout if self._awake(events=events) else self._first_call_timeout
            try:
                response = self._conn.exchange(request, timeout=timeout)
            except (OSError, ValueError) as exc:
                raise ImdsUnavailable(f"IMDS {method} {path} failed: {type(exc).__name__}: {exc}") from exc
            if events:
                self._events_answered_at = self._clock()
            else:
                self._answered = True
        status, data = response.status, response.body
        if status != 200:
            # After an error answer the server may not have read our request body; a fresh connection keeps the
            # next request from being parsed out of step.
            self.close()
        if status == 429 or status >= 500:
            raise ImdsUnavailable(
                f"IMDS {method} {path} answered {status}", status=status, retry_after=_retry_after(response.retry_after)
            )
        if status != 200:
            raise ImdsInvalidResponse(f"IMDS {method} {path} answered {status}: {data[:200]!r}", body=data)
        if len(data) > MAX_BODY:
            raise ImdsInvalidResponse(f"IMDS {method} {path} answered more than {MAX_BODY} bytes", body=data[:200])
        return data

    def _awake(self, *, events: bool) -> bool:
        """Whether the endpoint answered recently enough for the short timeout (called under the lock)."""
        if not events:
            return self._answered
        answered = self._events_answered_at
        return answered is not None and self._clock() - answered < IDLE_DISABLE_SECONDS

    def get_document_bytes(self) -> bytes:
        """The scheduled-events body exactly as IMDS sent it (the poll loop compares bytes before parsing)."""
        return self._request("GET", SCHEDULED_EVENTS_PATH)

    def get_document(self) -> ScheduledEventsDocument:
        return parse_document(self.get_document_bytes())

    def get_identity(self) -> VmIdentity:
        """This VM's identity from instance metadata (compute.name is what `Resources` lists; never the hostname)."""
        raw = self._request("GET", COMPUTE_PATH)
        try:
            compute: Any = bounded_json.loads(raw, max_bytes=MAX_BODY)
            if not isinstance(compute, dict):
                raise ValueError("expected a JSON object")
            return identity_of(compute)
        except ValueError as exc:  # Invalid is a ValueError
            raise ImdsInvalidResponse(f"instance metadata (compute) is invalid: {exc}", body=raw) from None

    def get_attestation(self, nonce: str) -> Attestation:
        """IMDS's attested document signing ``nonce`` (10 digits, contracts.attestation). Raises
        ImdsInvalidResponse when IMDS signed another nonce (it may answer from its cache): ask again later."""
        raw = self._request("GET", f"{ATTESTED_PATH}&nonce={nonce}")
        try:
            attestation = Attestation.from_json_bytes(raw)
            signed = read_content(attestation).nonce
        except (Invalid, AttestationError) as exc:
            raise ImdsInvalidResponse(f"attested document is invalid: {str(exc)[:300]}") from None
        if signed != nonce:
            raise ImdsInvalidResponse(f"IMDS signed nonce {signed!r}, not {nonce!r} (an answer from its cache)")
        return attestation

    def get_token(self, resource: str, *, client_id: str | None = None) -> ManagedIdentityToken:
        """An access token for `resource` from the VM's managed identity (user-assigned when client_id is given)."""
        path = f"{IDENTITY_TOKEN_PATH}&resource={quote(resource, safe='')}"
        if client_id:
            path += f"&client_id={quote(client_id, safe='')}"
        raw = self._request("GET", path)
        try:
            return ManagedIdentityToken.from_json_bytes(raw)
        except ValueError as exc:
            raise ImdsInvalidResponse(f"managed identity token answer is invalid: {exc}") from None

    def approve(
        self,
        event_ids: Iterable[str],
        *,
        attempts: int = 3,
        backoff: Backoff | None = None,
        before: float | None = None,
    ) -> None:
        """POST StartRequests for these events. IMDS answers 200 to any valid EventId, even one already approved
        elsewhere, so success means "accepted", not "started": confirm by watching the document. No attempt starts
        at or after ``before`` (monotonic; ImdsDeadlinePassed): an approval's validity ends there."""
        ids = list(event_ids)
        if not ids:
            raise ValueError("approve() needs at least one event id")
        body = json.dumps({"StartRequests": [{"EventId": event_id} for event_id in ids]}).encode()
        backoff = backoff or Backoff(initial=0.5, maximum=5.0)
        for attempt in range(1, attempts + 1):
            try:
                self._request("POST", SCHEDULED_EVENTS_PATH, body, before=before)
            except ImdsUnavailable as exc:
                if attempt == attempts:
                    raise
                delay = backoff.next_delay(retry_after=exc.retry_after)
                if before is not None and time.monotonic() + delay >= before:
                    raise ImdsDeadlinePassed(
                        f"IMDS approval not retried: its deadline comes before {delay:.2f} s"
                    ) from exc
                log.warning("IMDS approval failed; retrying", extra=fields(error=str(exc), delay_s=round(delay, 2)))
                time.sleep(delay)
            else:
                return
