"""Every resource, module and parameter file in infra/ against Azure's published resource types
(tests/infra/bicep_types.py, data in ../shared/azure-types), and the check itself catching each kind of mistake
injected into a copy of the real templates."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.infra import bicep_model as bm
from tests.infra import bicep_types as bt


@pytest.fixture(scope="module")
def library() -> bt.TypeLibrary:
    # One library for every test here: each types.json is read once.
    return bt.TypeLibrary(bt.TYPES_DIR)


@pytest.fixture(scope="module")
def report(library: bt.TypeLibrary, end_of_run_section: Callable[[str, str], None]) -> bt.Report:
    result = bt.Checker(library, bt.INFRA).run()
    end_of_run_section("Bicep against Azure's resource types (tests/infra/bicep_types.py)", result.summary())
    return result


@pytest.fixture
def infra(tmp_path: Path) -> Path:
    """A copy of infra/ to break."""
    target = tmp_path / "infra"
    shutil.copytree(bt.INFRA, target, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return target


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path.name}: {old!r} must occur exactly once"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _line(path: Path, needle: str) -> int:
    text = path.read_text(encoding="utf-8")
    assert text.count(needle) == 1, f"{path.name}: {needle!r} must occur exactly once"
    return text[: text.index(needle)].count("\n") + 1


def _check(library: bt.TypeLibrary, infra: Path) -> bt.Report:
    return bt.Checker(library, infra).run()


def _only(report: bt.Report, kind: str) -> list[bt.Finding]:
    return [finding for finding in report.findings if finding.kind == kind]


def _at(report: bt.Report, file: str, line: int) -> bt.Finding:
    found = [f for f in report.findings if (f.file, f.line) == (f"infra/{file}", line)]
    assert len(found) == 1, f"expected one finding at {file}:{line}, got:\n" + "\n".join(map(str, report.findings))
    return found[0]


# --- the real templates ---------------------------------------------------------------------------------------


def test_every_template_matches_the_published_types(report: bt.Report) -> None:
    assert report.findings == [], "\n" + "\n".join(map(str, report.findings))


def test_every_declaration_is_found_and_resolved(library: bt.TypeLibrary, report: bt.Report) -> None:
    # Counted independently of both parsers, so a declaration the reader misses cannot pass unnoticed.
    texts = [path.read_text(encoding="utf-8") for path in bm.bicep_files()]
    stats = report.stats
    assert stats.resources == sum(len(re.findall(r"^\s*resource \w+ '", t, re.MULTILINE)) for t in texts)
    assert stats.modules == sum(len(re.findall(r"^\s*module \w+ '", t, re.MULTILINE)) for t in texts)
    assert stats.existing == sum(t.count("' existing = ") for t in texts) > 0
    assert stats.in_loops == sum(
        len(re.findall(r"^\s*(?:resource|module) .* = \[for ", t, re.MULTILINE)) for t in texts
    )
    assert stats.with_parent == sum(len(re.findall(r"^\s+parent: ", t, re.MULTILINE)) for t in texts) > 0
    assert stats.resolved == stats.resources
    assert stats.bicep_files == len(texts)
    assert stats.bicepparam_files == 1
    # And the same resource symbols as pycep-parser sees.
    checker = bt.Checker(library, bt.INFRA)
    for path in bm.bicep_files():
        ours = {d.symbol for d in checker.bicep(path).resources}
        assert ours == set(bm.parse(path)["resources"]), path.name


def test_the_summary_counts_what_was_checked_and_skipped(report: bt.Report) -> None:
    stats = report.stats
    summary = report.summary()
    assert f"{stats.property_names} property names" in summary
    assert f"{stats.expressions} values known only at deployment" in summary
    assert f"{stats.required} required properties" in summary
    assert "findings: 0" in summary
    assert stats.property_names > 400
    assert stats.literal_values > 100
    assert stats.enum_values > 10
    assert stats.required > 100
    assert stats.expressions > 100
    assert stats.module_params > 50
    assert stats.bicepparam_params >= 10


def test_the_logic_app_definition_is_listed_as_unchecked(report: bt.Report) -> None:
    # The data types a workflow definition `any`: its contents are shown as not checked, never as checked.
    blocks = [b for b in report.stats.any_blocks if b.path == "properties.definition"]
    assert len(blocks) == 1
    assert blocks[0].file == "infra/modules/alerts.bicep"
    assert blocks[0].names > 50
    assert f"{blocks[0].file}:{blocks[0].line} teamsPoster" in report.summary()


def test_missing_types_data_is_a_clear_failure(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"\.\./shared/azure-types"):
        bt.TypeLibrary(tmp_path / "generated")
    # Beside the checkout (CI puts ../shared there), never an absolute path.
    assert bt.TYPES_DIR.relative_to(bt.ROOT.parent) == Path("shared/azure-types/generated")


# --- injected mistakes ----------------------------------------------------------------------------------------


def test_misspelt_property_names_are_found_at_any_depth(library: bt.TypeLibrary, infra: Path) -> None:
    storage, vmss, keyvault = (infra / "modules" / name for name in ("storage.bicep", "vmss.bicep", "keyvault.bicep"))
    _edit(storage, "allowBlobPublicAccess: false", "allowBlobPublicAcess: false")
    _edit(vmss, "id: subnetId", "idd: subnetId")
    _edit(keyvault, "bypass: 'AzureServices'", "bypas: 'AzureServices'")
    report = _check(library, infra)
    assert {f.kind for f in report.findings} == {"unknown-property"}
    top = _at(report, "modules/storage.bicep", _line(storage, "allowBlobPublicAcess"))
    assert top.path == "properties.allowBlobPublicAcess"
    assert "did you mean 'allowBlobPublicAccess'" in top.message
    deep = _at(report, "modules/vmss.bicep", _line(vmss, "idd: subnetId"))
    assert deep.path == (
        "properties.virtualMachineProfile.networkProfile.networkInterfaceConfigurations[0]"
        ".properties.ipConfigurations[0].properties.subnet.idd"
    )
    assert deep.subject == "vmss (Microsoft.Compute/virtualMachineScaleSets@2025-04-01)"
    assert _at(report, "modules/keyvault.bicep", _line(keyvault, "bypas:")).path == "properties.networkAcls.bypas"
    assert str(top).startswith(f"infra/modules/storage.bicep:{top.line}: account (Microsoft.Storage/storageAccounts")


def test_property_names_are_checked_even_where_the_value_is_an_expression(library: bt.TypeLibrary, infra: Path) -> None:
    functionapp, vmss = infra / "modules" / "functionapp.bicep", infra / "modules" / "vmss.bicep"
    _edit(functionapp, "maximumInstanceCount: maximumInstanceCount", "maximumInstances: maximumInstanceCount")
    # Inside a variable that reaches the resource through a ternary: reported where the name is written.
    _edit(vmss, "scheduledEventsApiVersion: '2020-07-01'", "scheduledEventsApiVer: '2020-07-01'")
    _edit(
        infra / "modules" / "storage.bicep",
        "defaultAction: 'Allow'",
        "defaultAction: 'Allow'\n      '${namePrefix}': 1",
    )
    report = _check(library, infra)
    assert len(report.findings) == 3, "\n".join(map(str, report.findings))
    expression = _at(report, "modules/functionapp.bicep", _line(functionapp, "maximumInstances:"))
    assert expression.path == "properties.functionAppConfig.scaleAndConcurrency.maximumInstances"
    through_variable = _at(report, "modules/vmss.bicep", _line(vmss, "scheduledEventsApiVer:"))
    assert through_variable.path == (
        "properties.scheduledEventsPolicy.scheduledEventsAdditionalPublishingTargets.eventGridAndResourceGraph"
        ".scheduledEventsApiVer"
    )
    computed = _at(report, "modules/storage.bicep", _line(infra / "modules" / "storage.bicep", "'${namePrefix}': 1"))
    assert computed.path == "properties.networkAcls[<computed>]"
    assert "has only fixed properties" in computed.message


def test_values_outside_closed_enums_are_found(library: bt.TypeLibrary, infra: Path) -> None:
    vmss, storage, keyvault = (infra / "modules" / name for name in ("vmss.bicep", "storage.bicep", "keyvault.bicep"))
    _edit(vmss, "caching: 'ReadWrite'", "caching: 'ReadWriteMany'")
    # A ternary: each branch is a possible value, so the bad one is found and the good one is not.
    _edit(
        storage,
        "name: 'app-package'\n  properties: {\n    publicAccess: 'None'",
        "name: 'app-package'\n  properties: {\n    publicAccess: empty(namePrefix) ? 'None' : 'Hidden'",
    )
    # A parameter's @allowed values are what it can be.
    _edit(
        keyvault,
        "var roles",
        "@allowed([\n  'standard'\n  'gold'\n])\nparam skuName string = 'standard'\n\nvar roles",
    )
    _edit(keyvault, "name: 'standard'", "name: skuName")
    report = _check(library, infra)
    assert {f.kind for f in report.findings} == {"enum"}
    caching = _at(report, "modules/vmss.bicep", _line(vmss, "'ReadWriteMany'"))
    assert caching.path == "properties.virtualMachineProfile.storageProfile.osDisk.caching"
    assert caching.message == "'ReadWriteMany' is not one of 'None', 'ReadOnly', 'ReadWrite'; did you mean 'ReadWrite'?"
    branch = _at(report, "modules/storage.bicep", _line(storage, "'Hidden'"))
    assert branch.message.startswith("'Hidden' is not one of")
    allowed = _at(report, "modules/keyvault.bicep", _line(keyvault, "name: skuName"))
    assert allowed.message == "'gold' (@allowed of param skuName) is not one of 'standard', 'premium'"


def test_literals_of_the_wrong_type_or_range_are_found(library: bt.TypeLibrary, infra: Path) -> None:
    eventhubs, storage = infra / "modules" / "eventhubs.bicep", infra / "modules" / "storage.bicep"
    _edit(eventhubs, "capacity: 1", "capacity: '1'")
    _edit(storage, "deleteRetentionPolicy: {\n      enabled: true", "deleteRetentionPolicy: {\n      enabled: 'yes'")
    _edit(
        storage,
        "containerDeleteRetentionPolicy: {\n      enabled: true\n      days: 7",
        "containerDeleteRetentionPolicy: {\n      enabled: true\n      days: 366",
    )
    report = _check(library, infra)
    capacity = _at(report, "modules/eventhubs.bicep", _line(eventhubs, "capacity:"))
    assert (capacity.kind, capacity.path, capacity.message) == (
        "type",
        "sku.capacity",
        "'1' is string, the type expects int",
    )
    assert (
        _at(report, "modules/storage.bicep", _line(storage, "'yes'")).path == "properties.deleteRetentionPolicy.enabled"
    )
    days = _at(report, "modules/storage.bicep", _line(storage, "days: 366"))
    assert (days.kind, days.message) == ("range", "366 is outside 1..365")


def test_values_known_only_at_deployment_are_skipped_and_counted(
    library: bt.TypeLibrary, infra: Path, report: bt.Report
) -> None:
    storage = infra / "modules" / "storage.bicep"
    # Were these literals they would be findings ('none' is not an allowed publicAccess); as expressions their
    # values are unknown until deployment, so they are counted as skipped instead.
    _edit(
        storage,
        "name: 'app-package'\n  properties: {\n    publicAccess: 'None'",
        "name: 'app-package'\n  properties: {\n    publicAccess: toLower('None')",
    )
    _edit(
        infra / "modules" / "packages.bicep",
        "name: 'forwarder'\n  properties: {\n    publicAccess: 'None'",
        "name: 'forwarder'\n  properties: {\n    publicAccess: '${namePrefix}none'",
    )
    changed = _check(library, infra)
    assert changed.findings == []
    assert changed.stats.expressions == report.stats.expressions + 2
    assert changed.stats.enum_values == report.stats.enum_values - 2
    # An expression whose kind is certain is still checked for that: a string is no int.
    _edit(infra / "modules" / "eventhubs.bicep", "capacity: 1", "capacity: toLower('1')")
    kind = _only(_check(library, infra), "type")
    assert [(f.path, f.message) for f in kind] == [("sku.capacity", "`toLower('1')` is string, the type expects int")]


def test_missing_required_properties_are_found(library: bt.TypeLibrary, infra: Path) -> None:
    eventhubs, keyvault = infra / "modules" / "eventhubs.bicep", infra / "modules" / "keyvault.bicep"
    # The VMs' Data Sender assignment: its `properties: {` line (the third after the resource line).
    sender_properties = _line(eventhubs, "resource vmSender ") + 3
    _edit(eventhubs, "    principalId: vmPrincipalId\n", "")
    _edit(keyvault, "      family: 'A'\n", "")
    _edit(keyvault, "  name: 'teams-workflow-url'\n", "")
    report = _check(library, infra)
    assert {f.kind for f in report.findings} == {"required"}
    principal = _at(report, "modules/eventhubs.bicep", sender_properties)
    assert (principal.path, principal.message) == (
        "properties.principalId",
        "required property 'principalId' is missing",
    )
    assert principal.subject == "vmSender (Microsoft.Authorization/roleAssignments@2022-04-01)"
    family = _at(report, "modules/keyvault.bicep", _line(keyvault, "    sku: {"))
    assert family.path == "properties.sku.family"
    name = _at(report, "modules/keyvault.bicep", _line(keyvault, "resource teamsSecret"))
    assert name.path == "name"


def test_read_only_properties_are_found(library: bt.TypeLibrary, infra: Path) -> None:
    storage, identities = infra / "modules" / "storage.bicep", infra / "modules" / "identities.bicep"
    _edit(
        storage,
        "    allowSharedKeyAccess: false\n",
        "    allowSharedKeyAccess: false\n    provisioningState: 'Succeeded'\n",
    )
    _edit(
        identities,
        "  name: '${namePrefix}-forwarder-id'\n",
        "  name: '${namePrefix}-forwarder-id'\n  id: 'fixed'\n",
    )
    report = _check(library, infra)
    assert {f.kind for f in report.findings} == {"read-only"}
    state = _at(report, "modules/storage.bicep", _line(storage, "provisioningState"))
    assert (state.path, state.message) == (
        "properties.provisioningState",
        "'provisioningState' is read-only: Azure sets it",
    )
    assert _at(report, "modules/identities.bicep", _line(identities, "id: 'fixed'")).path == "id"


def test_a_type_or_api_version_missing_from_the_data_is_a_clear_failure(library: bt.TypeLibrary, infra: Path) -> None:
    eventhubs, storage, relay = (
        infra / "modules" / name for name in ("eventhubs.bicep", "storage.bicep", "relay.bicep")
    )
    _edit(eventhubs, "'Microsoft.EventHub/namespaces@2024-01-01'", "'Microsoft.EventHub/namespaces@2021-11-01'")
    _edit(
        storage,
        "resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@",
        "resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containerz@",
    )
    _edit(relay, "'Microsoft.Relay/namespaces@2024-01-01'", "'Microsoft.Nope/namespaces@2024-01-01'")
    report = _check(library, infra)
    version = _at(report, "modules/eventhubs.bicep", _line(eventhubs, "resource namespace"))
    assert version.kind == "api-version-not-held"
    assert version.message.startswith(
        "api-version 2021-11-01 of Microsoft.EventHub is not held in ../shared/azure-types "
        "(held api-versions of Microsoft.EventHub: 2024-01-01)"
    )
    kind = _at(report, "modules/storage.bicep", _line(storage, "resource deploymentContainer"))
    assert kind.kind == "type-not-held"
    assert kind.message == (
        "resource type Microsoft.Storage/storageAccounts/blobServices/containerz is not in the data for api-version "
        "2023-05-01; did you mean Microsoft.Storage/storageAccounts/blobServices/containers?"
    )
    namespace = _at(report, "modules/relay.bicep", _line(relay, "resource namespace"))
    assert "no Microsoft.Nope types at all" in namespace.message
    assert report.stats.resolved == report.stats.resources - 3


def test_discriminated_objects_are_checked_against_the_chosen_element(library: bt.TypeLibrary, infra: Path) -> None:
    # Microsoft.Web/sites/config is one type per name: appsettings takes any setting, web takes SiteConfig.
    functionapp = infra / "modules" / "functionapp.bicep"
    _edit(functionapp, "name: 'appsettings'", "name: 'web'")
    report = _check(library, infra)
    settings = _at(report, "modules/functionapp.bicep", _line(functionapp, "AzureWebJobsStorage__credential"))
    assert settings.path == "properties.AzureWebJobsStorage__credential"
    assert settings.message == "'AzureWebJobsStorage__credential' is not a property of SiteConfig"
    _edit(functionapp, "name: 'web'", "name: 'appsetings'")
    report = _check(library, infra)
    name = _at(report, "modules/functionapp.bicep", _line(functionapp, "'appsetings'"))
    assert (name.kind, name.path) == ("enum", "name")
    assert name.message.endswith("did you mean 'appsettings'?")


def test_children_existing_references_loops_and_conditions_are_checked(library: bt.TypeLibrary, infra: Path) -> None:
    storage, alerts = infra / "modules" / "storage.bicep", infra / "modules" / "alerts.bicep"
    # parent: a container's parent must be a blob service.
    _edit(storage, "  parent: blobService\n  name: 'app-package'", "  parent: account\n  name: 'app-package'")
    # In a loop.
    _edit(storage, "  name: tableName\n}]", "  name: tableName\n  properties: {\n    signedIdentifierz: []\n  }\n}]")
    # Conditional, with nested children two levels deep (relative types).
    storage.write_text(
        storage.read_text(encoding="utf-8")
        + "\nresource archive 'Microsoft.Storage/storageAccounts@2023-05-01' = if (empty(namePrefix)) {\n"
        "  name: 'archive${uniqueString(resourceGroup().id)}'\n  location: location\n  kind: 'StorageV2'\n"
        "  sku: {\n    name: 'Standard_LRS'\n  }\n"
        "  resource archiveBlobs 'blobServices@2023-05-01' = {\n    name: 'default'\n"
        "    resource archiveBox 'containers@2023-05-01' = {\n      name: 'box'\n"
        "      properties: {\n        publicAcces: 'None'\n      }\n    }\n  }\n}\n",
        encoding="utf-8",
    )
    # existing: only name, parent and scope.
    _edit(alerts, "existing = {\n  name: keyVaultName\n", "existing = {\n  name: keyVaultName\n  location: location\n")
    report = _check(library, infra)
    parent = _at(report, "modules/storage.bicep", _line(storage, "resource deploymentContainer"))
    assert parent.kind == "parent"
    assert parent.message == (
        "its parent is a Microsoft.Storage/storageAccounts, but a Microsoft.Storage/storageAccounts/blobServices/"
        "containers is a child of Microsoft.Storage/storageAccounts/blobServices"
    )
    looped = _at(report, "modules/storage.bicep", _line(storage, "signedIdentifierz"))
    assert (looped.kind, looped.path) == ("unknown-property", "properties.signedIdentifierz")
    assert looped.subject.startswith("stateTables (Microsoft.Storage/storageAccounts/tableServices/tables@")
    nested = _at(report, "modules/storage.bicep", _line(storage, "publicAcces:"))
    assert nested.subject == "archiveBox (Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01)"
    assert nested.path == "properties.publicAcces"
    existing = _at(report, "modules/alerts.bicep", _line(alerts, "  location: location\n}"))
    assert (existing.kind, existing.path) == ("existing", "location")
    assert len(report.findings) == 4
    # The archive box above, and the paths behind parameters (remote acknowledge: 2, Event Grid: 3, automatic
    # repairs suspension: 2).
    assert (report.stats.conditional, report.stats.nested) == (8, 2)


def test_module_parameters_are_checked(library: bt.TypeLibrary, infra: Path) -> None:
    main = infra / "main.bicep"
    _edit(
        main,
        "    workspaceId: monitoring.outputs.workspaceId\n  }\n}\n\n// What",
        "    workspaceID: monitoring.outputs.workspaceId\n  }\n}\n\n// What",
    )
    _edit(
        main,
        "terminateNotBeforeTimeout: terminateNotBeforeTimeout\n    enable",
        "terminateNotBeforeTimeout: 'PT20M'\n    enable",
    )
    _edit(main, "instanceCount: instanceCount", "instanceCount: '2'")
    # main allows a value the module does not: found through main's @allowed.
    _edit(main, "  'Flexible'\n])\nparam orchestrationMode", "  'Flexible'\n  'Flex'\n])\nparam orchestrationMode")
    report = _check(library, infra)
    unknown = _at(report, "main.bicep", _line(main, "workspaceID:"))
    assert (unknown.kind, unknown.message) == (
        "module-param",
        "infra/modules/workbook.bicep has no parameter 'workspaceID'; did you mean 'workspaceId'?",
    )
    assert unknown.subject == "module workbook ('modules/workbook.bicep')"
    missing = _only(report, "module-required")
    assert [(f.path, f.line) for f in missing] == [("params.workspaceId", _line(main, "module workbook") + 2)]
    assert _at(report, "main.bicep", _line(main, "'PT20M'")).kind == "allowed"
    assert (
        _at(report, "main.bicep", _line(main, "instanceCount: '2'")).message
        == "string given, parameter 'instanceCount' is int"
    )
    flex = _at(report, "main.bicep", _line(main, "orchestrationMode: orchestrationMode"))
    assert flex.message == (
        "'Flex' (@allowed of param orchestrationMode) is not in @allowed of 'orchestrationMode': 'Uniform', 'Flexible'"
    )


def test_the_bicepparam_file_names_existing_parameters(library: bt.TypeLibrary, infra: Path) -> None:
    params = infra / "main.bicepparam"
    _edit(params, "param vmSize = ", "param vmSizes = ")
    _edit(params, "param adminUsername = 'fleetadmin'\n", "")
    _edit(params, "param orchestrationMode = 'Flexible'", "param orchestrationMode = 'Flex'")
    report = _check(library, infra)
    assert {(f.kind, f.path) for f in report.findings} == {
        ("bicepparam-param", "params.vmSizes"),
        ("bicepparam-required", "params.adminUsername"),
        ("allowed", "params.orchestrationMode"),
    }
    assert _at(report, "main.bicepparam", _line(params, "vmSizes")).message.endswith("did you mean 'vmSize'?")
    assert _only(report, "bicepparam-required")[0].line == _line(params, "using './main.bicep'")


def test_untyped_blocks_are_not_checked_but_counted(library: bt.TypeLibrary, infra: Path, report: bt.Report) -> None:
    # The honest limit: a misspelling inside a Logic App definition is invisible to the types data.
    _edit(infra / "modules" / "alerts.bicep", "contentVersion: '1.0.0.0'", "contentVersionn: '1.0.0.0'\n      extra: 1")
    changed = _check(library, infra)
    assert changed.findings == []
    before = next(b.names for b in report.stats.any_blocks if b.path == "properties.definition")
    after = next(b.names for b in changed.stats.any_blocks if b.path == "properties.definition")
    assert after == before + 1


def test_a_syntax_error_is_a_finding(library: bt.TypeLibrary, infra: Path) -> None:
    workbook = infra / "modules" / "workbook.bicep"
    _edit(workbook, "  kind: 'shared'\n", "  kind: 'shared\n")
    assert "syntax" in {f.kind for f in _check(library, infra).findings}


def test_misspelt_property_reads_and_module_outputs_are_found(library: bt.TypeLibrary, infra: Path) -> None:
    # What outputs and app settings read from resources fails only at deployment when misspelt.
    functionapp, storage, main = (
        infra / "modules" / "functionapp.bicep",
        infra / "modules" / "storage.bicep",
        infra / "main.bicep",
    )
    _edit(
        functionapp,
        "output functionAppHostName string = site.properties.defaultHostName",
        "output functionAppHostName string = site.properties.defaultHostname",
    )
    _edit(
        storage,
        "'${account.properties.primaryEndpoints.blob}${deploymentContainer.name}'",
        "'${account.properties.primaryEndpoint.blob}${deploymentContainer.name}'",
    )
    _edit(main, "vmIdentityId: identities.outputs.vmIdentityId", "vmIdentityId: identities.outputs.vmIdentityID")
    report = _check(library, infra)
    host = _at(report, "modules/functionapp.bicep", _line(functionapp, "defaultHostname"))
    assert (host.kind, host.path) == ("unknown-read", "properties.defaultHostname")
    assert (
        host.message
        == "reads 'defaultHostname', which is not a property of SiteProperties; did you mean 'defaultHostName'?"
    )
    interpolated = _at(report, "modules/storage.bicep", _line(storage, "primaryEndpoint.blob"))
    assert interpolated.path == "properties.primaryEndpoint"
    output = _at(report, "main.bicep", _line(main, "identities.outputs.vmIdentityID"))
    assert (output.kind, output.path) == ("unknown-output", "outputs.vmIdentityID")
    assert output.message.endswith("did you mean 'vmIdentityId'?")
    assert len(report.findings) == 3
