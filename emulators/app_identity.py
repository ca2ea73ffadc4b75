"""The Functions app's managed-identity endpoint: what App Service gives an app with a managed identity
(``IDENTITY_ENDPOINT`` and ``IDENTITY_HEADER``, protocol 2019-08-01), which azure-identity's
``ManagedIdentityCredential`` (so ``DefaultAzureCredential``) uses when both are set.

Why it exists: the local coordinator is itself to the other emulators, as in Azure, where its tokens name the
user-assigned identity the Bicep gives the app (``{prefix}-coordinator-id``), not a VM. It had taken them from a
VM's IMDS endpoint, which made the coordinator speak as that VM and spend that VM's IMDS throttle (5 requests a
second, shared with its forwarder's polls: a 429 and a second's wait, now and then).

``GET {IDENTITY_ENDPOINT}?api-version=2019-08-01&resource=<audience>`` naming the identity (``client_id``,
``mi_res_id``, ``principal_id`` or ``object_id``), with ``X-IDENTITY-HEADER: {IDENTITY_HEADER}``, answers
``{access_token, expires_on, resource, token_type, client_id}``; the token is emulators/tokens.py's, naming the
identity's resource id (``xms_mirid``). A request without the header's value, for another api-version, without a
resource, or naming another identity or none is refused as App Service refuses it.
"""

from __future__ import annotations

import json
import secrets
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from emulators.served import Served, close, serve_local
from emulators.tokens import mint_token

__all__ = ["API_VERSION", "AppIdentity", "app_identity_id"]

API_VERSION = "2019-08-01"
TOKEN_LIFETIME_SECONDS = 24 * 3600  # App Service's tokens last about a day; the credential caches them
_ERRORS = {400: "invalid_request", 401: "unauthorized", 404: "not_found"}  # a refusal's status → its OAuth-style code


def app_identity_id(subscription_id: str, resource_group: str, name: str = "local-coordinator-id") -> str:
    """The resource id of the app's user-assigned identity (infra/modules/identities.bicep's coordinatorIdentity)."""
    return (
        f"/subscriptions/{subscription_id}/resourceGroups/{resource_group}"
        f"/providers/Microsoft.ManagedIdentity/userAssignedIdentities/{name}"
    )


class AppIdentity(Served):
    """One app's identity endpoint on 127.0.0.1: ``environment()`` is what App Service sets for the app."""

    def __init__(self, resource_id: str) -> None:
        self.resource_id = resource_id
        self.client_id = str(uuid.uuid5(uuid.NAMESPACE_URL, resource_id + "#client"))
        self.principal_id = str(uuid.uuid5(uuid.NAMESPACE_URL, resource_id))  # the token's oid (emulators/tokens.py)
        # App Service gives each app a fresh header value; only the app's processes know it.
        self.header = secrets.token_hex(16)
        self.requests = 0
        self._counting = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        self._server = serve_local(_Endpoint, name="app-identity", identity=self)
        return self.url

    def stop(self) -> None:
        close(self._server)
        self._server = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the app's identity endpoint is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}/msi/token"

    def environment(self) -> dict[str, str]:
        """The app settings App Service adds for a managed identity, and the client id of the user-assigned one
        the app is told to use (COORDINATOR_MANAGED_IDENTITY_CLIENT_ID, as infra/modules/functionapp.bicep sets)."""
        return {
            "IDENTITY_ENDPOINT": self.url,
            "IDENTITY_HEADER": self.header,
            "COORDINATOR_MANAGED_IDENTITY_CLIENT_ID": self.client_id,
        }

    def answer(self, path: str, query: dict[str, list[str]], header: str | None) -> tuple[int, dict[str, Any]]:
        """The endpoint's answer to a GET: (status, JSON body)."""
        with self._counting:  # the server answers each request on a thread of its own
            self.requests += 1
        refused = self._refusal(path, query, header)
        if refused is not None:
            status, why = refused
            return status, {"error": _ERRORS[status], "error_description": why}
        resource = query["resource"][0]
        token, expires_on = mint_token(
            audience=resource, identity_resource_id=self.resource_id, lifetime_seconds=TOKEN_LIFETIME_SECONDS
        )
        return 200, {
            "access_token": token,
            "expires_on": str(expires_on),
            "resource": resource,
            "token_type": "Bearer",
            "client_id": self.client_id,
        }

    def _refusal(self, path: str, query: dict[str, list[str]], header: str | None) -> tuple[int, str] | None:
        if path != "/msi/token":
            return 404, f"no such path {path!r}"
        if header is None or not secrets.compare_digest(header, self.header):
            return 401, "X-IDENTITY-HEADER is missing or wrong"
        version, resource = ((query.get(name) or [""])[0] for name in ("api-version", "resource"))
        if version != API_VERSION or not resource:
            return 400, f"api-version {version!r} not supported" if version != API_VERSION else "resource is required"
        named = {
            "client_id": self.client_id,
            "mi_res_id": self.resource_id,
            "principal_id": self.principal_id,
            "object_id": self.principal_id,  # what MSAL sends for an object id
        }
        asked = {name: query[name][0] for name in named if query.get(name)}
        if not asked:
            # The app has a user-assigned identity only: App Service does not pick it without being told which.
            return 400, "the app has no system-assigned identity: name the user-assigned one (client_id)"
        if any(value.lower() != named[name].lower() for name, value in asked.items()):
            return 400, "no such identity assigned to the app"
        return None


class _Endpoint(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        identity: AppIdentity = self.server.identity  # type: ignore[attr-defined]
        split = urlsplit(self.path)
        status, body = identity.answer(split.path, parse_qs(split.query), self.headers.get("X-IDENTITY-HEADER"))
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:  # quiet: the stack has its own logs
        return
