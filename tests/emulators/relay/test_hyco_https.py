"""Microsoft's own Node listener library (hyco-https 1.4.5) listens through the emulator, unchanged.

Skipped only where Node or the project's node_modules are not installed (scripts/bootstrap.sh installs both).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from emulators.relay import RelayEmulator, Right
from emulators.relay.auth import SasRule, TokenChecker, create_sas_token
from tests.emulators.relay.raw import KEY, KEY_NAME, sas

ROOT = Path(__file__).resolve().parents[3]
NODE_MODULES = ROOT / "tools" / "node" / "node_modules"
LISTENER_JS = Path(__file__).with_name("hyco_listener.js")
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not (NODE_MODULES / "hyco-https").is_dir(),
    reason="node and tools/node/node_modules/hyco-https are required (run scripts/bootstrap.sh)",
)


def _node_env() -> dict[str, str]:
    return {**os.environ, "NODE_PATH": str(NODE_MODULES)}


@pytest.fixture
def hyco(relay: RelayEmulator) -> Iterator[RelayEmulator]:
    assert NODE is not None
    process = subprocess.Popen(
        [NODE, str(LISTENER_JS), relay.listen_url("vm-hyco"), sas(relay, "vm-hyco")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_node_env(),
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "listening"
        deadline = time.monotonic() + 5
        while relay.listener_count("vm-hyco") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.listener_count("vm-hyco") == 1
        yield relay
    finally:
        process.terminate()
        _, errors = process.communicate(timeout=10)
        assert "hyco-https error" not in errors, errors


def test_small_request_and_response_on_the_control_channel(hyco: RelayEmulator) -> None:
    response = requests.post(
        hyco.send_url("vm-hyco") + "/approve/E1?force=no&sb-hc-token=" + requests.compat.quote(sas(hyco), safe=""),
        json={"EventId": "E1"},
        headers={"X-Trace": "t-1"},
        timeout=10,
    )
    assert response.status_code == 202
    assert response.headers["X-Handled-By"] == "hyco-https"
    assert response.headers["Via"] == f"1.1 127.0.0.1:{hyco.port}"
    seen = response.json()
    assert seen["method"] == "POST"
    assert seen["url"] == "/vm-hyco/approve/E1?force=no"
    assert seen["headers"]["x-trace"] == "t-1"
    assert "host" not in seen["headers"]
    assert seen["bodyLength"] == len(b'{"EventId": "E1"}')
    assert "rendezvous.response" not in hyco.counters()


def test_request_above_64kb_goes_through_rendezvous(hyco: RelayEmulator) -> None:
    payload = os.urandom(100 * 1024)
    response = requests.put(
        hyco.send_url("vm-hyco") + "/upload",
        data=payload,
        headers={"ServiceBusAuthorization": sas(hyco, "vm-hyco")},
        timeout=10,
    )
    assert response.status_code == 200
    seen = response.json()
    assert seen["method"] == "PUT"
    assert seen["bodyLength"] == len(payload)
    assert seen["bodySha256"] == hashlib.sha256(payload).hexdigest()
    assert hyco.counters()["rendezvous.request"] == 1


def test_response_above_64kb_comes_back_over_rendezvous(hyco: RelayEmulator) -> None:
    response = requests.get(
        hyco.send_url("vm-hyco") + "/download?size=150000",
        headers={"Authorization": sas(hyco, "vm-hyco")},
        timeout=10,
    )
    assert response.status_code == 200
    assert response.content == b"z" * 150000
    assert hyco.counters()["rendezvous.response"] == 1


def test_many_sequential_requests_keep_the_control_channel_healthy(hyco: RelayEmulator) -> None:
    for index in range(20):
        response = requests.get(
            hyco.send_url("vm-hyco") + f"/ping/{index}", headers={"Authorization": sas(hyco)}, timeout=10
        )
        assert response.json()["url"] == f"/vm-hyco/ping/{index}"


def test_python_sas_tokens_are_byte_for_byte_those_of_hyco_create_relay_token() -> None:
    assert NODE is not None
    uri = "wss://contoso.servicebus.windows.net:443/$hc/vm-a?sb-hc-action=listen"
    script = (
        "const h=require('hyco-https');"
        f"process.stdout.write(h.createRelayToken({json.dumps(uri)}, {json.dumps(KEY_NAME)}, {json.dumps(KEY)}))"
    )
    node_token = subprocess.run(
        [NODE, "-e", script], capture_output=True, text=True, check=True, env=_node_env(), timeout=20
    ).stdout
    expiry = int(node_token.rsplit("&se=", 1)[1].split("&")[0])
    assert create_sas_token(uri, key_name=KEY_NAME, key=KEY, expires_in=0, now=expiry) == node_token
    checker = TokenChecker(sas_rules={KEY_NAME: SasRule(KEY)})
    grant = checker.authorize(node_token, hybrid_connection="vm-a", right=Right.LISTEN)
    assert grant.expires_at == expiry


def test_requests_after_a_rendezvous_follow_it_on_a_kept_alive_connection(hyco: RelayEmulator) -> None:
    with requests.Session() as session:
        session.headers["ServiceBusAuthorization"] = sas(hyco, "vm-hyco")
        big = session.put(hyco.send_url("vm-hyco") + "/upload", data=os.urandom(80 * 1024), timeout=10)
        assert big.json()["bodyLength"] == 80 * 1024
        for index in range(3):
            small = session.post(hyco.send_url("vm-hyco") + f"/next/{index}", data=b"small", timeout=10)
            assert small.json()["url"] == f"/vm-hyco/next/{index}"
            assert small.json()["bodyLength"] == 5
    # One rendezvous for the whole connection: the later requests did not need another.
    assert hyco.counters()["rendezvous.request"] == 1
