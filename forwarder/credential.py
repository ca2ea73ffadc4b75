"""The VM's managed identity as an azure-core `TokenCredential`, read straight from IMDS.

Why not azure-identity's ManagedIdentityCredential by default: on a VM it does the same IMDS call, but importing
it (msal, cryptography, requests) adds ~15 MiB to a daemon whose budget is 48 MiB, and its IMDS calls would
bypass the process-wide IMDS rate limiter that the poll loop and the approvals share. The forwarder only ever
runs on an Azure VM (it needs IMDS Scheduled Events), so the other environments azure-identity covers do not
apply. `credential: azure-identity` in the settings switches to ManagedIdentityCredential.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from azure.core.credentials import AccessToken

from forwarder.imds import ImdsClient

# Renew this long before expiry, so a token never expires in the middle of an AMQP link or relay session.
REFRESH_MARGIN_SECONDS = 300
# Azure Relay's Entra ID scope (the listener's token; fetched ahead by the on-demand listener's warm-up).
RELAY_SCOPE = "https://relay.azure.net/.default"


def scope_to_resource(scope: str) -> str:
    """`https://eventhubs.azure.net//.default` -> `https://eventhubs.azure.net/` (as azure-identity maps it)."""
    return scope.removesuffix("/.default")


class ImdsManagedIdentityCredential:
    """Caches one token per resource and renews it REFRESH_MARGIN_SECONDS before it expires. Thread-safe."""

    def __init__(self, *, imds: ImdsClient, client_id: str | None = None) -> None:
        self._imds = imds
        self._client_id = client_id
        self._lock = threading.Lock()
        self._cache: dict[str, AccessToken] = {}

    def get_token(
        self,
        *scopes: str,
        claims: str | None = None,
        tenant_id: str | None = None,
        enable_cae: bool = False,
        **kwargs: Any,
    ) -> AccessToken:
        if len(scopes) != 1:
            raise ValueError(f"managed identity tokens are for exactly one scope, got {scopes!r}")
        resource = scope_to_resource(scopes[0])
        with self._lock:
            cached = self._cache.get(resource)
            if cached is not None and cached.expires_on - REFRESH_MARGIN_SECONDS > time.time():
                return cached
            answer = self._imds.get_token(resource, client_id=self._client_id)
            token = AccessToken(answer.access_token, answer.expires_on)
            self._cache[resource] = token
            return token

    def close(self) -> None:
        """Nothing to release (the IMDS connection belongs to the caller); part of the TokenCredential protocol."""
