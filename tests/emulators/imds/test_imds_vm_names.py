"""VM names in the emulator's per-VM routes are case-insensitive, as Azure's VM names are: a client that lower-cases
the URL (Microsoft's JavaScript @azure/identity does) reaches the same VM; a scenario cannot hold two names that
differ only in case."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from emulators.imds import ImdsEmulator, Scenario, ScenarioError
from emulators.tokens import verify_token

ROOT = Path(__file__).resolve().parents[3]
NODE_MODULES = ROOT / "tools" / "node" / "node_modules"
NODE = shutil.which("node")
META = {"Metadata": "true"}


@pytest.fixture
def imds() -> Iterator[ImdsEmulator]:
    scenario = Scenario.from_mapping({"vms": [{"name": "WestNO_0"}, {"name": "WestNO_1"}]})
    with ImdsEmulator(scenario=scenario, throttle_rps=0) as emulator:
        yield emulator


@pytest.mark.parametrize("name", ["WestNO_1", "westno_1", "WESTNO_1"])
def test_a_vm_is_reached_whatever_the_case_of_its_name(imds: ImdsEmulator, name: str) -> None:
    answer = requests.get(
        f"{imds.url}/vm/{name}/metadata/instance/compute?api-version=2021-02-01", headers=META, timeout=5
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["name"] == "WestNO_1"
    unknown = requests.get(
        f"{imds.url}/vm/westno_9/metadata/scheduledevents?api-version=2020-07-01", headers=META, timeout=5
    )
    assert unknown.status_code == 404


def test_two_vm_names_differing_only_in_case_are_refused() -> None:
    with pytest.raises(ScenarioError, match=r"duplicate names \['WEB_0', 'web_0'\] \(VM names are case-insensitive\)"):
        Scenario.from_mapping({"vms": [{"name": "web_0"}, {"name": "WEB_0"}]})


def identity_client(base_url: str, *command: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("IDENTITY_", "MSI_", "AZURE_"))}
    return subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**environment, "NODE_PATH": str(NODE_MODULES), "AZURE_POD_IDENTITY_AUTHORITY_HOST": base_url},
    )


def test_microsofts_python_identity_client_gets_its_vms_token_through_a_lower_cased_url(imds: ImdsEmulator) -> None:
    script = (
        "import sys; from azure.identity import ManagedIdentityCredential; "
        "sys.stdout.write(ManagedIdentityCredential().get_token('https://relay.azure.net/.default').token)"
    )
    done = identity_client(imds.url_for("WestNO_1").lower(), sys.executable, "-c", script)
    assert done.returncode == 0, done.stderr
    claims = verify_token(done.stdout, audience="https://relay.azure.net")
    assert claims["xms_mirid"] == imds.state.vms["WestNO_1"].resourceId


@pytest.mark.skipif(
    NODE is None or not (NODE_MODULES / "@azure" / "identity").is_dir(),
    reason="node and tools/node/node_modules/@azure/identity are required (run scripts/bootstrap.sh)",
)
def test_microsofts_javascript_identity_client_reaches_the_first_vm_whatever_the_path(imds: ImdsEmulator) -> None:
    """@azure/identity (JavaScript) resolves /metadata/identity/oauth2/token against the authority host, which drops
    the /vm/{name} path: it always gets the scenario's first VM (docs/imds-emulator.md says so)."""
    script = """
const { ManagedIdentityCredential } = require("@azure/identity");
new ManagedIdentityCredential().getToken("https://relay.azure.net/.default")
  .then((t) => process.stdout.write(t.token), (e) => { console.error(e.message); process.exit(1); });
"""
    assert NODE is not None
    done = identity_client(imds.url_for("WestNO_1").lower(), NODE, "-e", script)
    assert done.returncode == 0, done.stderr
    claims = verify_token(done.stdout, audience="https://relay.azure.net")
    assert claims["xms_mirid"] == imds.state.vms["WestNO_0"].resourceId
