"""Entra ID-shaped access tokens for the local emulators.

The IMDS emulator's managed-identity endpoint mints them; the Relay and Event Hubs emulators check them.
Real Entra tokens are RS256-signed by Microsoft; locally there is no such key, so these are HS256 JWTs signed
with a development key that every emulator shares. The claims that matter are the real ones: ``aud`` (the
resource, e.g. https://relay.azure.net), ``exp``/``nbf``, and ``xms_mirid`` (the identity's resource id).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import jwt

DEVELOPMENT_SIGNING_KEY = "local-emulator-signing-key-not-a-secret"
ISSUER = "https://sts.windows.net/00000000-0000-0000-0000-000000000000/"


class TokenError(ValueError):
    """The token is malformed, expired, not yet valid, or for another audience."""


def mint_token(*, audience: str, identity_resource_id: str, lifetime_seconds: int = 3600) -> tuple[str, int]:
    """Returns (token, expires_on unix seconds)."""
    now = int(time.time())
    expires_on = now + lifetime_seconds
    claims = {
        "aud": audience.rstrip("/"),
        "iss": ISSUER,
        "iat": now,
        "nbf": now,
        "exp": expires_on,
        "oid": str(uuid.uuid5(uuid.NAMESPACE_URL, identity_resource_id)),
        "sub": str(uuid.uuid5(uuid.NAMESPACE_URL, identity_resource_id)),
        "xms_mirid": identity_resource_id,
    }
    return jwt.encode(claims, DEVELOPMENT_SIGNING_KEY, algorithm="HS256"), expires_on


def verify_token(token: str, *, audience: str) -> dict[str, Any]:
    """Checks signature, audience (with or without a trailing slash) and time validity; returns the claims."""
    try:
        claims: dict[str, Any] = jwt.decode(
            token.removeprefix("Bearer ").strip(),
            DEVELOPMENT_SIGNING_KEY,
            algorithms=["HS256"],
            audience=[audience.rstrip("/"), audience.rstrip("/") + "/"],
            options={"require": ["aud", "exp", "nbf"]},
        )
    except jwt.PyJWTError as error:
        raise TokenError(f"access token refused: {error}") from error
    return claims
