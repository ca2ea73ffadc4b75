"""The emulators' TLS (emulators/tls.py): the local CA made once and kept, and verification that really happens: a
client trusting only the public CAs is refused by every TLS face, and the forwarder's ``tls_context()`` trusts the
local CA through ``SSL_CERT_FILE`` alone."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import certifi
import pytest
import requests
from cryptography import x509
from websockets.asyncio.client import connect

from emulators.eventhubs import EventHubsEmulator
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from emulators.tls import TLS_DIR, local_tls

ROOT = Path(__file__).resolve().parents[2]


def test_the_local_ca_is_made_once_and_kept(tmp_path: Path) -> None:
    first = local_tls(tmp_path / "tls")
    files = (first.ca, first.ca_key, first.cert, first.key, first.bundle)
    made = {path: path.read_bytes() for path in files}
    again = local_tls(tmp_path / "tls")
    assert {path: path.read_bytes() for path in files} == made  # safe to run twice: nothing made again
    assert again.bundle.read_text().startswith(certifi.contents().rstrip("\n"))
    assert again.bundle.read_text().endswith(again.ca.read_text())
    for key in (first.ca_key, first.key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    certificate = x509.load_pem_x509_certificate(first.cert.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    # A server certificate gone is made again under the same CA; the CA is kept.
    first.cert.unlink()
    local_tls(tmp_path / "tls")
    assert first.ca.read_bytes() == made[first.ca]
    assert first.cert.read_bytes() != made[first.cert]


def test_no_key_can_be_committed() -> None:
    local_tls()
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(TLS_DIR / "ca-key.pem")], cwd=ROOT, check=False, capture_output=True
    )
    assert ignored.returncode == 0, f"{TLS_DIR} must be ignored by git"


@pytest.fixture(scope="module")
def faces() -> Iterator[dict[str, str]]:
    """Every TLS face of the emulators: the Event Hubs REST API, the Relay (HTTPS senders, WSS listeners), ARM."""
    with EventHubsEmulator() as hubs, RelayEmulator() as relay, ImdsEmulator() as imds:
        yield {
            "eventhubs": f"{hubs.rest_url}/scheduled-events/messages",
            "relay": relay.send_url("vm-a"),
            "relay-wss": relay.listen_url("vm-a"),
            "arm": f"{imds.arm_url}/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines",
        }


@pytest.mark.parametrize("face", ["eventhubs", "relay", "arm"])
def test_a_client_with_only_the_public_cas_is_refused(faces: dict[str, str], face: str) -> None:
    url = faces[face]
    assert url.startswith("https://")
    with pytest.raises(requests.exceptions.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
        requests.post(url, timeout=10, verify=certifi.where())
    # The same client with the bundle (REQUESTS_CA_BUNDLE, tests/conftest.py) is answered: 401 or 400, never TLS.
    assert requests.post(url, timeout=10).status_code in (400, 401, 404, 405)


def test_a_websocket_client_with_only_the_public_cas_is_refused(faces: dict[str, str]) -> None:
    url = faces["relay-wss"]
    assert url.startswith("wss://")

    async def open_with(context: ssl.SSLContext) -> None:
        async with connect(url, ssl=context, open_timeout=10):
            pass

    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(open_with(ssl.create_default_context(cafile=certifi.where())))


def test_plain_http_is_not_answered_on_a_tls_face(faces: dict[str, str]) -> None:
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(faces["eventhubs"].replace("https://", "http://"), timeout=10)


_PROBE = """
import socket, sys
from forwarder.keepalive import tls_context
raw = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
try:
    tls_context().wrap_socket(raw, server_hostname="127.0.0.1").close()
except OSError as error:
    print(type(error).__name__)
else:
    print("verified")
"""


@pytest.mark.parametrize(("trusted", "outcome"), [("bundle", "verified"), ("public", "SSLCertVerificationError")])
def test_the_forwarders_tls_context_trusts_the_local_ca_through_ssl_cert_file(trusted: str, outcome: str) -> None:
    """The forwarder has no TLS setting of its own: Python's default context, told of the CA by SSL_CERT_FILE."""
    cafile = str(local_tls().bundle) if trusted == "bundle" else certifi.where()
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    # No system CA directory to fall back on: only the file named decides.
    env.update(SSL_CERT_FILE=cafile, SSL_CERT_DIR=str(ROOT / "no-such-dir"), PYTHONPATH=str(ROOT))
    with EventHubsEmulator() as hubs:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, hubs.rest_namespace.rsplit(":", 1)[1]],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert probe.stdout.strip() == outcome, probe.stderr
