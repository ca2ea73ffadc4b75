"""The one-command deployment (scripts/deploy.sh, or `azd up` through azure.yaml) and the security properties of
the templates that go with it: people sign in with Entra ID (authsettingsV2) through an app registration without
a client secret, the forwarder package is out of the coordinator's reach and checked by its SHA-256 before a VM
installs it as root, Relay's SAS rule is removed by the deployment itself. What can be checked without Azure: the
structure, that every named step exists and is executable, that parameters, environment and outputs line up."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.http import APPROVE_ROLE, READ_ROLE
from tests.infra import bicep_model as bm

MODULES = bm.INFRA / "modules"
SCRIPTS = bm.ROOT / "scripts"
DEPLOY = SCRIPTS / "deploy.sh"


def _resources(module: str) -> dict[str, Any]:
    resources: dict[str, Any] = bm.parse(MODULES / module)["resources"]
    return resources


def _body(module: str, symbol: str) -> dict[str, Any]:
    return bm.resource_body(_resources(module)[symbol])


# --- people sign in with Entra ID -------------------------------------------------------------------------------


def test_every_request_to_the_functions_app_needs_an_entra_sign_in() -> None:
    auth = _body("functionapp.bicep", "authSettings")
    assert _resources("functionapp.bicep")["authSettings"]["type"] == "Microsoft.Web/sites/config"
    assert auth["parent"] == "site"
    assert auth["name"] == "authsettingsV2"
    properties = auth["properties"]
    assert properties["platform"]["enabled"] is True
    validation = properties["globalValidation"]
    assert validation["requireAuthentication"] is True
    # The Teams card link opens in a browser: send it to the sign-in page (never AllowAnonymous).
    assert validation["unauthenticatedClientAction"] == "RedirectToLoginPage"
    assert "excludedPaths" not in validation
    aad = properties["identityProviders"]["azureActiveDirectory"]
    assert aad["enabled"] is True
    assert aad["registration"]["clientId"] == "signInClientId"
    assert properties["login"]["tokenStore"]["enabled"] is False
    assert properties["httpSettings"]["requireHttps"] is True


def test_sign_in_uses_a_managed_identity_instead_of_a_client_secret() -> None:
    registration = _body("functionapp.bicep", "authSettings")["properties"]["identityProviders"][
        "azureActiveDirectory"
    ]["registration"]
    setting = registration["clientSecretSettingName"]
    # The documented name that makes App Service use a federated credential of a user-assigned identity.
    assert setting == "OVERRIDE_USE_MI_FIC_ASSERTION_CLIENTID"
    settings = bm.resource_body(_resources("functionapp.bicep")["appSettings"])["properties"]
    assert settings[setting] == "signInIdentityClientId"
    assert settings["WEBSITE_AUTH_AAD_ALLOWED_TENANTS"] == "signInTenantId"
    assert "MICROSOFT_PROVIDER_AUTHENTICATION_SECRET" not in settings
    site = _body("functionapp.bicep", "site")
    assert set(site["identity"]["userAssignedIdentities"]) == {"'${identityId}'", "'${signInIdentityId}'"}
    # The sign-in identity holds no role anywhere: EXPECTED_ASSIGNMENTS in test_bicep.py is exact, and it is not in it.
    main = bm.modules_of_main()["functionApp"][1]
    assert bm.accessor_chain(main["signInIdentityClientId"]) == ["identities", "outputs", "signInIdentityClientId"]
    assert main["signInClientId"] == "signInClientId"
    # The app-role names the code requires are the ones the registration script creates.
    script = (SCRIPTS / "entra-app.sh").read_text(encoding="utf-8")
    prefix = re.search(r'^ROLE_PREFIX="([^"]+)"', script, re.MULTILINE)
    assert prefix
    assert {f"{prefix.group(1)}.Approve", f"{prefix.group(1)}.Read"} == {APPROVE_ROLE, READ_ROLE}
    assert "appRoleAssignmentRequired=true" in script


# --- the forwarder package -------------------------------------------------------------------------------------


def test_the_forwarder_package_is_in_its_own_account_the_coordinator_cannot_touch() -> None:
    packages = bm.parse(MODULES / "packages.bicep")
    assert not {name for name in packages["parameters"] if "coordinator" in name.lower()}
    assignments = [r for r in packages["resources"].values() if r["type"] == "Microsoft.Authorization/roleAssignments"]
    assert len(assignments) == 1
    reader = bm.resource_body(assignments[0])["properties"]
    assert reader["principalId"] == "vmPrincipalId"
    assert bm.accessor_chain(reader["roleDefinitionId"]["function"]["parameters"]["resource_name_1"]) == [
        "roles",
        "storageBlobDataReader",
        "id",
    ]
    assert bm.accessor_chain(bm.modules_of_main()["packages"][1]["vmPrincipalId"]) == [
        "identities",
        "outputs",
        "vmIdentityPrincipalId",
    ]
    # The coordinator's account no longer holds a container the VMs read from.
    storage = (MODULES / "storage.bicep").read_text(encoding="utf-8")
    assert "vmPrincipalId" not in storage
    assert "packages.outputs.forwarderContainerUrl" in (bm.MAIN).read_text(encoding="utf-8")
    account = _body("packages.bicep", "account")["properties"]
    assert account["allowSharedKeyAccess"] is False
    assert account["allowBlobPublicAccess"] is False
    assert _body("packages.bicep", "blobService")["properties"]["isVersioningEnabled"] is True


def _digest_check_script(tmp_path: Path, digest: str) -> tuple[Path, str]:
    template = (bm.INFRA / "cloud-init" / "forwarder.yaml").read_text(encoding="utf-8")
    document = yaml.safe_load(template)
    files = {item["path"]: item["content"] for item in document["write_files"]}
    script = files["/usr/local/sbin/se-forwarder-bootstrap"]
    check = re.search(r"^\s*if ! echo .*?^\s*fi$", script, re.MULTILINE | re.DOTALL)
    assert check, "the bootstrap no longer checks the package digest before installing"
    assert script.index(check.group(0)) < script.index("tar -xzf"), "the digest is checked before anything runs"
    work = tmp_path / "work"
    work.mkdir()
    return work, f'work="{work}"; url=test\n' + check.group(0).replace("__PACKAGE_SHA256__", digest)


@pytest.mark.parametrize("tampered", [False, True])
def test_a_vm_installs_only_the_package_with_the_deployments_digest(tmp_path: Path, tampered: bool) -> None:
    package = b"forwarder package bytes"
    work, snippet = _digest_check_script(tmp_path, hashlib.sha256(package).hexdigest())
    (work / "forwarder.tar.gz").write_bytes(package + (b" plus a backdoor" if tampered else b""))
    result = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, check=False)
    assert (result.returncode != 0) is tampered, result.stderr
    if tampered:
        assert "not installing" in result.stderr
    vmss = bm.parse(MODULES / "vmss.bicep")
    assert bm.decorator(vmss["parameters"]["forwarderPackageSha256"], "min_length") == 64
    assert "'__PACKAGE_SHA256__'" in (MODULES / "vmss.bicep").read_text(encoding="utf-8")


def test_the_forwarder_package_is_reproducible_and_holds_the_installer(tmp_path: Path) -> None:
    # A second clone: the same sources elsewhere, every file written at another time.
    clone = tmp_path / "clone"
    for part in ("forwarder", "contracts", "scripts"):
        shutil.copytree(bm.ROOT / part, clone / part, ignore=shutil.ignore_patterns("__pycache__", "wheels"))
    (clone / ".venv").symlink_to(bm.ROOT / ".venv")
    for copied in clone.rglob("*"):
        os.utime(copied, (1_700_000_000, 1_700_000_000), follow_symlinks=False)
    digests = []
    for name, root in (("a", bm.ROOT), ("b", clone)):
        result = subprocess.run(
            ["bash", str(root / "scripts" / "package-forwarder.sh"), str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        )
        digest, path = result.stdout.split()
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest
        digests.append(digest)
    assert digests[0] == digests[1], "the same sources must give the same digest"
    with tarfile.open(tmp_path / "a" / "forwarder.tar.gz") as archive:
        names = archive.getnames()
    assert "forwarder/install.sh" in names
    assert not [n for n in names if "__pycache__" in n]
    # Its dependencies for the VM image (Ubuntu 24.04: CPython 3.12, x86_64), installed without an index.
    wheels = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("forwarder/wheels/") and n.endswith(".whl"))
    dependencies = ["h11", "pyyaml", "wsproto"]
    assert [w.split("-")[0].lower() for w in wheels] == dependencies
    assert "-cp312-cp312-manylinux" in wheels[1]  # PyYAML's, the one built for the platform
    assert wheels[1].endswith("_x86_64.whl")


# --- one command -----------------------------------------------------------------------------------------------


def test_azure_yaml_provisions_main_bicep_and_its_hooks_call_the_deploy_script() -> None:
    config = yaml.safe_load((bm.ROOT / "azure.yaml").read_text(encoding="utf-8"))
    assert config["infra"]["provider"] == "bicep"
    assert (bm.ROOT / config["infra"]["path"] / f"{config['infra']['module']}.bicep") == bm.MAIN
    assert (bm.INFRA / f"{config['infra']['module']}.bicepparam").is_file()
    hooks = config["hooks"]
    assert set(hooks) == {"preprovision", "postprovision"}
    assert hooks["preprovision"]["run"] == "bash scripts/deploy.sh prepare"
    assert hooks["postprovision"]["run"] == "bash scripts/deploy.sh finish"
    for hook in hooks.values():
        assert hook["continueOnError"] is False  # a failed security step stops the deployment
    deploy = DEPLOY.read_text(encoding="utf-8")
    for mode in ("prepare)", "finish)"):
        assert f"  {mode}" in deploy


def _named_scripts(text: str) -> set[str]:
    return set(re.findall(r"scripts/[\w.-]+\.sh", text))


def test_every_script_the_docs_and_the_deployment_name_exists_and_is_valid_bash() -> None:
    named: set[str] = set()
    for path in (bm.ROOT / "README.md", bm.ROOT / "docs" / "deploy.md", bm.ROOT / "docs" / "security.md", DEPLOY):
        named |= _named_scripts(path.read_text(encoding="utf-8"))
    named |= _named_scripts((bm.ROOT / "azure.yaml").read_text(encoding="utf-8"))
    assert {"scripts/deploy.sh", "scripts/entra-app.sh", "scripts/package-forwarder.sh"} <= named
    for name in sorted(named):
        path = bm.ROOT / name
        assert path.is_file(), f"{name} is named but does not exist"
        assert os.access(path, os.X_OK), f"{name} is not executable"
        checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert checked.returncode == 0, f"{name}: {checked.stderr}"


def test_the_parameters_the_environment_and_the_outputs_line_up() -> None:
    main = bm.parse(bm.MAIN)
    param_file = (bm.INFRA / "main.bicepparam").read_text(encoding="utf-8")
    variables = set(re.findall(r"readEnvironmentVariable\('(\w+)'", param_file))
    deploy = DEPLOY.read_text(encoding="utf-8")
    for name in variables:
        # Either deploy.sh sets it, or it insists on it before anything is deployed, or it has a default.
        provided = re.search(rf"(export [^\n]*\b{name}\b|\b{name}=|\${{{name}:-}}\" \] \|\| die)", deploy)
        defaulted = re.search(rf"readEnvironmentVariable\('{name}', '[^']*'\)", param_file)
        assert provided or defaulted, f"main.bicepparam reads {name}, which deploy.sh neither sets nor requires"
    assert {"SE_SIGNIN_CLIENT_ID", "SE_FORWARDER_PACKAGE_SHA256", "SE_TEAMS_WORKFLOW_URL"} <= variables
    # Inline overrides name real parameters; outputs read by the script are declared by main.bicep.
    for name in re.findall(r"-p (\w+)=", deploy):
        assert name in main["parameters"], f"deploy.sh sets unknown parameter {name}"
    read = set(re.findall(r"out (\w+)\)", deploy)) | set(re.findall(r"properties\.outputs\.(\w+)", deploy))
    assert read
    assert read <= set(main["outputs"]), f"deploy.sh reads outputs main.bicep lacks: {read - set(main['outputs'])}"
    assert bm.decorator(main["parameters"]["signInClientId"], "min_length") == 36
    assert "default" not in main["parameters"]["forwarderPackageSha256"] or (
        main["parameters"]["forwarderPackageSha256"]["default"] is None
    )


def test_the_deployment_leaves_relay_without_any_sas_rule() -> None:
    # Relay has no disableLocalAuth in its resource types, so the deployment removes the built-in rule itself and
    # refuses to finish while any rule is left.
    deploy = DEPLOY.read_text(encoding="utf-8")
    delete = deploy.index("authorization-rule delete")
    check = deploy.index("authorization-rule list")
    assert delete < check
    assert "RootManageSharedAccessKey" in deploy[: delete + 200]
    assert 'die "Relay namespace' in deploy[check:]
    namespace = _body("relay.bicep", "namespace")["properties"]
    assert "disableLocalAuth" not in namespace  # the property does not exist for Relay (2024-01-01 types)


def test_the_deployment_leaves_no_event_grid_grant_on_the_vms_hub() -> None:
    # Upgrading a deployment from before Event Grid had its own hub: the template no longer grants the system topic
    # Data Sender on the VMs' hub, and the deployment removes the grant an older template made there.
    deploy = DEPLOY.read_text(encoding="utf-8")
    step = deploy[deploy.index("Event Grid delivers to its own hub now") :]
    assert "Microsoft.ResourceNotifications.MaintenanceResources" in step
    assert (
        'az role assignment delete --assignee "$principal" --scope "$hub" --role "Azure Event Hubs Data Sender"' in step
    )
    assert step.index("out eventHubName") < step.index("role assignment delete")


FAKE_AZ = """#!/bin/sh
# Stands in for the Azure CLI (none here): answers the preflight's questions as the test's environment says.
case "$1 $2" in
  "version --query") echo "$FAKE_AZ_VERSION" ;;
  "bicep version") echo "$FAKE_AZ_BICEP" ;;
  "account show") [ "$FAKE_AZ_SIGNED_IN" = yes ] && echo 00000000-0000-0000-0000-000000000000 || exit 1 ;;
  *) echo "fake az: not expected: $*" >&2; exit 3 ;;
