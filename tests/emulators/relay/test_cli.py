"""``python -m emulators.relay``: one JSON line of URLs, serves until SIGTERM, then closes listeners with 1001."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from emulators.relay import create_sas_token
from emulators.tls import local_tls
from tests.emulators.relay.raw import RawListener, http

ROOT = Path(__file__).resolve().parents[3]


def test_cli_serves_until_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "emulators.relay", "--port", "0", "--sas-key-name", "root", "--require-known"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"RELAY_EMULATOR_SAS_KEY": "cli-key", "PATH": "/usr/bin:/bin"},
    )
    try:
        assert process.stdout is not None
        urls = json.loads(process.stdout.readline())
        base = urls["relay"]
        assert base.startswith("https://127.0.0.1:")
        assert urls["listen"] == base.replace("https://", "wss://") + "/$hc/{path}?sb-hc-action=listen"
        assert urls["caBundle"] == str(local_tls().bundle)
        assert urls["requireKnown"] is True

        async def scenario() -> None:
            token = create_sas_token(urls["resource"].format(path="vm-a"), key_name="root", key="cli-key")
            assert (
                await http("GET", urls["send"].format(path="vm-a"), headers={"Authorization": token})
            ).status_code == 404
            assert (await http("PUT", urls["control"].format(name="vm-a"))).status_code == 201
            listener = await RawListener.open(urls["listen"].format(path="vm-a"), token)
            sending = asyncio.create_task(
                http("GET", urls["send"].format(path="vm-a"), headers={"Authorization": token})
            )
            incoming = await listener.next_request()
            await listener.respond(incoming.request["id"], 200, b"from cli relay")
            assert (await sending).content == b"from cli relay"
            process.send_signal(signal.SIGTERM)
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(listener.ws.recv(), 10)
            assert listener.ws.close_code == 1001

        asyncio.run(scenario())
        assert process.wait(timeout=15) == 0
        assert process.stderr is not None
        assert "cli-key" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_refuses_a_key_name_without_a_key() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "emulators.relay", "--sas-key-name", "root"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=20,
    )
    assert result.returncode == 2
    assert "--sas-key-name and --sas-key" in result.stderr
