"""Shared Access Signature tokens for Azure Relay, as the official SDKs build them (stdlib only).

Used by the VM's listener (Listen) and by the coordinator's sender (Send); Entra ID tokens are the default on
both sides, SAS the option.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from urllib.parse import quote, urlsplit


def relay_resource_uri(endpoint: str, hybrid_connection: str) -> str:
    """The SAS ``sr`` for a hybrid connection: http scheme, no port, no ``$hc/`` (as the official SDKs do)."""
    host = urlsplit(endpoint).hostname
    if not host:
        raise ValueError(f"relay endpoint {endpoint!r} has no host name; expected e.g. wss://ns.servicebus.windows.net")
    return f"http://{host}/{hybrid_connection}"


def sas_token(*, resource_uri: str, key_name: str, key: str, expires_on: int) -> str:
    """``SharedAccessSignature sr=…&sig=…&se=…&skn=…``; the signature is quoted with ``safe=''`` so that a ``/``
    in the base64 text cannot break the token (the docs' helper forgets this)."""
    encoded_uri = quote(resource_uri, safe="")
    digest = hmac.new(key.encode("utf-8"), f"{encoded_uri}\n{expires_on}".encode(), hashlib.sha256).digest()
    signature = quote(base64.b64encode(digest).decode("ascii"), safe="")
    return f"SharedAccessSignature sr={encoded_uri}&sig={signature}&se={expires_on}&skn={key_name}"
