"""Launches Azurite (the Azure Storage emulator, from tools/node) on free loopback ports.

Used by the test suite (tests/conftest.py) and by the local mode. The coordinator keeps its state in Table Storage,
continues slow approvals through a Storage queue (``queue_sas`` signs for it), and the Event Hubs checkpoint store
uses Blob. In-memory persistence: nothing is left on disk and ``--location`` must not be given with it (Azurite
refuses the combination).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

REPO_ROOT = Path(__file__).resolve().parent.parent
AZURITE_BIN = REPO_ROOT / "tools" / "node" / "node_modules" / ".bin" / "azurite"

# Azurite's well-known development account; documented publicly and accepted only by the emulator.
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class AzuriteError(RuntimeError):
    """Azurite could not be started; the message says what to install or check."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _exits(process: subprocess.Popen[bytes], within: float) -> bool:
    try:
        process.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return False
    return True


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class AzuriteEndpoints:
    blob_port: int
    table_port: int
    queue_port: int

    @property
    def blob_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.blob_port}/{DEV_ACCOUNT}"

    @property
    def table_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.table_port}/{DEV_ACCOUNT}"

    @property
    def queue_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.queue_port}/{DEV_ACCOUNT}"

    def queue_sas(self, *, expiry: datetime) -> str:
        """An account SAS for every operation on the development account's queues, valid until ``expiry`` (aware):
        the query string the coordinator's delivery queue and the local host's queue trigger use."""
        return account_sas(services="q", permissions="rwdlacup", expiry=expiry)

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
            f"BlobEndpoint={self.blob_endpoint};TableEndpoint={self.table_endpoint};QueueEndpoint={self.queue_endpoint};"
        )


def account_sas(*, services: str, permissions: str, expiry: datetime) -> str:
    """An account SAS of the development account (Azure Storage's account SAS, version 2019-02-02: the string to
    sign is the account, permissions, services, resource types, start, expiry, IP, protocol and version, one a line,
    signed with HMAC-SHA256 under the account key)."""
    version = "2019-02-02"
    fields = {
        "sv": version,
        "ss": services,
        "srt": "sco",
        "sp": permissions,
        "se": expiry.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "spr": "https,http",
    }
    signed = "\n".join((DEV_ACCOUNT, permissions, services, "sco", "", fields["se"], "", fields["spr"], version, ""))
    digest = hmac.new(base64.b64decode(DEV_KEY), signed.encode(), hashlib.sha256).digest()
    fields["sig"] = base64.b64encode(digest).decode()
    return "&".join(f"{name}={quote(value, safe='')}" for name, value in fields.items())


class Azurite:
    """A running Azurite process (blob + table). Use as a context manager or call start()/stop()."""

    def __init__(self, *, binary: Path = AZURITE_BIN, startup_timeout: float = 20.0) -> None:
        self._binary = binary
        self._startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._endpoints: AzuriteEndpoints | None = None

    @property
    def endpoints(self) -> AzuriteEndpoints:
        if self._endpoints is None:
            raise AzuriteError("Azurite is not running; call start() first")
        return self._endpoints

    @property
    def pid(self) -> int | None:
        """The node process's id while it runs (the local runner stops it to play a storage stall)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> AzuriteEndpoints:
        if not self._binary.exists():
            raise AzuriteError(f"{self._binary} not found; run scripts/bootstrap.sh to install tools/node")
        # A port picked free can be taken before Azurite binds it (other test runs share the machine): retry.
        last_error = ""
        for _ in range(3):
            blob_port, table_port = _free_port(), _free_port()
            queue_port = _free_port()
            command = [str(self._binary)]
            for service, port in (("blob", blob_port), ("queue", queue_port), ("table", table_port)):
                command += [f"--{service}Host", "127.0.0.1", f"--{service}Port", str(port)]
            command += ["--disableTelemetry", "--inMemoryPersistence", "--skipApiVersionCheck", "--silent"]
            # The binary is the project's own tools/node install; no input from outside reaches the command.
            process = subprocess.Popen(  # noqa: S603
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            deadline = time.monotonic() + self._startup_timeout
            try:
                while time.monotonic() < deadline and process.poll() is None:
                    # All three ports: Azurite binds its services one after another and exits when a later bind
                    # fails (a port taken between _free_port and the bind), so blob and table accepting proves
                    # nothing if the queue port was lost (seen in CI: the next request was refused). Then it must
                    # still be alive a moment later: a port can accept because another process holds it while
                    # Azurite is exiting.
                    if all(_accepts(p) for p in (blob_port, queue_port, table_port)) and not _exits(process, 0.2):
                        self._process = process
                        self._endpoints = AzuriteEndpoints(
                            blob_port=blob_port, table_port=table_port, queue_port=queue_port
                        )
                        return self._endpoints
                    time.sleep(0.05)
            except BaseException:  # Ctrl-C while it starts: no one else holds the process to stop it
                process.kill()
                process.wait(timeout=5)
                raise
            if process.poll() is None:
                process.kill()
            _, stderr = process.communicate(timeout=5)
            last_error = stderr.decode(errors="replace")[-2000:]
        raise AzuriteError(f"Azurite did not start on loopback: {last_error or 'no output'}")

    def stop(self) -> None:
        process, self._process = self._process, None
        self._endpoints = None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        if process.stderr is not None:
            process.stderr.close()

    def __enter__(self) -> AzuriteEndpoints:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m emulators.azurite", description="Run Azurite (blob+table) on free loopback ports."
    )
    parser.parse_args(argv)
    azurite = Azurite()
    endpoints = azurite.start()
    print(
        json.dumps(
            {
                "blobEndpoint": endpoints.blob_endpoint,
                "tableEndpoint": endpoints.table_endpoint,
                "connectionString": endpoints.connection_string,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    stop = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        azurite.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
