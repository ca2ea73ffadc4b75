"""The local gate pages (local/gates.py): each answers as its behaviour says, and every change is logged."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests

from local.gates import GateServer, local_gate_names


@pytest.fixture
def gates() -> Iterator[GateServer]:
    server = GateServer(["health", "other"])
    server.start()
    yield server
    server.stop()


def test_a_policy_names_its_local_gates_and_is_pointed_at_the_server(gates: GateServer) -> None:
    text = 'gates:\n  health: {http: {url: "http://local-gates/health"}}\n  far: {http: {url: "https://x.example/"}}\n'
    assert local_gate_names(text) == ["health"]
    assert f"http://127.0.0.1:{gates.port}/health" in gates.rewrite_policy(text)


def test_each_behaviour_answers_as_it_says_and_is_logged(gates: GateServer) -> None:
    url = f"http://127.0.0.1:{gates.port}"
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    gates.set("health", "failing")
    assert requests.get(f"{url}/health", timeout=5).status_code == 503
    gates.set("health", "slow", 0.4)
    started = time.monotonic()
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    assert time.monotonic() - started >= 0.4
    gates.set("health", "trickle", 0.4)
    started = time.monotonic()
    answer = requests.get(f"{url}/health", timeout=5)
    assert (answer.status_code, len(answer.content)) == (200, 16)
    assert time.monotonic() - started >= 0.4
    gates.set("health", "dead")
    with pytest.raises(requests.Timeout):
        requests.get(f"{url}/health", timeout=0.5)
    assert requests.get(f"{url}/other", timeout=5).status_code == 200
    assert requests.get(f"{url}/unknown", timeout=5).status_code == 404
    assert [(change.name, change.behaviour) for change in gates.log] == [
        ("health", "passing"),
        ("other", "passing"),
        ("health", "failing"),
        ("health", "slow"),
        ("health", "trickle"),
        ("health", "dead"),
    ]


def test_a_vms_page_answers_as_its_gate_until_a_step_sets_it_for_that_vm() -> None:
    text = 'gates:\n  ready: {http: {url: "http://local-gates/ready/{vm}"}}\n'
    assert local_gate_names(text) == ["ready"]
    served = GateServer(local_gate_names(text))
    served.start()
    try:
        url = f"http://127.0.0.1:{served.port}"
        assert requests.get(f"{url}/ready/web_0", timeout=5).status_code == 200
        served.set("ready/web_1", "failing")
        assert requests.get(f"{url}/ready/web_1", timeout=5).status_code == 503
        assert requests.get(f"{url}/ready/web_0", timeout=5).status_code == 200
        served.set("ready", "failing")
        served.set("ready/web_1", "passing")
        assert requests.get(f"{url}/ready/web_0", timeout=5).status_code == 503
        assert requests.get(f"{url}/ready/web_1", timeout=5).status_code == 200
    finally:
        served.stop()
