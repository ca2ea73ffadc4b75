"""The issuing CA of an attested document's signing certificate, fetched from its CA Issuers URL.

IMDS's PKCS7 carries only the signing certificate; Microsoft's validation guidance fetches the intermediate from the
certificate's Authority Information Access "CA Issuers" URL. That URL comes from the document, so only URLs under
the allowed prefixes are fetched (Microsoft's PKI in Azure, the IMDS emulator's locally: not a way to make the
coordinator call anywhere). What is fetched is trusted only if it chains to a configured root
(coordinator/domain/attestation.py); it is kept for the process, so each issuer is fetched once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import requests
from cryptography import x509
from cryptography.x509.oid import AuthorityInformationAccessOID

log = logging.getLogger("coordinator")

# Where Microsoft publishes the issuing CAs of Azure's TLS certificates (Azure Certificate Authority details).
AZURE_ISSUER_URL_PREFIXES = ("http://www.microsoft.com/pkiops/certs/", "http://cacerts.digicert.com/")
TIMEOUT_SECONDS = 10.0
MAX_BYTES = 64 * 1024


class AiaIssuers:
    """``IssuerSource`` for coordinator/domain/attestation.py: the CA Issuers certificates of a certificate."""

    def __init__(self, allowed_prefixes: Sequence[str], *, session: requests.Session | None = None) -> None:
        self.allowed = tuple(allowed_prefixes)
        self._session = session or requests.Session()
        self._cache: dict[str, x509.Certificate] = {}
        self._lock = threading.Lock()

    def __call__(self, certificate: x509.Certificate) -> list[x509.Certificate]:
        found = []
        for url in _ca_issuer_urls(certificate):
            if not url.startswith(self.allowed):
                log.warning("attestation: CA Issuers URL %s is not under an allowed prefix %s", url[:300], self.allowed)
                continue
            with self._lock:
                cached = self._cache.get(url)
            if cached is None:
                cached = self._fetch(url)
                if cached is None:
                    continue
                with self._lock:
                    self._cache[url] = cached
            found.append(cached)
        return found

    def _fetch(self, url: str) -> x509.Certificate | None:
        try:
            response = self._session.get(url, timeout=TIMEOUT_SECONDS)
            response.raise_for_status()
            body = response.content[:MAX_BYTES]
            return (
                x509.load_pem_x509_certificate(body)
                if body.lstrip().startswith(b"-----")
                else (x509.load_der_x509_certificate(body))
            )
        except (requests.RequestException, ValueError) as error:
            # Not cached: the next document asks again. Until then its chain fails, and says what to check.
            log.warning("attestation: could not fetch the issuer certificate %s: %s", url[:300], str(error)[:300])
            return None


def _ca_issuer_urls(certificate: x509.Certificate) -> list[str]:
    try:
        access = certificate.extensions.get_extension_for_class(x509.AuthorityInformationAccess).value
    except x509.ExtensionNotFound:
        return []
    return [
        str(item.access_location.value)
        for item in access
        if item.access_method == AuthorityInformationAccessOID.CA_ISSUERS
        and isinstance(item.access_location, x509.UniformResourceIdentifier)
    ]
