"""The ARM-shaped management surface: Microsoft.Relay/namespaces/hybridConnections PUT/GET/list/DELETE."""

from __future__ import annotations

import asyncio
from typing import Any

import requests
from azure.core.credentials import AccessToken

from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.relay_admin import HybridConnectionAdmin
from emulators.relay import RelayEmulator
from emulators.tokens import mint_token
from tests.emulators.relay.raw import RawListener, assert_deleted

NAMESPACE = "/subscriptions/sub-1/resourceGroups/rg-se/providers/Microsoft.Relay/namespaces/relay-se"
COORDINATOR = "/subscriptions/sub-1/resourceGroups/rg-se/providers/Microsoft.Web/sites/coordinator"


def _arm(
    relay: RelayEmulator, method: str, name: str = "", *, audience: str = "https://management.azure.com", **kwargs: Any
) -> requests.Response:
    token, _ = mint_token(audience=audience, identity_resource_id=COORDINATOR)
    url = f"{relay.base_url}{NAMESPACE}/hybridConnections{'/' + name if name else ''}?api-version=2024-01-01"
    return requests.request(method, url, headers={"Authorization": f"Bearer {token}"}, timeout=10, **kwargs)


def test_arm_create_get_list_delete(make_relay) -> None:
    relay: RelayEmulator = make_relay(require_known=True)
    body = {"properties": {"requiresClientAuthorization": True, "userMetadata": '{"vmId":"v1"}'}}
    created = _arm(relay, "PUT", "vm-1", json=body)
    assert created.status_code == 201
    resource = created.json()
    assert resource["id"] == f"{NAMESPACE}/hybridConnections/vm-1"
    assert resource["type"] == "Microsoft.Relay/namespaces/hybridConnections"
    assert resource["properties"]["userMetadata"] == '{"vmId":"v1"}'
    assert resource["properties"]["listenerCount"] == 0
    assert _arm(relay, "PUT", "vm-1", json=body).status_code == 200

    async def listen_then_delete() -> None:
        listener = await RawListener.on(relay, "vm-1")
        assert (await asyncio.to_thread(_arm, relay, "GET", "vm-1")).json()["properties"]["listenerCount"] == 1
        listing = (await asyncio.to_thread(_arm, relay, "GET")).json()
        assert [item["name"] for item in listing["value"]] == ["vm-1"]
        assert (await asyncio.to_thread(_arm, relay, "DELETE", "vm-1")).status_code == 200
        await assert_deleted(relay, listener, "vm-1")

    asyncio.run(listen_then_delete())
    assert _arm(relay, "DELETE", "vm-1").status_code == 204
    assert _arm(relay, "GET", "vm-1").status_code == 404


def test_arm_refuses_bad_tokens_and_requests(relay: RelayEmulator) -> None:
    assert (
        _arm(relay, "GET", audience="https://relay.azure.net").json()["error"]["code"] == "InvalidAuthenticationToken"
    )
    no_token = requests.get(f"{relay.base_url}{NAMESPACE}/hybridConnections?api-version=2024-01-01", timeout=10)
    assert no_token.status_code == 401
    no_version = requests.get(f"{relay.base_url}{NAMESPACE}/hybridConnections", timeout=10)
    assert no_version.status_code == 400
    bad_body = _arm(relay, "PUT", "vm-2", json={"properties": {"requiresClientAuthorization": "yes"}})
    assert bad_body.status_code == 400
    assert _arm(relay, "PUT", "bad name").status_code == 400
    assert relay.counters()["refused.arm"] == 5


class _Credential:
    """FAKE Entra: management tokens minted with the emulators' development key."""

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        token, expires_on = mint_token(audience=scopes[0].removesuffix("/.default"), identity_resource_id=COORDINATOR)
        return AccessToken(token, expires_on)


def test_the_coordinators_arm_client_manages_hybrid_connections_here(make_relay) -> None:
    relay: RelayEmulator = make_relay(require_known=True)
    vm = VmIdentity(name="web_3", vmId="0F1E2D3C-0000-4000-8000-00000000AB03", resourceId="/sub/vm/web_3")
    with HybridConnectionAdmin(
        credential=_Credential(),
        subscription_id="sub-1",
        resource_group="rg-se",
        namespace="relay-se",
        arm=ArmOptions(endpoint=relay.base_url, retry_total=0),
    ) as admin:
        created = admin.ensure(vm)
        assert created.name == vm.hybrid_connection_name
        assert created.vm_resource_id == vm.resourceId
        assert relay.listener_count(vm.hybrid_connection_name) == 0
        assert [item.name for item in admin.list()] == [vm.hybrid_connection_name]
        assert admin.delete(vm.hybrid_connection_name) is True
        assert admin.delete(vm.hybrid_connection_name) is False
