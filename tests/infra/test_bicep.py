"""Static checks of the Bicep in infra/ (the Bicep compiler cannot be installed here): every file parses with
pycep-parser and tree-sitter-bicep, module wiring is consistent, and the project's rules hold in the parsed model:
terminate notifications and their bounds, scheduled-events policy, identities, least-privilege role assignments,
local auth off, no secrets in outputs, the history table loaded from coordinator/history_columns.json."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tree_sitter
import tree_sitter_bicep
import yaml
from lark.exceptions import LarkError

from tests.infra import bicep_model as bm

MODULES = bm.INFRA / "modules"
ALLOWED_TIMEOUTS = [f"PT{minutes}M" for minutes in range(5, 16)]

# The built-in roles the deployment may assign, by id, as documented in learn.microsoft.com's built-in roles list
# (and /work/shared/reference/azure-platform.md). Any other id fails the test.
DOCUMENTED_BUILT_IN_ROLES = {
    "2b629674-e913-4c01-ae53-ef4638d8f975": "Azure Event Hubs Data Sender",
    "a638d3c7-ab3a-418d-83e6-5f17a39d4fde": "Azure Event Hubs Data Receiver",
    "26e0b698-aa6d-4085-9386-aadae190014d": "Azure Relay Listener",
    "26baccc8-eea7-41f1-98f4-1762cc7f685d": "Azure Relay Sender",
    "b7e6dc6d-f1e8-4753-8033-0f276bb0955b": "Storage Blob Data Owner",
    "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1": "Storage Blob Data Reader",
    "0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3": "Storage Table Data Contributor",
    "974c5e8b-45b9-4653-ba55-5f855dd0fb88": "Storage Queue Data Contributor",
    "3913510d-42f4-4e42-8a64-420c390055eb": "Monitoring Metrics Publisher",
    "4633458b-17de-408f-b874-0445c86b69e6": "Key Vault Secrets User",
}
CUSTOM_RELAY_ROLE = "custom:hybridConnectionManager"

# Who gets what, where: (principal, role, scope resource type). Exactly these, nothing more.
VM = "vmIdentityPrincipalId"
COORDINATOR = "coordinatorIdentityPrincipalId"
LOGIC_APP = "teamsPoster.identity"
EVENT_GRID_TOPIC = "maintenanceTopic.identity"
RESOURCE_GROUP = "(the module's resource group)"
EXPECTED_ASSIGNMENTS = {
    (VM, "Azure Event Hubs Data Sender", "Microsoft.EventHub/namespaces/eventhubs"),
    (VM, "Azure Relay Listener", "Microsoft.Relay/namespaces"),
    (VM, "Storage Blob Data Reader", "Microsoft.Storage/storageAccounts/blobServices/containers"),
    (COORDINATOR, "Azure Event Hubs Data Receiver", "Microsoft.EventHub/namespaces/eventhubs"),
    (COORDINATOR, "Azure Relay Sender", "Microsoft.Relay/namespaces"),
    (COORDINATOR, CUSTOM_RELAY_ROLE, "Microsoft.Relay/namespaces"),
    (COORDINATOR, "Storage Blob Data Owner", "Microsoft.Storage/storageAccounts"),
    (COORDINATOR, "Storage Table Data Contributor", "Microsoft.Storage/storageAccounts/tableServices/tables"),
    (COORDINATOR, "Storage Queue Data Contributor", "Microsoft.Storage/storageAccounts/queueServices/queues"),
    (COORDINATOR, "Monitoring Metrics Publisher", "Microsoft.Insights/dataCollectionRules"),
    (COORDINATOR, "Monitoring Metrics Publisher", "Microsoft.Insights/components"),
    (COORDINATOR, "Key Vault Secrets User", "Microsoft.KeyVault/vaults/secrets"),
    # The census: reads of the resource group's scale sets and VMs (a scope-less assignment is the resource group's).
    (COORDINATOR, "custom:vmCensusReader", RESOURCE_GROUP),
    # Automatic repairs suspended while an approved disruptive event runs (suspendAutomaticRepairs, default on):
    # where the census reads, the group's scale sets.
    (COORDINATOR, "custom:repairsOperator", RESOURCE_GROUP),
    (LOGIC_APP, "Key Vault Secrets User", "Microsoft.KeyVault/vaults/secrets"),
    # Preview paths, each deployed only when its parameter asks for it.
    (COORDINATOR, "custom:scheduledEventAcknowledger", "Microsoft.Compute/virtualMachineScaleSets"),
    (EVENT_GRID_TOPIC, "Azure Event Hubs Data Sender", "Microsoft.EventHub/namespaces/eventhubs"),
}
# Like the Bicep linter's outputs-should-not-contain-secrets (password/secret anywhere), plus key-ish endings.
_SECRETISH = re.compile(r"password|secret|(key|connectionstring|sas|token)s?$", re.IGNORECASE)


@pytest.fixture(scope="module")
def ts_parser() -> tree_sitter.Parser:
    return tree_sitter.Parser(tree_sitter.Language(tree_sitter_bicep.language()))


def _ts_errors(parser: tree_sitter.Parser, source: bytes) -> list[tuple[int, int]]:
    errors = []
    stack = [parser.parse(source).root_node]
    while stack:
        node = stack.pop()
        if node.type == "ERROR" or node.is_missing:
            errors.append((node.start_point[0] + 1, node.start_point[1] + 1))
        stack.extend(node.children)
    return errors


def _vmss() -> dict[str, Any]:
    return bm.resource_body(bm.parse(MODULES / "vmss.bicep")["resources"]["vmss"])


# --- parsing ---------------------------------------------------------------------------------------------------


def test_there_is_bicep_to_check() -> None:
    names = {path.relative_to(bm.INFRA).as_posix() for path in bm.bicep_files()}
    assert {"main.bicep", "modules/vmss.bicep", "modules/functionapp.bicep", "modules/relay.bicep"} <= names


@pytest.mark.parametrize("path", bm.bicep_files(), ids=lambda p: p.relative_to(bm.INFRA).as_posix())
def test_every_bicep_file_parses_with_pycep_and_tree_sitter(path: Path, ts_parser: tree_sitter.Parser) -> None:
    model = bm.parse(path)
    assert model["resources"] or model["modules"], f"{path}: parsed to nothing"
    assert _ts_errors(ts_parser, path.read_bytes()) == [], f"{path}: tree-sitter-bicep syntax errors (line, column)"


def test_the_parsers_reject_broken_bicep(ts_parser: tree_sitter.Parser) -> None:
    broken = (MODULES / "eventhubs.bicep").read_text(encoding="utf-8").replace("properties: {", "properties: {{", 1)
    with pytest.raises(LarkError):
        bm._parser().parse(text=broken)
    assert _ts_errors(ts_parser, broken.encode())


def test_files_loaded_by_bicep_exist() -> None:
    loaded = 0
    for path in bm.bicep_files():
        for node in bm.walk(bm.parse(path)):
            target = bm.load_path(node)
            if target:
                loaded += 1
                assert (path.parent / target).is_file(), f"{path}: loads {target}, which does not exist"
    assert loaded >= 6  # roles.json per module, history columns, cloud-init, workbook, the alert query


# --- module wiring (what `bicep build` would catch) ----------------------------------------------------------


def test_main_passes_every_required_param_and_only_declared_ones() -> None:
    for symbol, (path, passed) in bm.modules_of_main().items():
        declared = bm.parse(path)["parameters"]
        assert set(passed) <= set(declared), f"module {symbol}: unknown params {set(passed) - set(declared)}"
        required = {name for name, p in declared.items() if p.get("default") is None}
        assert required <= set(passed), f"module {symbol}: missing params {required - set(passed)}"


def test_main_reads_only_outputs_the_modules_declare() -> None:
    modules = bm.modules_of_main()
    used = [ref for ref in bm.references(bm.parse(bm.MAIN)) if ref[0] in modules and len(ref) >= 3]
    assert used
    for symbol, _, output, *_ in used:
        outputs = bm.parse(modules[symbol][0])["outputs"]
        assert output in outputs, f"main.bicep reads {symbol}.outputs.{output}, which modules does not declare"


def test_every_param_and_var_is_used() -> None:
    # The Bicep linter's no-unused-params/no-unused-vars (bicepconfig.json) cannot run here; this is their stand-in.
    for path in bm.bicep_files():
        model = bm.parse(path)
        text = path.read_text(encoding="utf-8")
        for kind in ("parameters", "variables"):
            for name in model[kind]:
                uses = len(re.findall(rf"(?<![\w.']){re.escape(name)}(?![\w'])", text))
                assert uses >= 2, f"{path.name}: {kind[:-1]} {name} is declared but never used"


def test_bicepparam_sets_existing_params_and_all_required_ones() -> None:
    text = (bm.INFRA / "main.bicepparam").read_text(encoding="utf-8")
    assert re.search(r"^using '\./main\.bicep'$", text, re.MULTILINE)
    values = dict(re.findall(r"^param (\w+) = (.+)$", text, re.MULTILINE))
    declared = bm.parse(bm.MAIN)["parameters"]
    assert set(values) <= set(declared), f"main.bicepparam sets unknown params {set(values) - set(declared)}"
    required = {name for name, p in declared.items() if p.get("default") is None}
    assert required <= set(values), f"main.bicepparam misses required params {required - set(values)}"
    for name, raw in values.items():
        allowed = bm.decorator(declared[name], "allowed")
        if allowed and raw.startswith("'"):
            assert raw.strip("'") in allowed, f"main.bicepparam: {name} = {raw} is not in @allowed {allowed}"
    # Secrets come from the environment, never from the file.
    assert values["teamsWorkflowUrl"].startswith("readEnvironmentVariable(")


# --- the scale set -----------------------------------------------------------------------------------------------


def test_terminate_notification_is_on_with_a_bounded_notice() -> None:
    profile = _vmss()["properties"]["virtualMachineProfile"]["scheduledEventsProfile"]
    terminate = profile["terminateNotificationProfile"]
    assert terminate["enable"] is True
    # The notice is the module parameter, itself fed by main's parameter; both allow exactly PT5M..PT15M.
    assert terminate["notBeforeTimeout"] == "terminateNotBeforeTimeout"
    module_param = bm.parse(MODULES / "vmss.bicep")["parameters"]["terminateNotBeforeTimeout"]
    main_param = bm.parse(bm.MAIN)["parameters"]["terminateNotBeforeTimeout"]
    assert bm.decorator(module_param, "allowed") == ALLOWED_TIMEOUTS
    assert bm.decorator(main_param, "allowed") == ALLOWED_TIMEOUTS
    assert main_param["default"] in ALLOWED_TIMEOUTS
    assert bm.modules_of_main()["vmss"][1]["terminateNotBeforeTimeout"] == "terminateNotBeforeTimeout"


def test_os_image_notification_and_event_grid_publishing_are_parameters_off_by_default() -> None:
    vmss = _vmss()["properties"]
    os_image = vmss["virtualMachineProfile"]["scheduledEventsProfile"]["osImageNotificationProfile"]
    assert os_image == {"enable": "enableOsImageNotification", "notBeforeTimeout": "PT15M"}
    # The preview publishing block is present only when the parameter asks for it.
    publishing = vmss["scheduledEventsPolicy"]["scheduledEventsAdditionalPublishingTargets"]
    assert publishing == {
        "operator": {
            "type": "conditional",
            "operands": {
                "condition": "enableEventGridPublishing",
                "true_value": "eventGridPublishing",
                "false_value": None,
            },
        }
    }
    target = bm.parse(MODULES / "vmss.bicep")["variables"]["eventGridPublishing"]["value"]
    assert target == {"eventGridAndResourceGraph": {"enable": True, "scheduledEventsApiVersion": "2020-07-01"}}
    main_params = bm.parse(bm.MAIN)["parameters"]
    assert main_params["enableOsImageNotification"]["default"] is False
    assert main_params["enableEventGridPublishing"]["default"] is False


def test_platform_never_auto_approves() -> None:
    policy = _vmss()["properties"]["scheduledEventsPolicy"]
    for kind in ("userInitiatedRedeploy", "userInitiatedReboot", "allInstancesDown"):
        assert policy[kind] == {"automaticallyApprove": False}, kind


def test_orchestration_mode_is_a_parameter_with_both_modes() -> None:
    assert _vmss()["properties"]["orchestrationMode"] == "orchestrationMode"
    assert bm.decorator(bm.parse(bm.MAIN)["parameters"]["orchestrationMode"], "allowed") == ["Uniform", "Flexible"]


def test_scale_set_uses_the_forwarder_identity_and_ssh_only() -> None:
    vmss = _vmss()
    assert vmss["identity"] == {"type": "UserAssigned", "userAssignedIdentities": {"'${vmIdentityId}'": {}}}
    assert bm.modules_of_main()["vmss"][1]["vmIdentityId"] == {
        "operator": {
            "type": "property_accessor",
            "operands": {
                "operand_1": "identities",
                "operand_2": {
                    "operator": {
                        "type": "property_accessor",
                        "operands": {"operand_1": "outputs", "operand_2": "vmIdentityId"},
                    }
                },
            },
        }
    }
    linux = vmss["properties"]["virtualMachineProfile"]["osProfile"]["linuxConfiguration"]
    assert linux["disablePasswordAuthentication"] is True
    assert "adminPassword" not in vmss["properties"]["virtualMachineProfile"]["osProfile"]


def test_cloud_init_installs_the_forwarder_with_its_settings() -> None:
    template = (bm.INFRA / "cloud-init" / "forwarder.yaml").read_text(encoding="utf-8")
    assert template.startswith("#cloud-config\n")
    placeholders = set(re.findall(r"__[A-Z_]+__", template))
    text = (MODULES / "vmss.bicep").read_text(encoding="utf-8")
    assert placeholders == set(re.findall(r"'(__[A-Z_]+__)'", text)), "every placeholder is filled, and only those"
    # The installer's own flags (forwarder/install.sh), each one it understands.
    install = (bm.ROOT / "forwarder" / "install.sh").read_text(encoding="utf-8")
    flags = set(re.findall(r"(--[a-z-]+) ", template.rsplit("install.sh", 1)[1]))  # the call, not the comments
    assert flags == {"--eventhub-namespace", "--eventhub-name", "--client-id", "--relay-namespace"}
    for flag in flags:
        assert f"    {flag})" in install, f"forwarder/install.sh does not take {flag}"
    # The environment file is the one the systemd unit reads, with settings the forwarder knows (it refuses
    # unknown SE_FORWARDER_* variables at start).
    unit = (bm.ROOT / "forwarder" / "systemd" / "scheduled-events-forwarder.service").read_text(encoding="utf-8")
    env_file = re.search(r"- path: (\S+\.env)", template)
    assert env_file
    assert f"EnvironmentFile=-{env_file.group(1)}" in unit
    from forwarder.config import FIELDS

    settings = set(re.findall(r"^\s+SE_FORWARDER_([A-Z_]+)=", template, re.MULTILINE))
    assert settings
    assert {name.lower() for name in settings} <= set(FIELDS)


def test_cloud_init_is_valid_yaml_and_its_script_is_valid_bash(tmp_path: Path) -> None:
    template = (bm.INFRA / "cloud-init" / "forwarder.yaml").read_text(encoding="utf-8")
    document = yaml.safe_load(template)
    files = {item["path"]: item for item in document["write_files"]}
    script_path = "/usr/local/sbin/se-forwarder-bootstrap"
    assert document["runcmd"] == [[script_path]]
    script = tmp_path / "bootstrap.sh"
    script.write_text(files[script_path]["content"], encoding="utf-8")
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr


# --- identities and RBAC ---------------------------------------------------------------------------------------


def _principal_label(path: Path, value: Any) -> str:
    chain = bm.accessor_chain(value)
    assert chain, f"{path.name}: principalId {value!r} is not a reference"
    if len(chain) == 1:  # a module parameter: follow main.bicep to the identity output it is given
        module = next(symbol for symbol, (file, _) in bm.modules_of_main().items() if file == path)
        passed = bm.accessor_chain(bm.modules_of_main()[module][1][chain[0]])
        assert passed, f"{path.name}: {chain[0]} is not a reference"
        assert passed[:2] == ["identities", "outputs"], f"{path.name}: {chain[0]} is not an identity"
        return passed[2]
    return ".".join(chain[:-1])


def _role_label(path: Path, model: dict[str, Any], value: Any, roles: dict[str, Any]) -> str:
    function = value.get("function", {}) if isinstance(value, dict) else {}
    if function.get("type") == "subscription_resource_id":
        assert function["parameters"]["resource_type"] == "Microsoft.Authorization/roleDefinitions"
        chain = bm.accessor_chain(function["parameters"]["resource_name_1"])
        assert chain, f"{path.name}: role id must come from roles.json"
        assert chain[0::2] == ["roles", "id"], f"{path.name}: role id must be roles.<name>.id"
        assert bm.load_path(model["variables"]["roles"]["value"]) == "../roles.json"
        role_id = roles[chain[1]]["id"]
        assert role_id in DOCUMENTED_BUILT_IN_ROLES, f"{path.name}: role {role_id} is not in the allow-list"
        return DOCUMENTED_BUILT_IN_ROLES[role_id]
    chain = bm.accessor_chain(value)
    assert chain, f"{path.name}: unexpected roleDefinitionId {value!r}"
    assert chain[1:] == ["id"], f"{path.name}: unexpected roleDefinitionId {value!r}"
    definition = model["resources"][chain[0]]
    assert definition["type"] == "Microsoft.Authorization/roleDefinitions"
    return f"custom:{chain[0]}"


def _assignments() -> list[tuple[Path, str, dict[str, Any]]]:
    found = []
    for path in bm.bicep_files():
        for symbol, resource in bm.parse(path)["resources"].items():
            if resource["type"] == "Microsoft.Authorization/roleAssignments":
                found.append((path, symbol, resource))
    return found


def test_roles_json_is_the_allow_list_with_justifications() -> None:
    roles = bm.roles()
    entries = {key: value for key, value in roles.items() if isinstance(value, dict)}
    for key, entry in entries.items():
        assert DOCUMENTED_BUILT_IN_ROLES.get(entry["id"]) == entry["name"], f"roles.json {key}: id/name mismatch"
        assert len(entry["why"]) > 30, f"roles.json {key}: justify the role"


def test_role_assignments_are_exactly_the_least_privilege_set() -> None:
    roles = bm.roles()
    actual = set()
    for path, symbol, resource in _assignments():
        model = bm.parse(path)
        body = bm.resource_body(resource)
        properties = body["properties"]
        assert properties["principalType"] == "ServicePrincipal", f"{path.name}:{symbol}"
        if "scope" not in body:
            scope_type = RESOURCE_GROUP
        else:
            scope = bm.accessor_chain(body["scope"])
            assert scope, f"{path.name}:{symbol}: scope must be a resource of the module"
            assert len(scope) == 1, f"{path.name}:{symbol}: scope must be a resource of the module"
            scope_type = model["resources"][scope[0]]["type"]
        role = _role_label(path, model, properties["roleDefinitionId"], roles)
        actual.add((_principal_label(path, properties["principalId"]), role, scope_type))
    assert actual == EXPECTED_ASSIGNMENTS


def test_every_role_assignment_is_explained_by_a_comment() -> None:
    for path, symbol, _ in _assignments():
        lines = path.read_text(encoding="utf-8").splitlines()
        index = next(i for i, line in enumerate(lines) if line.startswith(f"resource {symbol} "))
        assert lines[index - 1].startswith("//"), f"{path.name}: role assignment {symbol} has no comment above it"


def test_custom_relay_role_only_manages_hybrid_connections() -> None:
    definition = bm.resource_body(bm.parse(MODULES / "relay.bicep")["resources"]["hybridConnectionManager"])
    permissions = definition["properties"]["permissions"]
    assert len(permissions) == 1
    assert sorted(permissions[0]["actions"]) == [
        "Microsoft.Relay/namespaces/hybridConnections/delete",
        "Microsoft.Relay/namespaces/hybridConnections/read",
        "Microsoft.Relay/namespaces/hybridConnections/write",
        "Microsoft.Relay/namespaces/read",
    ]
    assert permissions[0]["dataActions"] == []
    # Assignable only in this resource group: resourceGroup().id.
    (scope,) = definition["properties"]["assignableScopes"]
    operands = scope["operator"]["operands"]
    assert operands["operand_1"]["function"]["type"] == "resource_group"
    assert operands["operand_1"]["function"]["parameters"] == {"resource_group_name": None, "subscription_id": None}
    assert operands["operand_2"] == "id"


def test_census_role_only_reads_virtual_machines_and_scale_sets() -> None:
    definition = bm.resource_body(bm.parse(MODULES / "vmss.bicep")["resources"]["vmCensusReader"])
    (permissions,) = definition["properties"]["permissions"]
    assert sorted(permissions["actions"]) == [
        "Microsoft.Compute/virtualMachineScaleSets/read",
        "Microsoft.Compute/virtualMachineScaleSets/virtualMachines/instanceView/read",
        "Microsoft.Compute/virtualMachineScaleSets/virtualMachines/read",
        "Microsoft.Compute/virtualMachines/instanceView/read",
        "Microsoft.Compute/virtualMachines/read",
    ]
    assert (permissions["notActions"], permissions["dataActions"], permissions["notDataActions"]) == ([], [], [])
    (scope,) = definition["properties"]["assignableScopes"]
    assert scope["operator"]["operands"]["operand_1"]["function"]["type"] == "resource_group"


def test_repairs_role_only_reads_scale_sets_and_sets_their_orchestration_service_state() -> None:
    resources = bm.parse(MODULES / "vmss.bicep")["resources"]
    definition = bm.resource_body(resources["repairsOperator"])
    (permissions,) = definition["properties"]["permissions"]
    assert sorted(permissions["actions"]) == [
        "Microsoft.Compute/virtualMachineScaleSets/read",
        "Microsoft.Compute/virtualMachineScaleSets/setOrchestrationServiceState/action",
    ]
    assert (permissions["notActions"], permissions["dataActions"], permissions["notDataActions"]) == ([], [], [])
    (scope,) = definition["properties"]["assignableScopes"]
    assert scope["operator"]["operands"]["operand_1"]["function"]["type"] == "resource_group"
    # Both behind the one parameter main.bicep passes from suspendAutomaticRepairs.
    for symbol in ("repairsOperator", "coordinatorRepairsOperator"):
        assert "enableRepairsSuspension" in json.dumps(resources[symbol]), symbol
    passed = bm.modules_of_main()["vmss"][1]["enableRepairsSuspension"]
    assert bm.accessor_chain(passed) == ["suspendAutomaticRepairs"]


def test_event_grid_has_its_own_hub_that_only_the_system_topic_may_send_to() -> None:
    model = bm.parse(MODULES / "eventhubs.bicep")
    resources = model["resources"]
    subscription = bm.resource_body(resources["maintenanceToHub"])["properties"]["deliveryWithResourceIdentity"]
    assert bm.accessor_chain(subscription["destination"]["properties"]["resourceId"]) == ["platformHub", "id"]
    senders = {}
    for symbol, resource in resources.items():
        body = bm.resource_body(resource)
        if resource["type"] == "Microsoft.Authorization/roleAssignments" and "Sender" in json.dumps(body):
            senders[symbol] = (bm.accessor_chain(body["scope"]), bm.accessor_chain(body["properties"]["principalId"]))
    # The VMs send to the envelopes' hub only; the system topic's identity alone sends to the platform's hub.
    assert senders == {
        "vmSender": (["hub"], ["vmPrincipalId"]),
        "topicSender": (["platformHub"], ["maintenanceTopic", "identity", "principalId"]),
    }
    receivers = {
        str(bm.accessor_chain(bm.resource_body(r)["scope"]))
        for r in resources.values()
        if r["type"] == "Microsoft.Authorization/roleAssignments" and "Receiver" in json.dumps(bm.resource_body(r))
    }
    assert receivers == {str(["hub"]), str(["platformHub"])}, "the coordinator reads both hubs"
    assert bm.resource_body(resources["platformConsumerGroup"])["name"] == "consumerGroupName"


# --- no keys ---------------------------------------------------------------------------------------------------


def test_local_auth_is_off() -> None:
    def body(module: str, symbol: str) -> Any:
        return bm.resource_body(bm.parse(MODULES / module)["resources"][symbol])["properties"]

    assert body("eventhubs.bicep", "namespace")["disableLocalAuth"] is True
    storage = body("storage.bicep", "account")
    assert storage["allowSharedKeyAccess"] is False
    assert storage["allowBlobPublicAccess"] is False
    assert storage["minimumTlsVersion"] == "TLS1_2"
    assert body("monitoring.bicep", "appInsights")["DisableLocalAuth"] is True
    assert body("monitoring.bicep", "workspace")["features"]["disableLocalAuth"] is True
    assert body("keyvault.bicep", "vault")["enableRbacAuthorization"] is True


def test_no_sas_rules_no_list_functions_and_no_secrets_in_outputs() -> None:
    for path in bm.bicep_files():
        model = bm.parse(path)
        for resource in model["resources"].values():
            assert not resource["type"].endswith("/authorizationRules"), f"{path.name}: declares a SAS rule"
        for name, output in model["outputs"].items():
            assert not _SECRETISH.search(name), f"{path.name}: output {name} looks like a secret"
            assert not {fn for fn in bm.function_calls(output["value"]) if fn.lower().startswith("list")}, (
                path.name,
                name,
            )
        # listKeys() & co. anywhere; the one list* call allowed is the Logic App callback URL in the action group.
        calls = bm.function_calls(model)
        assert not {fn for fn in calls if fn.lower().startswith("list") and fn != "listCallbackUrl"}, path.name
    alerts = (MODULES / "alerts.bicep").read_text(encoding="utf-8")
    assert alerts.count("listCallbackUrl(") == 1


def test_teams_url_is_a_secure_parameter_stored_only_in_key_vault() -> None:
    main = bm.parse(bm.MAIN)
    assert any(d["type"] == "secure" for d in main["parameters"]["teamsWorkflowUrl"]["decorators"])
    assert main["parameters"]["teamsWorkflowUrl"]["default"] is None
    users = [path.name for path in bm.bicep_files() if "teamsWorkflowUrl" in path.read_text(encoding="utf-8")]
    assert sorted(users) == ["keyvault.bicep", "main.bicep"]
    secret = bm.resource_body(bm.parse(MODULES / "keyvault.bicep")["resources"]["teamsSecret"])
    assert secret["properties"]["value"] == "teamsWorkflowUrl"


def _app_settings() -> dict[str, Any]:
    config = bm.resource_body(bm.parse(MODULES / "functionapp.bicep")["resources"]["appSettings"])
    assert config["name"] == "appsettings"
    settings: dict[str, Any] = config["properties"]
    return settings


def test_function_app_uses_identity_based_connections() -> None:
    settings = _app_settings()
    assert settings["EventHubConnection__fullyQualifiedNamespace"] == "eventHubNamespace"
    assert settings["EventHubConnection__credential"] == "managedidentity"
    assert settings["AzureWebJobsStorage__credential"] == "managedidentity"
    assert "AzureWebJobsStorage" not in settings
    assert settings["APPLICATIONINSIGHTS_AUTHENTICATION_STRING"].endswith(";Authorization=AAD")
    assert settings["COORDINATOR_TEAMS_WEBHOOK_URL"] == "@Microsoft.KeyVault(SecretUri=${teamsUrlEntryUri})"
    site = bm.resource_body(bm.parse(MODULES / "functionapp.bicep")["resources"]["site"])
    assert site["properties"]["httpsOnly"] is True
    assert "appSettings" not in site["properties"]["siteConfig"], "app settings live in one place"
    config = site["properties"]["functionAppConfig"]
    assert config["runtime"] == {"name": "python", "version": "3.11"}
    assert config["deployment"]["storage"]["authentication"]["type"] == "UserAssignedIdentity"
    plan = bm.resource_body(bm.parse(MODULES / "functionapp.bicep")["resources"]["plan"])
    assert plan["sku"] == {"name": "FC1", "tier": "FlexConsumption"}


def test_app_settings_are_the_ones_the_coordinator_and_function_app_read() -> None:
    from coordinator.settings import PREFIX, CoordinatorSettings

    settings = _app_settings()
    coordinator = {name for name in settings if name.startswith(PREFIX)}
    fields = {PREFIX + field.upper() for field in CoordinatorSettings.model_fields}
    assert coordinator <= fields, f"unknown coordinator settings {coordinator - fields}"
    assert {
        "COORDINATOR_TABLE_ENDPOINT",
        "COORDINATOR_LOGS_INGESTION_ENDPOINT",
        "COORDINATOR_LOGS_DCR_IMMUTABLE_ID",
        "COORDINATOR_RELAY_NAMESPACE",
        "COORDINATOR_TEAMS_WEBHOOK_URL",
    } <= coordinator
    # Never the local-mode storage key in Azure.
    assert "COORDINATOR_STORAGE_CONNECTION_STRING" not in coordinator
    # Binding expressions (%NAME%) and connection prefixes of function_app.py resolve to app settings.
    function_app = (bm.ROOT / "function_app.py").read_text(encoding="utf-8")
    expressions = set(re.findall(r'"%(\w+)%"', function_app))
    assert expressions, "function_app.py has no %setting% binding expressions any more?"
    assert expressions <= set(settings)
    for connection in re.findall(r'connection="(\w+)"', function_app):
        # Event Hubs connections name their namespace; the host storage connection (the delivery queue's trigger)
        # its queue service.
        suffix = "queueServiceUri" if connection == "AzureWebJobsStorage" else "fullyQualifiedNamespace"
        assert f"{connection}__{suffix}" in settings


def test_the_delivery_queue_is_the_one_the_coordinator_and_its_trigger_name() -> None:
    from coordinator.adapters.delivery_queue import DELIVERY_QUEUE

    storage = bm.parse(MODULES / "storage.bicep")
    assert storage["variables"]["deliveryQueueName"]["value"] == DELIVERY_QUEUE
    assert _app_settings()["COORDINATOR_DELIVERY_QUEUE_URL"] == "deliveryQueueUrl"


# --- history table ---------------------------------------------------------------------------------------------


def test_history_table_and_dcr_come_from_history_columns_json() -> None:
    main = bm.parse(bm.MAIN)
    assert bm.load_path(main["variables"]["historySchema"]["value"]) == "../coordinator/history_columns.json"
    assert bm.modules_of_main()["monitoring"][1]["historySchema"] == "historySchema"
    monitoring = bm.parse(MODULES / "monitoring.bicep")
    schema = json.loads((bm.ROOT / "coordinator" / "history_columns.json").read_text(encoding="utf-8"))
    types = {column["type"] for column in schema["columns"]}
    table_types = monitoring["variables"]["tableColumnTypes"]["value"]
    stream_types = monitoring["variables"]["streamColumnTypes"]["value"]
    assert types <= set(table_types), "a column type has no table mapping"
    assert types <= set(stream_types), "a column type has no DCR stream mapping"
    assert table_types["datetime"] == "dateTime"
    assert stream_types["datetime"] == "datetime"
    assert schema["table"].endswith("_CL")
    assert schema["stream"].startswith("Custom-")
    for variable in ("tableColumns", "streamColumns"):
        loop = monitoring["variables"][variable]["value"]["loop_type"]["detail"]
        assert bm.accessor_chain(loop["array_name"]) == ["historySchema", "columns"]
    dcr = bm.resource_body(monitoring["resources"]["historyDcr"])
    assert dcr["kind"] == "Direct"
    outputs = bm.parse(bm.MAIN)["outputs"]
    assert {"logsIngestionEndpoint", "historyDcrImmutableId", "historyStreamName"} <= set(outputs)


def test_list_function_detection_sees_every_spelling() -> None:
    model = bm._parser().parse(
        text="output a string = listKeys(x.id, '2023-01-01').keys[0].value\n"
        "output b object = x.listKeys()\n"
        "output c string = listCallbackUrl('${x.id}/triggers/manual', '2019-05-01').value\n"
    )
    assert [bm.function_calls(output["value"]) for output in model["outputs"].values()] == [
        {"listKeys"},
        {"listKeys"},
        {"listCallbackUrl"},
    ]
