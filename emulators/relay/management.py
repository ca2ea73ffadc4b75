"""Management of hybrid connections: the emulator's own control API and an ARM-shaped one.

* ``/_emulator/hybridConnections[/{name}]`` — PUT (optional ``{"requiresClientAuthorization": bool}``), GET,
  DELETE; no authentication (loopback only).
* ``/subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.Relay/namespaces/{ns}/hybridConnections[/{name}]``
  ``?api-version=…`` — the ARM resource ``Microsoft.Relay/namespaces/hybridConnections`` (PUT, GET, list, DELETE)
  with an Entra token for ``https://management.azure.com``, so that the coordinator's real ARM calls create and
  delete hybrid connections here. Subscription, resource group and namespace names are not checked: this process
  is the one namespace. RBAC is not modelled (any valid management token may manage).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl, unquote

from emulators.relay.httpwire import HttpAnswer, HttpRequest, json_answer, service_error
from emulators.relay.namespace import HybridConnection, Namespace
from emulators.tokens import TokenError, verify_token

CONTROL_PREFIX = "/_emulator/hybridConnections"
ARM_AUDIENCE = "https://management.azure.com"
ARM_PAGE_SIZE = 100
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,259}$")
_ARM_PATH = re.compile(
    r"^(?P<namespace>/subscriptions/[^/]+/resourceGroups/[^/]+/providers/Microsoft\.Relay/namespaces/[^/]+)"
    r"/hybridConnections(?:/(?P<name>[^/]+))?/?$",
    re.IGNORECASE,
)


async def handle_management(service: Namespace, request: HttpRequest) -> HttpAnswer | None:
    """The answer to a management request, or None when the request is for a hybrid connection (a sender)."""
    if request.path == CONTROL_PREFIX or request.path.startswith(CONTROL_PREFIX + "/"):
        return await _control_api(service, request)
    match = _ARM_PATH.match(request.path)
    if match is not None:
        return await _arm_api(service, request, match["namespace"], unquote(match["name"] or ""))
    return None


def _describe(service: Namespace, hybrid_connection: HybridConnection) -> dict[str, Any]:
    return {
        "name": hybrid_connection.name,
        "declared": hybrid_connection.declared,
        "requiresClientAuthorization": hybrid_connection.requires_client_authorization,
        "listenerCount": service.listener_count(hybrid_connection.name),
    }


def _requires_client_authorization(body: bytes, *, nested: bool) -> bool | str:
    """The flag from a PUT body (default True), or an error text naming what is wrong."""
    if not body:
        return True
    try:
        document = json.loads(body)
    except ValueError:
        return "body is not JSON"
    if nested:
        document = document.get("properties", {}) if isinstance(document, dict) else None
    if not isinstance(document, dict):
        return 'body must be a JSON object like {"requiresClientAuthorization": true}'
    value = document.get("requiresClientAuthorization", True)
    return value if isinstance(value, bool) else "requiresClientAuthorization must be true or false"


async def _control_api(service: Namespace, request: HttpRequest) -> HttpAnswer:  # noqa: PLR0911 - per outcome
    name = unquote(request.path.removeprefix(CONTROL_PREFIX)).strip("/")
    if not name:
        if request.method != "GET":
            return service_error(405, "only GET is allowed on the collection")
        return json_answer(200, [_describe(service, item) for item in service.hybrid_connections.values()])
    if not _NAME.match(name):
        service.refuse("control_api", f"invalid hybrid connection name {name!r}")
        return service_error(400, f"invalid hybrid connection name {name!r}: letters, digits, . _ - /")
    if request.method == "PUT":
        requires = _requires_client_authorization(request.body, nested=False)
        if isinstance(requires, str):
            service.refuse("control_api", f"PUT {name}: {requires}")
            return service_error(400, requires)
        hybrid_connection, created = service.declare(name, requires_client_authorization=requires)
        return json_answer(201 if created else 200, _describe(service, hybrid_connection))
    if request.method == "DELETE":
        if await service.delete(name):
            return HttpAnswer(200, None, [], b"")
        return service_error(404, f"hybrid connection {name!r} does not exist")
    if request.method == "GET":
        found = service.hybrid_connections.get(name.lower())
        if found is None:
            return service_error(404, f"hybrid connection {name!r} does not exist")
        return json_answer(200, _describe(service, found))
    return service_error(405, f"{request.method} is not supported (PUT, DELETE, GET)")


def _arm_error(status: int, code: str, message: str) -> HttpAnswer:
    return json_answer(status, {"error": {"code": code, "message": message}})


def _arm_resource(service: Namespace, namespace_path: str, hybrid_connection: HybridConnection) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "createdAt": hybrid_connection.created_at,
        "updatedAt": hybrid_connection.updated_at,
        "listenerCount": service.listener_count(hybrid_connection.name),
        "requiresClientAuthorization": hybrid_connection.requires_client_authorization,
    }
    if hybrid_connection.user_metadata is not None:
        properties["userMetadata"] = hybrid_connection.user_metadata
    return {
        "id": f"{namespace_path}/hybridConnections/{hybrid_connection.name}",
        "name": hybrid_connection.name,
        "type": "Microsoft.Relay/namespaces/hybridConnections",
        "properties": properties,
    }


async def _arm_api(  # noqa: PLR0911 - one return per ARM outcome
    service: Namespace, request: HttpRequest, namespace_path: str, name: str
) -> HttpAnswer:
    query = dict(parse_qsl(request.query, keep_blank_values=True))
    if not query.get("api-version"):
        service.refuse("arm", f"{request.method} {request.path}: no api-version")
        return _arm_error(400, "MissingApiVersionParameter", "The api-version query parameter is required.")
    authorization = request.header("Authorization") or ""
    if not authorization.startswith("Bearer "):
        service.refuse("arm", f"{request.method} {request.path}: no bearer token")
        return _arm_error(401, "AuthenticationFailed", "Authentication failed: the Authorization header is missing.")
    try:
        verify_token(authorization, audience=ARM_AUDIENCE)
    except TokenError as error:
        service.refuse("arm", f"{request.method} {request.path}: {error}")
        return _arm_error(401, "InvalidAuthenticationToken", str(error))
    if not name:
        if request.method != "GET":
            return _arm_error(405, "MethodNotAllowed", f"{request.method} is not allowed on the collection")
        declared = sorted((item for item in service.hybrid_connections.values() if item.declared), key=lambda i: i.name)
        token = query.get("$skiptoken", "0")
        skip = int(token) if token.isdigit() else 0
        page: dict[str, Any] = {
            "value": [_arm_resource(service, namespace_path, item) for item in declared[skip : skip + ARM_PAGE_SIZE]]
        }
        if skip + ARM_PAGE_SIZE < len(declared):
            page["nextLink"] = (
                f"{service.http_scheme}://{service.authority}{request.path}?api-version={query['api-version']}"
                f"&$skiptoken={skip + ARM_PAGE_SIZE}"
            )
        return json_answer(200, page)
    if not _NAME.match(name):
        service.refuse("arm", f"invalid hybrid connection name {name!r}")
        return _arm_error(400, "InvalidResourceName", f"invalid hybrid connection name {name!r}")
    found = service.hybrid_connections.get(name.lower())
    if request.method == "PUT":
        requires = _requires_client_authorization(request.body, nested=True)
        if isinstance(requires, str):
            service.refuse("arm", f"PUT {name}: {requires}")
            return _arm_error(400, "InvalidRequestContent", requires)
        properties = json.loads(request.body).get("properties", {}) if request.body else {}
        metadata = properties.get("userMetadata")
        hybrid_connection, created = service.declare(
            name, requires_client_authorization=requires, user_metadata=None if metadata is None else str(metadata)
        )
        return json_answer(201 if created else 200, _arm_resource(service, namespace_path, hybrid_connection))
    if request.method == "GET":
        if found is None or not found.declared:
            return _arm_error(404, "NotFound", f"hybrid connection {name!r} not found")
        return json_answer(200, _arm_resource(service, namespace_path, found))
    if request.method == "DELETE":
        # ARM answers 204 for a resource that does not exist, 200 once deleted.
        return HttpAnswer(200 if await service.delete(name) else 204, None, [], b"")
    return _arm_error(405, "MethodNotAllowed", f"{request.method} is not supported (PUT, GET, DELETE)")
