"""A STAND-IN for App Service Authentication ("Easy Auth"), which signs people in with Entra ID in front of the
Functions app in Azure and cannot run here. Local mode and the tests only; never deployed.

It does at the app's door what the platform does, and the app cannot tell it apart, because the seam is the
narrowest the app has: coordinator/http.py trusts ``X-MS-CLIENT-PRINCIPAL`` only while ``WEBSITE_AUTH_ENABLED``
says the platform runs in front of it, and reads nothing else of the sign-in. So the stand-in

- sets ``PLATFORM_SETTINGS`` (``WEBSITE_AUTH_ENABLED=True``, which App Service injects) in the app's environment
  (``local/stack.py``), and answers every request before the app does;
- removes every ``X-MS-CLIENT-PRINCIPAL*`` and ``X-MS-TOKEN-*`` header a client sends, as the platform does, so no
  caller can claim to be someone;
- sends a request without a session to the sign-in page (``RedirectToLoginPage``, as infra/modules/functionapp.bicep
  configures the platform); where Entra ID would ask for an account and password, the stand-in lists the local
  people (``LocalPerson``) to choose from (``/.auth/login/aad``); choosing one sets the session cookie
  ``AppServiceAuthSession`` and goes back to the page first asked for (a path on this origin only);
- hands a request with a session to the app with ``X-MS-CLIENT-PRINCIPAL``: base64 JSON of the person's claims as
  the platform maps an Entra ID token (object id and name claim types as URIs, ``preferred_username``, ``name``,
  one ``roles`` claim per app role assigned), and ``X-MS-CLIENT-PRINCIPAL-NAME``, ``-ID`` and ``-IDP``;
- ends the session at ``/.auth/logout``.

It does not play Entra ID itself (no tokens, tenant, MFA or conditional access), bearer tokens for scripts, or the
token store (off in the deployment). The people and their app roles are its configuration, as the role
assignments of the app registration are in Azure.

The session cookie is sent with every request the browser makes to this origin, cross-site ones included
(``SameSite=None``): whether a cross-site form can approve is then decided by the app's own checks (origin and
anti-forgery token), which must hold whatever cookie policy the platform and the browser apply.
"""

from __future__ import annotations

import base64
import html
import json
import secrets
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, urlsplit

from coordinator import APPROVE_ROLE, READ_ROLE
from local.http_host import Answer, Handler, Request

# What App Service puts in the app's environment when its authentication is on.
PLATFORM_SETTINGS = {"WEBSITE_AUTH_ENABLED": "True"}
SESSION_COOKIE = "AppServiceAuthSession"
LOGIN_PATH = "/.auth/login/aad"
CALLBACK_PATH = "/.auth/login/aad/callback"
LOGOUT_PATH = "/.auth/logout"
_CLAIM_OBJECT_ID = "http://schemas.microsoft.com/identity/claims/objectidentifier"
_NAME_TYPE = "http://schemas.xmlsoap.org/ws/2005/05/identity/claims/emailaddress"
_ROLE_TYPE = "http://schemas.microsoft.com/ws/2008/06/identity/claims/role"
_PAGE_HEADERS = [
    ("Content-Type", "text/html; charset=utf-8"),
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'"),
    ("Cache-Control", "no-store"),
]


@dataclass(frozen=True)
class LocalPerson:
    """Someone the stand-in can sign in: an account of the tenant and the app roles assigned to it."""

    upn: str
    display_name: str
    roles: tuple[str, ...] = ()

    @property
    def object_id(self) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"local-person:{self.upn}"))

    def principal(self) -> str:
        """The ``X-MS-CLIENT-PRINCIPAL`` value the platform would send for this person."""
        claims = [
            {"typ": _CLAIM_OBJECT_ID, "val": self.object_id},
            {"typ": "preferred_username", "val": self.upn},
            {"typ": _NAME_TYPE, "val": self.upn},
            {"typ": "name", "val": self.display_name},
            *({"typ": "roles", "val": role} for role in self.roles),
        ]
        payload = {"auth_typ": "aad", "claims": claims, "name_typ": _NAME_TYPE, "role_typ": _ROLE_TYPE}
        return base64.b64encode(json.dumps(payload).encode()).decode()


# Local mode's people: one who may approve, one who may look, one signed in without any app role.
DEFAULT_PEOPLE = (
    LocalPerson("approver@local.test", "Ada Approver", (APPROVE_ROLE,)),
    LocalPerson("reader@local.test", "Rudi Reader", (READ_ROLE,)),
    LocalPerson("visitor@local.test", "Vera Visitor"),
)


