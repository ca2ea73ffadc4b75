"""Per-VM hybrid connections: which namespace a VM uses, creating and deleting its connection, and which to delete.

One hybrid connection per VM (``VmIdentity.hybrid_connection_name``): Relay spreads a connection's requests over
its listeners at random, so only a connection of its own addresses one VM. The coordinator creates it when it first
sees the VM and deletes it once the VM is gone or has been silent too long.

ARM is called directly (``Microsoft.Relay/namespaces/hybridConnections@2024-01-01``) through the project's ARM
pipeline (arm.py: azure-core's RetryPolicy retries throttling and 5xx and honours Retry-After): four REST calls do
not justify the generated azure-mgmt-relay client and its models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from azure.core.credentials import TokenCredential
from azure.core.exceptions import AzureError
from azure.core.rest import HttpRequest, HttpResponse

from contracts.envelope import VmIdentity
from coordinator.adapters import deadline
from coordinator.adapters.arm import ArmClient, ArmOptions
from coordinator.adapters.closing import Closing

API_VERSION = "2024-01-01"
HYBRID_CONNECTION_PREFIX = "vm-"


def namespace_for_vm(vm: VmIdentity, namespaces: Sequence[str]) -> str:
    """The namespace that holds this VM's hybrid connection when the fleet is sharded over several.

    A stable hash of the vmId (not Python's salted ``hash``), so every coordinator instance, the deployment and the
    forwarder's configuration agree. Adding a namespace moves VMs; do it together with re-creating connections.
    """
    if not namespaces:
        raise ValueError("namespace_for_vm needs at least one namespace")
    digest = hashlib.sha256(vm.vmId.lower().encode("utf-8")).digest()
    return namespaces[int.from_bytes(digest[:8], "big") % len(namespaces)]


@dataclass(frozen=True)
class HybridConnection:
    name: str
    requires_client_authorization: bool
    vm_resource_id: str
    listener_count: int = 0


def hybrid_connections_to_delete(
    existing: Iterable[str],
    *,
    last_seen: Mapping[str, datetime],
    gone: Iterable[str] = (),
    now: datetime,
    silence_limit: timedelta,
) -> list[str]:
    """Names of the per-VM hybrid connections to delete: the VM is gone, or silent longer than ``silence_limit``.

    ``last_seen`` maps a hybrid-connection name to the last time its VM was heard from (any envelope). A connection
    the fleet state does not know at all counts as silent: the coordinator re-creates a VM's connection whenever it
    sees the VM, so deleting a connection wrongly costs one heartbeat, while keeping orphans would slowly use up the
    namespace's 10,000 endpoints. Connections not named ``vm-…`` are not ours and are never returned.
    """
    gone_names = {name.lower() for name in gone}
    seen = {name.lower(): stamp for name, stamp in last_seen.items()}
    doomed = []
    for name in existing:
        key = name.lower()
        if not key.startswith(HYBRID_CONNECTION_PREFIX):
            continue
        stamp = seen.get(key)
        if key in gone_names or stamp is None or now - stamp > silence_limit:
            doomed.append(name)
    return sorted(doomed)


class RelayAdminError(RuntimeError):
    """An ARM call on the Relay namespace failed; the message says which and what to check."""


class HybridConnectionAdmin(Closing):
    """Creates, lists and deletes the per-VM hybrid connections of one Relay namespace through ARM.

    :keyword credential: an identity with "Azure Relay Owner" (or Contributor) on the namespace.
    :keyword arm: how ARM is called (its root, retries and each call's deadline: a new VM's connection is ensured
        after its batch, the hourly housekeeping lists and deletes within a tick).
    """

    def __init__(
        self,
        *,
        credential: TokenCredential,
        subscription_id: str,
        resource_group: str,
        namespace: str,
        arm: ArmOptions | None = None,
    ) -> None:
        self._namespace_path = (
            f"/subscriptions/{quote(subscription_id, safe='')}/resourceGroups/{quote(resource_group, safe='')}"
            f"/providers/Microsoft.Relay/namespaces/{quote(namespace, safe='')}"
        )
        self._client = ArmClient(credential=credential, moniker="relay-admin", options=arm)

    def close(self) -> None:
        self._client.close()

    def ensure(self, vm: VmIdentity) -> HybridConnection:
        """Create the VM's hybrid connection if it is missing or differs; a no-op (one GET) when it is in place."""
        name = vm.hybrid_connection_name
        current = self.get(name)
        if current is not None and current.requires_client_authorization and current.vm_resource_id == vm.resourceId:
            return current
        body = {
            "properties": {
                "requiresClientAuthorization": True,
                "userMetadata": json.dumps({"vmResourceId": vm.resourceId, "vmId": vm.vmId}, separators=(",", ":")),
            }
        }
        response = self._call("PUT", name, body=body)
        if response.status_code not in (200, 201):
            raise _error("create", name, response)
        return _parse(response.json())

    def get(self, name: str) -> HybridConnection | None:
        response = self._call("GET", name)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise _error("read", name, response)
        return _parse(response.json())

    def delete(self, name: str) -> bool:
        """Delete a hybrid connection; False when it did not exist (so deleting twice is fine)."""
        response = self._call("DELETE", name)
        if response.status_code in {204, 404}:
            return False
        if response.status_code != 200:
            raise _error("delete", name, response)
        return True

    def list(self) -> list[HybridConnection]:
        url: str | None = f"{self._namespace_path}/hybridConnections?api-version={API_VERSION}"
        found: list[HybridConnection] = []
        while url:
            response = self._send(HttpRequest("GET", url))
            if response.status_code != 200:
                raise _error("list", "*", response)
            page = response.json()
            found.extend(_parse(item) for item in page.get("value", []))
            url = page.get("nextLink")
        return found

    def _call(self, method: str, name: str, *, body: dict[str, Any] | None = None) -> HttpResponse:
        url = f"{self._namespace_path}/hybridConnections/{quote(name, safe='')}?api-version={API_VERSION}"
        return self._send(HttpRequest(method, url, json=body))

    def _send(self, request: HttpRequest) -> HttpResponse:
        try:
            return self._client.send(request)
        except AzureError as error:  # raised only after the retry policy gave up
            raise RelayAdminError(f"ARM {request.method} {request.url} failed: {error.message}") from error
        except deadline.DeadlineExceeded as error:
            raise RelayAdminError(str(error)) from error


def _parse(resource: Mapping[str, Any]) -> HybridConnection:
    properties = resource.get("properties") or {}
    metadata = properties.get("userMetadata") or ""
    try:
        vm_resource_id = str(json.loads(metadata).get("vmResourceId", "")) if metadata else ""
    except (ValueError, AttributeError):
        vm_resource_id = ""  # written by someone else; ensure() will rewrite it
    return HybridConnection(
        name=str(resource.get("name", "")),
        requires_client_authorization=bool(properties.get("requiresClientAuthorization", False)),
        vm_resource_id=vm_resource_id,
        listener_count=int(properties.get("listenerCount", 0) or 0),
    )


def _error(action: str, name: str, response: HttpResponse) -> RelayAdminError:
    hint = {
        401: "the ARM token was refused",
        403: "the coordinator identity needs 'Azure Relay Owner' or Contributor on the namespace",
        404: "the namespace or resource group does not exist",
        409: "a conflicting operation is in progress; retry later",
    }.get(response.status_code, "unexpected ARM answer")
    return RelayAdminError(
        f"cannot {action} hybrid connection {name!r}: HTTP {response.status_code}: {hint}: {response.text()[:300]}"
    )