esac
"""


PREFLIGHT_CASES = {
    "no az": (
        None,
        "the Azure CLI (az) is not installed: https://learn.microsoft.com/cli/azure/install-azure-cli (>= 2.61.0)",
    ),
    "old az": (
        ("2.50.0", "Bicep CLI version 0.30.23 (ec3612124c)", "yes"),
        "Azure CLI 2.50.0 is older than 2.61.0: az upgrade",
    ),
    "no bicep": (
        ("2.67.0", 'Bicep CLI not found. Install it now by running "az bicep install".', "yes"),
        "Bicep is not installed for the Azure CLI: az bicep install",
    ),
    "signed out": (("2.67.0", "Bicep CLI version 0.30.23 (ec3612124c)", "no"), "not signed in to Azure: az login"),
}


@pytest.mark.parametrize("case", PREFLIGHT_CASES)
def test_deploy_checks_the_azure_cli_its_version_bicep_and_the_sign_in_first(tmp_path: Path, case: str) -> None:
    fake, says = PREFLIGHT_CASES[case]
    tools = tmp_path / "bin"
    tools.mkdir()
    # Only what the script uses before Azure: a machine's own az (if any) stays out of reach.
    for tool in ("dirname", "sort", "head"):
        found = shutil.which(tool)
        assert found is not None
        (tools / tool).symlink_to(found)
    environment = {"PATH": str(tools)}
    if fake is not None:
        (tools / "az").write_text(FAKE_AZ, encoding="utf-8")
        (tools / "az").chmod(0o755)
        environment |= dict(zip(("FAKE_AZ_VERSION", "FAKE_AZ_BICEP", "FAKE_AZ_SIGNED_IN"), fake, strict=True))
    done = subprocess.run(
        ["/bin/bash", str(DEPLOY), "rg-test", "westeurope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environment,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"deploy.sh: {says}"]


def test_the_minimum_azure_cli_is_the_one_the_readme_names() -> None:
    minimum = re.search(r"^AZ_MINIMUM=(\d+)\.(\d+)\.0", DEPLOY.read_text(), flags=re.MULTILINE)
    assert minimum is not None
    assert f"Azure CLI ≥ {minimum[1]}.{minimum[2]} with Bicep" in (bm.ROOT / "README.md").read_text()