def _local_path(target: str) -> str:
    """A redirect target on this origin only (an open redirect would make the sign-in page a phishing aid)."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/api/events"
    return target


class EasyAuthStandIn:
    """The stand-in in front of ``app`` (the local Functions HTTP host): a ``Handler`` itself."""

    def __init__(self, app: Handler, people: Iterable[LocalPerson] = DEFAULT_PEOPLE) -> None:
        self._app = app
        self._people = {person.upn: person for person in people}
        self._sessions: dict[str, LocalPerson] = {}
        self._lock = threading.Lock()

    def __call__(self, request: Request) -> Answer:
        path = request.path
        if path == LOGIN_PATH and request.method == "GET":
            return self._login_page(request)
        if path == CALLBACK_PATH and request.method == "POST":
            return self._sign_in(request)
        if path == LOGOUT_PATH:
            return self._sign_out(request)
        # As the platform: whatever principal a client sends is dropped before anything else.
        headers = [
            (key, value)
            for key, value in request.headers
            if not key.lower().startswith(("x-ms-client-principal", "x-ms-token-"))
        ]
        person = self._session(request)
        if person is None:
            login = f"{LOGIN_PATH}?post_login_redirect_uri={quote(request.target, safe='')}"
            return Answer(302, [("Location", login), ("Cache-Control", "no-store")])
        headers += [
            ("X-MS-CLIENT-PRINCIPAL", person.principal()),
            ("X-MS-CLIENT-PRINCIPAL-NAME", person.upn),
            ("X-MS-CLIENT-PRINCIPAL-ID", person.object_id),
            ("X-MS-CLIENT-PRINCIPAL-IDP", "aad"),
        ]
        return self._app(Request(request.method, request.target, headers, request.body, request.base_url))

    def _session(self, request: Request) -> LocalPerson | None:
        for part in (request.header("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == SESSION_COOKIE:
                with self._lock:
                    return self._sessions.get(value)
        return None

    def _login_page(self, request: Request) -> Answer:
        query = parse_qs(urlsplit(request.target).query)
        target = _local_path((query.get("post_login_redirect_uri") or ["/api/events"])[0])
        choices = "".join(
            f'<form method="post" action="{CALLBACK_PATH}">'
            f'<input type="hidden" name="person" value="{html.escape(person.upn, quote=True)}">'
            f'<input type="hidden" name="post_login_redirect_uri" value="{html.escape(target, quote=True)}">'
            f'<button type="submit">Sign in as {html.escape(person.upn)}</button> '
            f"<small>{html.escape(person.display_name)}; app roles: "
            f"{html.escape(', '.join(person.roles) or 'none')}</small></form>"
            for person in self._people.values()
        )
        page = (
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Sign in (local stand-in)</title>'
            "<style>body{font-family:system-ui,sans-serif;margin:1.5rem}form{margin:.6rem 0}"
            "button{font-size:1rem;padding:.4rem 1rem}</style></head><body>"
            "<h1>Sign in</h1><p>Local stand-in for Entra ID sign-in (App Service Authentication): choose who you "
            "are.</p>" + choices + "</body></html>"
        )
        return Answer(200, list(_PAGE_HEADERS), page.encode())

    def _sign_in(self, request: Request) -> Answer:
        form = parse_qs(request.body.decode("utf-8", "replace"))
        person = self._people.get((form.get("person") or [""])[0])
        if person is None:
            return Answer(400, [("Content-Type", "text/plain; charset=utf-8")], b"no such person\n")
        session = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[session] = person
        target = _local_path((form.get("post_login_redirect_uri") or ["/api/events"])[0])
        cookie = f"{SESSION_COOKIE}={session}; Path=/; HttpOnly; Secure; SameSite=None"
        return Answer(302, [("Location", target), ("Set-Cookie", cookie), ("Cache-Control", "no-store")])

    def _sign_out(self, request: Request) -> Answer:
        for part in (request.header("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == SESSION_COOKIE:
                with self._lock:
                    self._sessions.pop(value, None)
        expired = f"{SESSION_COOKIE}=; Path=/; HttpOnly; Secure; SameSite=None; Max-Age=0"
        return Answer(302, [("Location", LOGIN_PATH), ("Set-Cookie", expired), ("Cache-Control", "no-store")])
