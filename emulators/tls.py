"""TLS for the local emulators, as Azure serves Event Hubs, Relay and ARM: a local CA, one server certificate for
127.0.0.1 and localhost, and the CA bundle clients verify it with (certifi's CAs + the local CA).

``local_tls()`` makes them on first use under ``.local/tls/`` (never committed; ``scripts/bootstrap.sh`` calls it
too) and reuses them after; it is safe to call twice and from two processes at once (a file lock). Servers take
``server_context()`` (``TlsHTTPServer`` for the stdlib's HTTP servers, ``ssl=`` for websockets); clients are told
nothing but the usual settings, ``client_env()``: ``SSL_CERT_FILE`` for Python's default context (the forwarder's
``tls_context()``, websockets) and ``REQUESTS_CA_BUNDLE`` for requests and azure-core. No client turns verification
off: a client without the bundle is refused (tests/emulators/test_tls.py).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import ssl
import sys
from dataclasses import dataclass
from functools import cache
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import certifi
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TLS_DIR = Path(__file__).resolve().parent.parent / ".local" / "tls"
HOSTS = ("127.0.0.1", "localhost")
# A server certificate is made again this long before it expires (it lasts a year; the CA ten).
RENEW_BEFORE = datetime.timedelta(days=30)
# A client that connects and never completes its handshake holds only its own thread, and only this long.
HANDSHAKE_SECONDS = 10.0


@dataclass(frozen=True)
class LocalTls:
    """The files of one local CA: ``ca`` (the CA's certificate), ``cert``/``key`` (the servers'), ``bundle``."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca-key.pem"

    @property
    def cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def key(self) -> Path:
        return self.directory / "server-key.pem"

    @property
    def bundle(self) -> Path:
        return self.directory / "bundle.pem"

    def server_context(self) -> ssl.SSLContext:
        return _server_context(self.cert, self.key)

    def client_env(self) -> dict[str, str]:
        """The settings that make a client process trust the emulators (and every public CA it trusted before)."""
        return {
            "SSL_CERT_FILE": str(self.bundle),
            "REQUESTS_CA_BUNDLE": str(self.bundle),
            "NODE_EXTRA_CA_CERTS": str(self.ca),  # Node's (the hyco-https listener of tests/emulators/relay)
        }


@cache
def _server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def local_tls(directory: Path = TLS_DIR) -> LocalTls:
    """The local CA and server certificate in ``directory``, made if missing (or the certificate near its end)."""
    files = LocalTls(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (files.ca.exists() and files.ca_key.exists()):
            _make_ca(files)
        if not _current(files):
            _make_server_cert(files)
        bundle = certifi.contents().rstrip("\n") + "\n" + files.ca.read_text()
        if not files.bundle.exists() or files.bundle.read_text() != bundle:
            _write(files.bundle, bundle.encode())
    return files


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Written whole or not at all (another process may read it meanwhile); a private key readable by its owner."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(os.open(temporary, flags, 0o600 if private else 0o644), "wb") as out:
        out.write(data)
    temporary.replace(path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _make_ca(files: LocalTls) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"scheduled-events local CA ({socket.gethostname()})")])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    _write(files.ca_key, _key_pem(key), private=True)
    _write(files.ca, certificate.public_bytes(serialization.Encoding.PEM))
    files.cert.unlink(missing_ok=True)  # signed by the CA replaced


def _current(files: LocalTls) -> bool:
    """Whether the server certificate is there, signed by this CA, and not near its end."""
    if not (files.cert.exists() and files.key.exists()):
        return False
    try:
        certificate = x509.load_pem_x509_certificate(files.cert.read_bytes())
        ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
        certificate.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return certificate.not_valid_after_utc - RENEW_BEFORE > _now()


def _make_server_cert(files: LocalTls) -> None:
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(HOSTS[0])), x509.DNSName(HOSTS[1])]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOSTS[1])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, certificate.public_bytes(serialization.Encoding.PEM))


def trust_local_ca() -> LocalTls:
    """This process, and every process it starts from its environment, trusts the local CA (``client_env``)."""
    made = local_tls()
    os.environ.update(made.client_env())
    return made


class TlsHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer speaking TLS with ``context``; each handshake runs on its connection's own thread, so a
    client that never completes one (or refuses the certificate) holds up no one else."""

    def __init__(self, address: tuple[str, int], handler: Any, *, context: ssl.SSLContext) -> None:
        self.context = context
        super().__init__(address, handler)

    def get_request(self) -> tuple[Any, Any]:
        connection, address = self.socket.accept()
        return self.context.wrap_socket(connection, server_side=True, do_handshake_on_connect=False), address

    def finish_request(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(HANDSHAKE_SECONDS)
            request.do_handshake()
            request.settimeout(None)
        except (OSError, ValueError):  # ssl.SSLError is an OSError: a client that refused us, or left
            return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            return  # a peer that went away mid-stream; nothing to report
        super().handle_error(request, client_address)


if __name__ == "__main__":  # scripts/bootstrap.sh
    made = local_tls()
    print(f"local CA: {made.ca}; clients trust it through {made.bundle}")
