"""checkov over infra/ (offline, with the project's own checks in infra/checks): zero failures, zero parse errors,
every skip carries its reason, and the custom checks really run and really fail on bad Bicep.

checkov lives in its own virtual environment (.venv-iac: it pins many packages); both scans run once per session,
in parallel."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.infra.bicep_model import INFRA, ROOT

CHECKOV = ROOT / ".venv-iac" / "bin" / "checkov"
CUSTOM_CHECKS = INFRA / "checks"

# One resource per rule, each breaking it (the custom checks must fail every one of these).
BAD_BICEP = """
@allowed([
  'PT5M'
  'PT20M'
])
param badNotBeforeTimeout string = 'PT5M'

resource vmss 'Microsoft.Compute/virtualMachineScaleSets@2025-04-01' = {
  name: 'bad'
  location: 'westeurope'
  properties: {
    scheduledEventsPolicy: {
      userInitiatedRedeploy: {
        automaticallyApprove: true
      }
      userInitiatedReboot: {
        automaticallyApprove: false
      }
      allInstancesDown: {
        automaticallyApprove: false
      }
    }
    virtualMachineProfile: {
      scheduledEventsProfile: {
        terminateNotificationProfile: {
          enable: true
          notBeforeTimeout: 'PT30M'
        }
      }
    }
  }
}

resource ehns 'Microsoft.EventHub/namespaces@2024-01-01' = {
  name: 'bad-ehns'
  location: 'westeurope'
  properties: {
    disableLocalAuth: false
  }
}

resource relayRule 'Microsoft.Relay/namespaces/authorizationRules@2024-01-01' = {
  name: 'bad-relay/listen'
  properties: {
    rights: [
      'Listen'
    ]
  }
}

resource site 'Microsoft.Web/sites@2024-04-01' = {
  name: 'bad-site'
  location: 'westeurope'
  properties: {
    siteConfig: {
      appSettings: [
        {
          name: 'EventHubConnection'
          value: listKeys(ehns.id, '2024-01-01').primaryConnectionString
        }
      ]
    }
  }
}

resource badAuth 'Microsoft.Web/sites/config@2024-04-01' = {
  parent: site
  name: 'authsettingsV2'
  properties: {
    platform: {
      enabled: true
    }
    globalValidation: {
      requireAuthentication: false
      unauthenticatedClientAction: 'AllowAnonymous'
    }
  }
}

resource settings 'Microsoft.Web/sites/config@2024-04-01' = {
  parent: site
  name: 'appsettings'
  properties: {
    STORAGE: 'DefaultEndpointsProtocol=https;AccountName=bad;AccountKey=bm90LWEta2V5;EndpointSuffix=core.windows.net'
  }
}
"""
EXPECTED_BAD = {
    ("CKV_SE_1", "Microsoft.Compute/virtualMachineScaleSets.vmss"),
    ("CKV_SE_2", "string.badNotBeforeTimeout"),
    ("CKV_SE_3", "Microsoft.Compute/virtualMachineScaleSets.vmss"),
    ("CKV_SE_4", "Microsoft.EventHub/namespaces.ehns"),
    ("CKV_SE_5", "Microsoft.Relay/namespaces/authorizationRules.relayRule"),
    ("CKV_SE_6", "Microsoft.Web/sites.site"),
    ("CKV_SE_6", "Microsoft.Web/sites/config.settings"),
    ("CKV_SE_7", "Microsoft.Web/sites/config.badAuth"),
}


def _start(directory: Path) -> subprocess.Popen[str]:
    command = [
        str(CHECKOV),
        "-d",
        str(directory),
        "--framework",
        "bicep",
        "--skip-download",
        "-o",
        "json",
        "--external-checks-dir",
        str(CUSTOM_CHECKS),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _report(process: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = process.communicate(timeout=240)
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON report (exit {process.returncode}): {stderr[-2000:]}")
    # One framework gives an object; several would give a list.
    return report[0] if isinstance(report, list) else report  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def checkov_reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run scripts/bootstrap.sh to create .venv-iac (checkov)")
    bad = tmp_path_factory.mktemp("bad-bicep")
    (bad / "bad.bicep").write_text(BAD_BICEP, encoding="utf-8")
    processes = (_start(INFRA), _start(bad))
    return _report(processes[0]), _report(processes[1])


def _ids(report: dict[str, Any], kind: str) -> set[tuple[str, str]]:
    return {(check["check_id"], check["resource"]) for check in report["results"][kind]}


def test_infra_scan_has_no_failures_and_no_parse_errors(checkov_reports: tuple[dict[str, Any], dict[str, Any]]) -> None:
    report, _ = checkov_reports
    summary = report["summary"]
    assert summary["parsing_errors"] == 0, "checkov could not parse some .bicep (it still exits 0 on that)"
    assert summary["resource_count"] > 50
    failed = sorted(_ids(report, "failed_checks"))
    assert failed == [], f"checkov failures: {failed}"


def test_every_skip_names_its_reason(checkov_reports: tuple[dict[str, Any], dict[str, Any]]) -> None:
    report, _ = checkov_reports
    skipped = report["results"]["skipped_checks"]
    assert skipped, "expected the documented skips"
    for check in skipped:
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason.strip()) > 20, f"{check['check_id']} on {check['resource']}: skip without a real reason"


def test_project_checks_run_on_infra(checkov_reports: tuple[dict[str, Any], dict[str, Any]]) -> None:
    report, _ = checkov_reports
    passed = _ids(report, "passed_checks")
    assert {
        ("CKV_SE_1", "Microsoft.Compute/virtualMachineScaleSets.vmss"),
        ("CKV_SE_2", "string.terminateNotBeforeTimeout"),
        ("CKV_SE_3", "Microsoft.Compute/virtualMachineScaleSets.vmss"),
        ("CKV_SE_4", "Microsoft.EventHub/namespaces.namespace"),
        ("CKV_SE_4", "Microsoft.Storage/storageAccounts.account"),
        ("CKV_SE_4", "Microsoft.Insights/components.appInsights"),
        ("CKV_SE_6", "Microsoft.Web/sites.site"),
        ("CKV_SE_6", "Microsoft.Web/sites/config.appSettings"),
        ("CKV_SE_7", "Microsoft.Web/sites/config.authSettings"),
    } <= passed
    # CKV_SE_5 passes by absence: no SAS rule resource exists, so it never appears.
    assert not {check for check in passed if check[0] == "CKV_SE_5"}


def test_project_checks_fail_bad_bicep(checkov_reports: tuple[dict[str, Any], dict[str, Any]]) -> None:
    _, bad = checkov_reports
    assert bad["summary"]["parsing_errors"] == 0
    failed = {check for check in _ids(bad, "failed_checks") if check[0].startswith("CKV_SE_")}
    assert failed == EXPECTED_BAD
