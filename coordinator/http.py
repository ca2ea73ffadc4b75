"""HTTP handling for the manual-approval and state endpoints, free of the Functions types (function_app adapts).

Who may do what:
- A person is whoever App Service Authentication (Easy Auth, Entra ID) signed in. Its ``X-MS-CLIENT-PRINCIPAL``
  header (base64 JSON with the token's claims) is trusted only while the platform runs in front of the app
  (``WEBSITE_AUTH_ENABLED``): the platform then removes any such header a client sends and puts in its own.
  ``X-MS-CLIENT-PRINCIPAL-NAME`` alone proves nothing and is never read.
- Reading (the pending list, an event's approval page) needs the app role ``ScheduledEvents.Read`` or
  ``ScheduledEvents.Approve``; approving needs ``ScheduledEvents.Approve``. Roles come from the principal's
  ``roles`` claims, i.e. the Entra app roles assigned to the person.

Manual approval: ``GET /api/events/{id}/approve`` shows the event and, to a person with the Approve role, a form
(a Teams card link is a GET, and a link preview must never approve); ``POST`` approves. A POST must carry the
form's anti-forgery token (an HMAC over the event, the person and an expiry, keyed with a random key that every
instance shares through the state table) and come from the app's own origin (``Origin``, else ``Referer``), so
that no other site can make a signed-in person's browser approve.

A browser (``Accept: text/html``) gets pages (coordinator/pages.py): the open events, an approval's answer, a
refusal and its reason; a script gets the same answers as JSON.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from coordinator import pages
from coordinator.service import Coordinator

PRINCIPAL_HEADER = "x-ms-client-principal"
APPROVE_ROLE = "ScheduledEvents.Approve"
READ_ROLE = "ScheduledEvents.Read"
FORM_KEY_NAME = "approval-form"
FORM_TOKEN_LIFETIME = timedelta(minutes=20)
# Claim types, short (Entra token) and long (the platform's mapping to WS-Fed URIs); the payload's own
# name_typ/role_typ come first.
_NAME_CLAIMS = (
    "preferred_username",
    "upn",
    "http://schemas.xmlsoap.org/ws/2005/05/identity/claims/upn",
    "http://schemas.xmlsoap.org/ws/2005/05/identity/claims/emailaddress",
    "name",
)
_OBJECT_ID_CLAIMS = ("http://schemas.microsoft.com/identity/claims/objectidentifier", "oid")
_ROLE_CLAIMS = ("roles", "http://schemas.microsoft.com/ws/2008/06/identity/claims/role")
_STATUS = {"approved": 200, "sent": 202, "dry-run": 200, "not-found": 404, "conflict": 409, "already-approved": 409}


# The approval page must not be framed by another site (a framed button can be clicked by a trick).
NO_FRAMING = {"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"}


@dataclass(frozen=True)
class Response:
    status: int
    body: str
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=lambda: dict(NO_FRAMING))


@dataclass(frozen=True)
class Principal:
    name: str
    object_id: str
    roles: frozenset[str]

    def may_read(self) -> bool:
        return bool(self.roles & {READ_ROLE, APPROVE_ROLE})

    def may_approve(self) -> bool:
        return APPROVE_ROLE in self.roles


@dataclass(frozen=True)
class Access:
    """How requests are authenticated. ``platform_auth``: App Service Authentication runs in front of the app
    (its principal header can be trusted; locally, its stand-in local/easy_auth.py does). ``own_origin``:
    ``https://host`` of this app, for the Origin check."""

    platform_auth: bool
    own_origin: str | None
    form_key: Callable[[], bytes]
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)


class _Claim(BaseModel):
    model_config = ConfigDict(extra="ignore")
    typ: str
    val: str


class _ClientPrincipal(BaseModel):
    """The decoded ``X-MS-CLIENT-PRINCIPAL`` payload."""

    model_config = ConfigDict(extra="ignore")
    auth_typ: str = ""
    name_typ: str = ""
    role_typ: str = ""
    claims: list[_Claim]


def _json(status: int, payload: Any) -> Response:
    return Response(status, json.dumps(payload, indent=1))


