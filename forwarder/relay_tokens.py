"""The listener's right to listen: a token for the hybrid connection, renewed before it expires.

Takes: a SAS rule name and key file (the local Relay emulator, tests), or an azure-core credential (the VM's managed
identity). Gives: `RelayToken`s through the `TokenProvider` protocol, which the listener calls at each connect and
renewal (forwarder/relay_listener.py); it never caches one itself, so a provider decides how long a token is reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contracts.sas import sas_token
from forwarder.credential import RELAY_SCOPE, TokenCredential


@dataclass(frozen=True)
class RelayToken:
    token: str
    expires_on: float  # unix seconds


class TokenProvider(Protocol):
    def get_token(self) -> RelayToken:
        """A token with Listen (VM) or Send (coordinator) rights for the hybrid connection."""
        ...


class SasTokenProvider:
    """SAS token from a rule name and a key kept in a file (read on every renewal so a rotated key is picked up)."""

    def __init__(self, *, resource_uri: str, key_name: str, key_file: str | Path, lifetime_seconds: int = 3600) -> None:
        if lifetime_seconds < 60:
            raise ValueError(f"lifetime_seconds={lifetime_seconds} is too short; use at least 60")
        self._resource_uri = resource_uri
        self._key_name = key_name
        self._key_file = Path(key_file)
        self._lifetime = lifetime_seconds

    def get_token(self) -> RelayToken:
        try:
            key = self._key_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise RuntimeError(f"cannot read the SAS key file {self._key_file}: {error.strerror}") from error
        if not key:
            raise RuntimeError(f"the SAS key file {self._key_file} is empty")
        expires_on = int(time.time()) + self._lifetime
        token = sas_token(resource_uri=self._resource_uri, key_name=self._key_name, key=key, expires_on=expires_on)
        return RelayToken(token, expires_on)


class EntraTokenProvider:
    """Microsoft Entra ID token for https://relay.azure.net, sent raw (no ``Bearer``) as the SDKs do.

    ``credential``: the VM's managed identity (forwarder/credential.py), or any azure-core ``TokenCredential``.
    """

    def __init__(self, *, credential: TokenCredential) -> None:
        self._credential = credential

    def get_token(self) -> RelayToken:
        access = self._credential.get_token(RELAY_SCOPE)
        return RelayToken(access.token, float(access.expires_on))
