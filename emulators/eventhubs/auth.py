"""Claims-based security for the emulator: SAS tokens checked for real, Entra tokens via ``emulators.tokens``.

A SAS token is ``SharedAccessSignature sr=<url-encoded resource>&sig=<base64 HMAC-SHA256>&se=<expiry>&skn=<key
name>``, signed over ``url-encoded resource + "\\n" + expiry`` with the namespace key. The resource scopes the
grant: ``sb://host`` covers every hub, ``sb://host/hub`` only that hub. An Entra token (CBS type ``jwt``) from
the local IMDS emulator covers the namespace, as a managed identity with a data-plane role would.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from urllib.parse import parse_qsl, quote, quote_plus, unquote_plus, urlparse

from pydantic import BaseModel, ConfigDict

from emulators.tokens import TokenError, verify_token

SAS_TOKEN_TYPE = "servicebus.windows.net:sastoken"  # noqa: S105  # a CBS token type name, not a secret
JWT_TOKEN_TYPE = "jwt"  # noqa: S105  # a CBS token type name, not a secret
EVENTHUBS_AUDIENCE = "https://eventhubs.azure.net"
_SAS_PREFIX = "SharedAccessSignature "


class AuthError(ValueError):
    """A token was refused; the message says why (it is sent back to the client as the status description)."""


class Grant(BaseModel):
    """What an accepted token allows: entity paths under ``path`` ("" = whole namespace) until ``expires_at``."""

    model_config = ConfigDict(frozen=True)

    path: str
    expires_at: float
    identity: str

    def covers(self, entity_path: str, *, now: float | None = None) -> bool:
        if (now if now is not None else time.time()) >= self.expires_at:
            return False
        if not self.path:
            return True
        entity = entity_path.strip("/").lower()
        return entity == self.path or entity.startswith(self.path + "/")


def resource_path(resource: str) -> str:
    """``sb://host:port/Hub/`` → ``hub``: the entity path a token or audience names, lower-cased (as the service
    treats entity names)."""
    parsed = urlparse(resource if "://" in resource else f"sb://{resource}")
    return parsed.path.strip("/").lower()


def validate_sas_token(token: str, *, key_name: str, key: str, now: float | None = None) -> Grant:
    """Checks a SAS token's signature, key name and expiry against the namespace key; returns its grant."""
    if not token.startswith(_SAS_PREFIX):
        raise AuthError("SAS token must start with 'SharedAccessSignature '")
    fields = dict(parse_qsl(token[len(_SAS_PREFIX) :], keep_blank_values=True))
    missing = sorted({"sr", "sig", "se", "skn"} - fields.keys())
    if missing:
        raise AuthError(f"SAS token lacks {', '.join(missing)}")
    resource, signature, expiry, token_key_name = fields["sr"], fields["sig"], fields["se"], fields["skn"]
    if unquote_plus(token_key_name) != key_name:
        raise AuthError(f"SAS token names key {token_key_name!r}, which this namespace does not have")
    try:
        expires_at = int(expiry)
    except ValueError:
        raise AuthError(f"SAS token expiry {expiry!r} is not an integer") from None
    if expires_at <= (now if now is not None else time.time()):
        raise AuthError(f"SAS token expired at {expires_at}; get a new token")
    # Generators differ in how they URL-encode the resource (Python quote_plus, JavaScript encodeURIComponent);
    # the signature is valid if it matches the resource as any of them would have encoded it.
    expected = {
        _sign(key, f"{encoded}\n{expiry}") for encoded in {quote_plus(resource), quote(resource, safe=""), resource}
    }
    if not any(hmac.compare_digest(signature, candidate) for candidate in expected):
        raise AuthError("SAS token signature does not match the namespace key")
    return Grant(path=resource_path(resource), expires_at=expires_at, identity=f"sas:{key_name}")


def validate_jwt(token: str, *, now: float | None = None) -> Grant:
    """Checks an Entra-shaped token minted by the local IMDS emulator (audience https://eventhubs.azure.net)."""
    del now  # PyJWT checks exp/nbf against the clock itself
    try:
        claims = verify_token(token, audience=EVENTHUBS_AUDIENCE)
    except TokenError as error:
        raise AuthError(str(error)) from error
    return Grant(path="", expires_at=float(claims["exp"]), identity=str(claims.get("xms_mirid", claims.get("sub"))))


def validate_token(token: str, token_type: str, *, key_name: str, key: str) -> Grant:
    """Dispatches on the CBS token type the client declared."""
    if token_type == SAS_TOKEN_TYPE:
        return validate_sas_token(token, key_name=key_name, key=key)
    if token_type == JWT_TOKEN_TYPE:
        return validate_jwt(token)
    raise AuthError(f"unsupported CBS token type {token_type!r}; use {SAS_TOKEN_TYPE!r} or {JWT_TOKEN_TYPE!r}")


def _sign(key: str, string_to_sign: str) -> str:
    digest = hmac.new(key.encode("utf-8"), string_to_sign.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")
