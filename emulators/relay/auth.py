"""Relay access tokens: Shared Access Signatures checked for real, Entra ID tokens via ``emulators.tokens``.

Pure decision code (no I/O): given a token, the hybrid connection it is used on and the right the action needs,
either a :class:`Grant` comes back or an :class:`AuthError` carrying the HTTP status the real service answers
(401: missing, malformed or not a valid token; 403: valid token that does not cover this path or right, or expired).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import jwt

from emulators.status_error import StatusError
from emulators.tokens import TokenError, verify_token

RELAY_AUDIENCE = "https://relay.azure.net"
SAS_PREFIX = "SharedAccessSignature "


class Right(StrEnum):
    """Rights a SAS rule or a role assignment confers (the names the Relay ARM API uses)."""

    LISTEN = "Listen"
    SEND = "Send"
    MANAGE = "Manage"


ALL_RIGHTS: frozenset[Right] = frozenset(Right)


class AuthError(StatusError):
    """The token does not allow the action; ``status`` is what the service answers (401 or 403)."""


@dataclass(frozen=True)
class SasRule:
    """A shared access authorization rule: its key and the rights it confers (Manage implies Listen and Send)."""

    key: str
    rights: frozenset[Right] = ALL_RIGHTS

    def confers(self, right: Right) -> bool:
        return right in self.rights or Right.MANAGE in self.rights


@dataclass(frozen=True)
class Grant:
    """What an accepted token allows: who presented it and until when (unix seconds)."""

    subject: str
    expires_at: float
    kind: str  # "sas" or "entra"


def normalize_resource_uri(uri: str) -> str:
    """The resource URI a SAS token is signed for, normalised as hyco-https ``createRelayToken`` does.

    The scheme becomes ``http``, query and fragment go, and the ``$hc/`` segment of a WebSocket address is removed,
    so ``wss://ns:443/$hc/vm-a?sb-hc-action=listen`` and ``https://ns:443/vm-a`` both sign ``http://ns:443/vm-a``.
    """
    parts = urlsplit(uri)
    path = parts.path.replace("$hc/", "", 1)
    return urlunsplit(("http", parts.netloc, path, "", ""))


def create_sas_token(
    resource_uri: str, *, key_name: str, key: str, expires_in: float = 3600, now: float | None = None
) -> str:
    """A ``SharedAccessSignature sr=&sig=&se=&skn=`` token, byte-for-byte what hyco-https would build."""
    expiry = int((time.time() if now is None else now) + expires_in)
    encoded_uri = quote(normalize_resource_uri(resource_uri), safe="")
    digest = hmac.new(key.encode(), f"{encoded_uri}\n{expiry}".encode(), hashlib.sha256).digest()
    signature = quote(base64.b64encode(digest).decode(), safe="")
    return f"{SAS_PREFIX}sr={encoded_uri}&sig={signature}&se={expiry}&skn={key_name}"


def _entity_of(resource: str) -> str:
    """The entity path a (decoded) ``sr`` names: '' for the namespace, else the hybrid connection path."""
    path = urlsplit(resource).path if "://" in resource else resource.partition("/")[2]
    return path.replace("$hc/", "", 1).strip("/").lower()


def _covers(resource_entity: str, hybrid_connection: str) -> bool:
    target = hybrid_connection.strip("/").lower()
    return resource_entity in ("", target) or target.startswith(resource_entity + "/")


@dataclass
class TokenChecker:
    """Checks Relay tokens the way the service does for one namespace.

    ``sas_rules`` maps rule name → :class:`SasRule`. ``role_assignments`` models Entra RBAC: identity (the token's
    ``xms_mirid`` or ``oid``) → rights; when it is ``None`` any valid Entra token for ``https://relay.azure.net``
    holds Listen and Send (as if every caller had both Azure Relay Listener and Sender roles).
    """

    sas_rules: Mapping[str, SasRule] = field(default_factory=dict)
    role_assignments: Mapping[str, frozenset[Right]] | None = None
    clock: Callable[[], float] = time.time

    def authorize(self, token: str | None, *, hybrid_connection: str, right: Right) -> Grant:
        if token is None or not token.strip():
            raise AuthError(401, "the request carries no Relay token (sb-hc-token, ServiceBusAuthorization)")
        token = token.strip()
        if token.startswith(SAS_PREFIX):
            return self._authorize_sas(token, hybrid_connection=hybrid_connection, right=right)
        return self._authorize_entra(token, hybrid_connection=hybrid_connection, right=right)

    def _authorize_sas(self, token: str, *, hybrid_connection: str, right: Right) -> Grant:
        fields: dict[str, str] = {}
        for pair in token.removeprefix(SAS_PREFIX).split("&"):
            name, sep, value = pair.partition("=")
            if not sep or name in fields:
                raise AuthError(401, f"malformed SharedAccessSignature: bad or repeated field {name!r}")
            fields[name] = value
        missing = {"sr", "sig", "se", "skn"} - fields.keys()
        if missing:
            raise AuthError(401, f"malformed SharedAccessSignature: missing {', '.join(sorted(missing))}")
        try:
            expiry = int(fields["se"])
        except ValueError:
            raise AuthError(401, f"malformed SharedAccessSignature: se={fields['se']!r} is not unix seconds") from None
        rule = self.sas_rules.get(unquote(fields["skn"]))
        if rule is None:
            raise AuthError(401, f"SharedAccessSignature names unknown key {unquote(fields['skn'])!r}")
        # The signature covers sr exactly as it appears in the token (still URL-encoded).
        expected = hmac.new(rule.key.encode(), f"{fields['sr']}\n{expiry}".encode(), hashlib.sha256).digest()
        try:
            presented = base64.b64decode(unquote(fields["sig"]), validate=True)
        except ValueError:
            raise AuthError(401, "malformed SharedAccessSignature: sig is not base64") from None
        if not hmac.compare_digest(expected, presented):
            raise AuthError(401, "SharedAccessSignature signature does not match (wrong key or altered token)")
        if expiry <= self.clock():
            raise AuthError(403, f"SharedAccessSignature expired at {expiry} (unix seconds)")
        resource = unquote(fields["sr"])
        if not _covers(_entity_of(resource), hybrid_connection):
            raise AuthError(403, f"token for {resource!r} is not valid for hybrid connection {hybrid_connection!r}")
        if not rule.confers(right):
            raise AuthError(403, f"key {unquote(fields['skn'])!r} does not confer the {right} right")
        return Grant(subject=unquote(fields["skn"]), expires_at=float(expiry), kind="sas")

    def _authorize_entra(self, token: str, *, hybrid_connection: str, right: Right) -> Grant:
        if token.removeprefix("Bearer ").count(".") != 2:
            raise AuthError(401, "token is neither a SharedAccessSignature nor a JWT")
        try:
            claims = verify_token(token, audience=RELAY_AUDIENCE)
        except TokenError as error:
            status = 403 if isinstance(error.__cause__, jwt.ExpiredSignatureError) else 401
            raise AuthError(status, str(error)) from None
        subject = str(claims.get("xms_mirid") or claims.get("oid") or claims.get("sub") or "")
        if self.role_assignments is not None:
            rights = self.role_assignments.get(subject, frozenset())
            if right not in rights and Right.MANAGE not in rights:
                raise AuthError(403, f"identity {subject!r} has no Azure Relay role conferring {right}")
        return Grant(subject=subject, expires_at=float(claims["exp"]), kind="entra")


def parse_rights(text: str | Iterable[str]) -> frozenset[Right]:
    """``"Listen,Send"`` → rights; raises ValueError naming an unknown right."""
    names = [part.strip() for part in (text.split(",") if isinstance(text, str) else text) if part.strip()]
    by_name = {right.value.lower(): right for right in Right}
    unknown = [name for name in names if name.lower() not in by_name]
    if unknown or not names:
        raise ValueError(f"rights must be a comma-separated subset of Listen,Send,Manage; got {text!r}")
    return frozenset(by_name[name.lower()] for name in names)