def _page(status: int, page: str) -> Response:
    return Response(status, page, pages.CONTENT_TYPE, dict(pages.HEADERS))


def _lowered(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def wants_html(headers: Mapping[str, str]) -> bool:
    """The caller is a browser: its Accept names text/html at least as high as JSON (a browser's navigation sends
    ``text/html,…,*/*;q=0.8``; scripts send ``*/*`` or ``application/json`` and get JSON)."""
    quality: dict[str, float] = {}
    for item in _lowered(headers).get("accept", "").split(","):
        kind, *parameters = (part.strip() for part in item.split(";"))
        q = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        quality[kind.lower()] = max(q, quality.get(kind.lower(), 0.0))
    html_q = quality.get("text/html", 0.0)
    return html_q > 0 and html_q >= quality.get("application/json", 0.0)


def _refusal(status: int, reason: str, headers: Mapping[str, str], principal: Principal | None = None) -> Response:
    """A refusal with its reason: a page for a browser, JSON for a script."""
    if wants_html(headers):
        return _page(status, pages.refusal_page(status, reason, person=principal.name if principal else None))
    return _json(status, {"error": reason})


def parse_principal(value: str) -> Principal:
    """The person in an ``X-MS-CLIENT-PRINCIPAL`` header; ValueError naming what is wrong with it."""
    try:
        payload = _ClientPrincipal.model_validate_json(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError, ValidationError) as error:
        raise ValueError(f"{PRINCIPAL_HEADER} is not base64 JSON with claims: {error}") from error
    claims: dict[str, list[str]] = {}
    for claim in payload.claims:
        claims.setdefault(claim.typ, []).append(claim.val)

    def first(types: tuple[str, ...]) -> str:
        return next((claims[t][0].strip() for t in types if t and claims.get(t) and claims[t][0].strip()), "")

    object_id = first(_OBJECT_ID_CLAIMS)
    name = first((payload.name_typ, *_NAME_CLAIMS)) or object_id
    if not name:
        raise ValueError(f"{PRINCIPAL_HEADER} names no one (no name, upn or object id claim)")
    roles = frozenset(v for t in {payload.role_typ, *_ROLE_CLAIMS} if t for v in claims.get(t, []))
    return Principal(name=name[:128], object_id=object_id or name[:128], roles=roles)


def authenticate(headers: Mapping[str, str], access: Access) -> Principal | Response:
    """The signed-in person, or the refusal to send back."""
    if not access.platform_auth:
        # Without the platform in front, anyone could send the principal header: trust nobody.
        reason = "App Service Authentication is off (WEBSITE_AUTH_ENABLED): no one can sign in"
        return _refusal(503, reason, headers)
    value = _lowered(headers).get(PRINCIPAL_HEADER, "").strip()
    if not value:
        return _refusal(401, "sign in first: this app needs an Entra ID sign-in (App Service Authentication)", headers)
    try:
        return parse_principal(value)
    except ValueError as error:
        return _refusal(401, str(error), headers)


def _cannot_read(principal: Principal) -> str:
    return (
        f"{principal.name} has neither the {READ_ROLE} nor the {APPROVE_ROLE} app role: ask an owner of the app "
        "registration to assign one (Read to look, Approve to approve)"
    )


def form_token(access: Access, *, event_id: str, principal: Principal, expires: datetime) -> str:
    stamp = str(int(expires.timestamp()))
    message = f"approve\n{event_id}\n{principal.object_id}\n{stamp}".encode()
    digest = hmac.new(access.form_key(), message, hashlib.sha256).digest()
    return f"{stamp}.{base64.urlsafe_b64encode(digest).decode().rstrip('=')}"


def _check_token(access: Access, *, event_id: str, principal: Principal, body: bytes) -> str | None:
    """None when the form's token is valid for this event and person and not expired; else the reason."""
    fields = parse_qs(body.decode("utf-8", "replace"))
    token = (fields.get("token") or [""])[0]
    stamp, _, _ = token.partition(".")
    if not token or not stamp.isdigit() or len(stamp) > 12:
        return "the approval form's token is missing: open the approval page and use its button"
    expires = datetime.fromtimestamp(int(stamp), UTC)
    expected = form_token(access, event_id=event_id, principal=principal, expires=expires)
    if not hmac.compare_digest(token, expected):
        return "the approval form's token is not valid for this event and person"
    if expires <= access.clock():
        return "the approval form expired: reload the approval page"
    return None


def _origin_of(url: str) -> str:
    parts = urlsplit(url.strip())
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else ""


def _check_origin(access: Access, headers: Mapping[str, str]) -> str | None:
    """None when the request comes from this app's own pages; else the reason."""
    if not access.own_origin:
        return "COORDINATOR_PUBLIC_BASE_URL is not set: there is no own origin to compare the request with"
    lowered = _lowered(headers)
    origin = lowered.get("origin", "").strip()
    source = origin if origin and origin != "null" else _origin_of(lowered.get("referer", ""))
    if not source:
        return "the request has no Origin or Referer header: approvals come only from the approval page"
    if _origin_of(source) != _origin_of(access.own_origin):
        return f"the request comes from {source!r}, not from this app"
    return None


def pending_events(coordinator: Coordinator, *, headers: Mapping[str, str], access: Access) -> Response:
    principal = authenticate(headers, access)
    if isinstance(principal, Response):
        return principal
    if not principal.may_read():
        return _refusal(403, _cannot_read(principal), headers, principal)
    events = coordinator.pending()
    if wants_html(headers):
        page = pages.pending_page(
            [pages.EventView.of(event) for event in events],
            now=access.clock(),
            person=principal.name,
            may_approve=principal.may_approve(),
        )
        answer = _page(200, page)
    else:
        answer = _json(200, {"count": len(events), "events": events})
    # One URL, two forms of the answer: no cache may hand a script's JSON to a browser or the page to a script.
    return Response(answer.status, answer.body, answer.content_type, {**answer.headers, "Vary": "Accept"})


def approve(
    coordinator: Coordinator,
    *,
    method: str,
    event_id: str,
    headers: Mapping[str, str],
    body: bytes,
    access: Access,
) -> Response:
    principal = authenticate(headers, access)
    if isinstance(principal, Response):
        return principal
    if method.upper() == "GET":
        if not principal.may_read():
            return _refusal(403, _cannot_read(principal), headers, principal)
        return _confirmation_page(coordinator, event_id, principal, access)
    return _approve_now(coordinator, event_id=event_id, principal=principal, headers=headers, body=body, access=access)


def _approve_now(
    coordinator: Coordinator,
    *,
    event_id: str,
    principal: Principal,
    headers: Mapping[str, str],
    body: bytes,
    access: Access,
) -> Response:
    """The form's POST: the role, the origin and the token, then the person's decision."""
    if not principal.may_approve():
        reason = f"{principal.name} does not have the {APPROVE_ROLE} app role"
        return _refusal(403, f"{reason}; nothing was approved", headers, principal)
    refused = _check_origin(access, headers) or _check_token(access, event_id=event_id, principal=principal, body=body)
    if refused:
        return _refusal(403, f"{refused}; nothing was approved", headers, principal)
    result = coordinator.approve_manually(event_id, person=principal.name)
    status = _STATUS[result.status]
    if wants_html(headers):
        event = pages.EventView.of(result.event) if result.event else None
        page = pages.result_page(result.status, result.message, event, now=access.clock(), person=principal.name)
        return _page(status, page)
    return _json(status, {"status": result.status, "message": result.message, "event": result.event})


def _confirmation_page(coordinator: Coordinator, event_id: str, principal: Principal, access: Access) -> Response:
    stored = coordinator.event(event_id)
    if stored is None:
        return _page(404, pages.refusal_page(404, f"No event {event_id!r} is known.", person=principal.name))
    event = pages.EventView.of(coordinator.summarize(stored.record))
    notice = pages.not_approvable(event)
    if notice is None and not principal.may_approve():
        notice = f"You ({principal.name}) may look, not approve: that needs the {APPROVE_ROLE} app role."
    token = None
    if notice is None:
        token = form_token(access, event_id=event_id, principal=principal, expires=access.clock() + FORM_TOKEN_LIFETIME)
    page = pages.approval_page(event, now=access.clock(), person=principal.name, token=token, notice=notice or "")
    return _page(200, page)
