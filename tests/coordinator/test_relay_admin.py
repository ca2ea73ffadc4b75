"""coordinator.adapters.relay_admin against a loopback HTTP server that records ARM requests.

FAKE: there is no local Azure Resource Manager, so ``FakeArm`` stands in for the Microsoft.Relay resource
provider — it keeps hybrid connections in a dict, checks the bearer token's audience, answers like ARM (201 on
create, 200 on update, 200/204 on delete, paged list) and records every request for the assertions.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from azure.core.credentials import AccessToken

from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.relay_admin import API_VERSION, HybridConnectionAdmin, RelayAdminError
from emulators.tokens import TokenError, mint_token, verify_token
from tests.loopback import QuietHandler

NAMESPACE_PATH = "/subscriptions/sub-1/resourceGroups/rg-se/providers/Microsoft.Relay/namespaces/relay-se"
VM = VmIdentity(
    name="web_3",
    vmId="0F1E2D3C-0000-4000-8000-00000000AB03",
    resourceId="/subscriptions/sub-1/resourceGroups/rg-se/providers/Microsoft.Compute/virtualMachineScaleSets/web/virtualMachines/3",
)


class MintedCredential:
    """FAKE Entra: tokens minted with the emulators' development key (no local Entra ID exists)."""

    def __init__(self) -> None:
        self.scopes: list[str] = []

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        self.scopes.extend(scopes)
        token, expires_on = mint_token(
            audience=scopes[0].removesuffix("/.default"), identity_resource_id="/subscriptions/sub-1/coordinator"
        )
        return AccessToken(token, expires_on)


@dataclass
class FakeArm:
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    log: list[tuple[str, str, Any]] = field(default_factory=list)
    page_size: int = 2
    fail_next: list[int] = field(default_factory=list)


def _handler(arm: FakeArm) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def _reply(self, status: int, body: Any = None) -> None:
            self.respond(status, b"" if body is None else json.dumps(body).encode())

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            arm.log.append((method, self.path, body))
            if arm.fail_next:
                self._reply(arm.fail_next.pop(0), {"error": {"code": "Throttled", "message": "try later"}})
                return
            if parse_qs(url.query).get("api-version") != [API_VERSION]:
                self._reply(400, {"error": {"code": "InvalidApiVersion", "message": url.query}})
                return
            try:
                verify_token(
                    self.headers.get("Authorization", "").removeprefix("Bearer "),
                    audience="https://management.azure.com",
                )
            except TokenError as error:
                self._reply(401, {"error": {"code": "InvalidAuthenticationToken", "message": str(error)}})
                return
            collection = NAMESPACE_PATH + "/hybridConnections"
            if url.path == collection and method == "GET":
                names = sorted(arm.resources)
                start = int(parse_qs(url.query).get("skip", ["0"])[0])
                page: dict[str, Any] = {"value": [arm.resources[n] for n in names[start : start + arm.page_size]]}
                if start + arm.page_size < len(names):
                    port = self.headers.get("Host", "").rpartition(":")[2]
                    query = f"api-version={API_VERSION}&skip={start + arm.page_size}"
                    page["nextLink"] = f"http://127.0.0.1:{port}{collection}?{query}"
                self._reply(200, page)
                return
            if not url.path.startswith(collection + "/"):
                self._reply(404, {"error": {"code": "ResourceNotFound", "message": url.path}})
                return
            name = unquote(url.path.removeprefix(collection + "/"))
            if method == "PUT":
                assert body is not None
                created = name not in arm.resources
                arm.resources[name] = {
                    "id": url.path,
                    "name": name,
                    "type": "Microsoft.Relay/namespaces/hybridConnections",
                    "properties": {**body["properties"], "listenerCount": 0},
                }
                self._reply(201 if created else 200, arm.resources[name])
            elif method == "GET":
                if name in arm.resources:
                    self._reply(200, arm.resources[name])
                else:
                    self._reply(404, {"error": {"code": "NotFound", "message": name}})
            elif method == "DELETE":
                self._reply(200 if arm.resources.pop(name, None) is not None else 204)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

    return Handler


@pytest.fixture
def arm() -> Iterator[tuple[FakeArm, str]]:
    state = FakeArm()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def admin_for(endpoint: str, credential: MintedCredential | None = None) -> HybridConnectionAdmin:
    return HybridConnectionAdmin(
        credential=credential or MintedCredential(),
        subscription_id="sub-1",
        resource_group="rg-se",
        namespace="relay-se",
        arm=ArmOptions(endpoint=endpoint, retry_total=2, retry_backoff_factor=0.01),
    )


def test_ensure_creates_once_then_only_reads(arm: tuple[FakeArm, str]) -> None:
    state, endpoint = arm
    credential = MintedCredential()
    with admin_for(endpoint, credential) as admin:
        created = admin.ensure(VM)
        again = admin.ensure(VM)
    assert created == again
    assert created.name == "vm-0f1e2d3c-0000-4000-8000-00000000ab03"
    assert created.requires_client_authorization is True
    assert created.vm_resource_id == VM.resourceId
    assert [(method, path.split("?")[0].rsplit("/", 1)[1]) for method, path, _ in state.log] == [
        ("GET", created.name),
        ("PUT", created.name),
        ("GET", created.name),
    ]
    put_body = state.log[1][2]
    assert put_body["properties"]["requiresClientAuthorization"] is True
    assert json.loads(put_body["properties"]["userMetadata"]) == {"vmResourceId": VM.resourceId, "vmId": VM.vmId}
    assert set(credential.scopes) == {"https://management.azure.com/.default"}


def test_ensure_repairs_a_connection_without_client_authorization(arm: tuple[FakeArm, str]) -> None:
    state, endpoint = arm
    name = VM.hybrid_connection_name
    state.resources[name] = {"name": name, "properties": {"requiresClientAuthorization": False}}
    with admin_for(endpoint) as admin:
        assert admin.ensure(VM).requires_client_authorization is True
    assert [method for method, _, _ in state.log] == ["GET", "PUT"]


def test_list_follows_next_links_and_delete_is_idempotent(arm: tuple[FakeArm, str]) -> None:
    state, endpoint = arm
    for index in range(5):
        state.resources[f"vm-{index}"] = {"name": f"vm-{index}", "properties": {"requiresClientAuthorization": True}}
    with admin_for(endpoint) as admin:
        assert [item.name for item in admin.list()] == [f"vm-{index}" for index in range(5)]
        assert admin.delete("vm-3") is True
        assert admin.delete("vm-3") is False
    assert "vm-3" not in state.resources
    assert sum(1 for method, _, _ in state.log if method == "GET") == 3  # three pages


def test_throttling_is_retried_and_errors_name_what_to_check(arm: tuple[FakeArm, str]) -> None:
    state, endpoint = arm
    state.fail_next = [503]
    with admin_for(endpoint) as admin:
        assert admin.get("vm-missing") is None  # 503 retried, then 404 → None
        state.fail_next = [403]
        with pytest.raises(RelayAdminError, match="Azure Relay Owner"):
            admin.ensure(VM)


def test_plain_http_is_refused_off_loopback() -> None:
    with pytest.raises(ValueError, match="must be https"):
        admin_for("http://management.example.com")
