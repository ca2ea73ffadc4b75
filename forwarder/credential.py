"""The VM's managed identity, read straight from IMDS: the tokens of the Event Hubs sender (forwarder/eventhub.py)
and of the relay listener (forwarder/relay_tokens.py).

Why not azure-identity's ManagedIdentityCredential: on a VM it does the same IMDS call, but importing it (msal,
cryptography, requests, azure-core) adds ~17 MiB to a daemon that must stay as small as a bare poller, and its IMDS
calls would bypass the process-wide IMDS rate limiter that the poll loop and the approvals share. The forwarder
only ever runs on an Azure VM (it needs IMDS Scheduled Events), so the other environments azure-identity covers do
not apply. ``get_token(scope)`` has azure-core's ``TokenCredential`` shape, so an azure-identity credential can
stand in for it where a test needs one.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple, Protocol

from forwarder.imds import ImdsClient

# Renew this long before expiry, so a token never expires in the middle of an AMQP link or relay session.
REFRESH_MARGIN_SECONDS = 300
# Azure Relay's Entra ID scope (the listener's token; fetched ahead by the on-demand listener's warm-up).
RELAY_SCOPE = "https://relay.azure.net/.default"


class AccessToken(NamedTuple):
    """azure-core's ``AccessToken``: the token and when it expires (unix seconds)."""

    token: str
    expires_on: int


class Token(Protocol):
    """A token as ``AccessToken`` (this module's or azure-core's) holds it."""

    @property
    def token(self) -> str: ...

    @property
    def expires_on(self) -> int: ...


class TokenCredential(Protocol):
    """What the sender and the listener take a token from (azure-core's ``TokenCredential`` shape)."""

    def get_token(self, *scopes: str, **kwargs: Any) -> Token: ...


# Event Hubs' Entra ID scope (the sender's token; the managed identity needs "Azure Event Hubs Data Sender"), spelt
# as azure-eventhub asks for it: resource "https://eventhubs.azure.net/".
EVENTHUBS_SCOPE = "https://eventhubs.azure.net//.default"


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
