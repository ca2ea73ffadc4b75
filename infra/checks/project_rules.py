"""The project's own checkov rules for infra/ (run: checkov -d infra --framework bicep --skip-download
--external-checks-dir infra/checks). pycep gives references as bare names and function calls as
{"function": {"type": <snake_case name>, ...}} trees; the checks read those shapes.

CKV_SE_1  scale set: terminate notification on, notice PT5M..PT15M (a literal, or a parameter that CKV_SE_2 bounds)
CKV_SE_2  *NotBeforeTimeout parameters: @allowed values all within PT5M..PT15M
CKV_SE_3  scale set: scheduledEventsPolicy leaves approval to the project's rules (automaticallyApprove false)
CKV_SE_4  local (key/SAS) auth off: Event Hubs, Service Bus, Storage, Application Insights, Log Analytics
CKV_SE_5  no SAS authorization rules declared (Relay has no disableLocalAuth switch; this is its guard)
CKV_SE_6  app settings: no keys, list*() results or connection strings (outputs: tests/infra, checkov has no
          output checks for Bicep)
CKV_SE_7  App Service Authentication (authsettingsV2): on, sign-in required for every request, Entra ID provider
          on, no anonymous fallback (checkov's CKV_AZURE_13 reads only the v1 'authsettings' document)
"""

from __future__ import annotations

import json
import re
from typing import Any

from checkov.bicep.checks.param.base_param_check import BaseParamCheck
from checkov.bicep.checks.resource.base_resource_check import BaseResourceCheck
from checkov.common.models.enums import CheckCategories, CheckResult

# Shortest and longest terminate notice Azure accepts (learn: virtual-machine-scale-sets-terminate-notification).
MIN_NOTICE_MINUTES = 5
MAX_NOTICE_MINUTES = 15
_MINUTES = re.compile(r"^PT(\d+)M$")


def notice_minutes(value: Any) -> int | None:
    """Minutes of an ISO 8601 'PT<n>M' literal; None for anything else (a reference, another unit)."""
    if isinstance(value, str):
        match = _MINUTES.match(value)
        if match:
            return int(match.group(1))
    return None


def dig(conf: Any, *path: str) -> Any:
    """conf[path[0]][path[1]]...; None where a level is missing or not a mapping."""
    for key in path:
        if not isinstance(conf, dict):
            return None
        conf = conf.get(key)
    return conf


def function_types(value: Any) -> set[str]:
    """Every Bicep function a pycep expression tree calls. pycep spells most in snake case, keeps some as written
    (listCallbackUrl), wraps listKeys(...) as list_func and `res.listKeys()` as a function_accessor."""
    found: set[str] = set()
    if isinstance(value, dict):
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("type"), str):
            parameters = function.get("parameters")
            name = parameters.get("func_name") if isinstance(parameters, dict) else None
            found.add(name if isinstance(name, str) else function["type"])
        operator = value.get("operator")
        if isinstance(operator, dict) and operator.get("type") == "function_accessor":
            found.add(str(operator.get("operands", {}).get("func_name")))
        for item in value.values():
            found |= function_types(item)
    elif isinstance(value, list):
        for item in value:
            found |= function_types(item)
    return found


def text_of(value: Any) -> str:
    return json.dumps(value, default=str)


_IDENTIFIER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


class TerminateNotificationEnabled(BaseResourceCheck):  # type: ignore[misc]
    """terminateNotificationProfile.enable is literally true and notBeforeTimeout is PT5M..PT15M or a parameter
    (whose allowed values CKV_SE_2 bounds)."""

    def __init__(self) -> None:
        super().__init__(
            name="Scale set announces deletes with a terminate notification of 5 to 15 minutes",
            id="CKV_SE_1",
            categories=(CheckCategories.GENERAL_SECURITY,),
            supported_resources=("Microsoft.Compute/virtualMachineScaleSets",),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        profile = dig(
            conf, "properties", "virtualMachineProfile", "scheduledEventsProfile", "terminateNotificationProfile"
        )
        if not isinstance(profile, dict) or profile.get("enable") is not True:
            return CheckResult.FAILED
        timeout = profile.get("notBeforeTimeout")
        minutes = notice_minutes(timeout)
        if minutes is not None:
            return CheckResult.PASSED if MIN_NOTICE_MINUTES <= minutes <= MAX_NOTICE_MINUTES else CheckResult.FAILED
        # A bare parameter reference: pycep gives the name as a plain string.
        if isinstance(timeout, str) and timeout and set(timeout) <= _IDENTIFIER_CHARS and timeout.endswith("Timeout"):
            return CheckResult.PASSED
        return CheckResult.FAILED


class NoticeTimeoutParameterBounded(BaseParamCheck):  # type: ignore[misc]
    """Every *NotBeforeTimeout parameter lists its allowed values, all PT5M..PT15M, and its default is one of them."""

    def __init__(self) -> None:
        super().__init__(
            name="Terminate notice parameters allow only PT5M to PT15M",
            id="CKV_SE_2",
            categories=(CheckCategories.GENERAL_SECURITY,),
            supported_type=("string",),
        )

    def scan_param_conf(self, conf: dict[str, Any]) -> CheckResult:
        name = self.entity_path.rsplit(":", 1)[-1]
        if not name.lower().endswith("notbeforetimeout"):
            return CheckResult.UNKNOWN
        allowed = next((d.get("argument") for d in conf.get("decorators", []) if d.get("type") == "allowed"), None)
        if not isinstance(allowed, list) or not allowed:
            return CheckResult.FAILED
        bounded = all(
            (m := notice_minutes(value)) is not None and MIN_NOTICE_MINUTES <= m <= MAX_NOTICE_MINUTES
            for value in allowed
        )
        default = conf.get("default")
        return CheckResult.PASSED if bounded and (default is None or default in allowed) else CheckResult.FAILED


class NoPlatformAutoApproval(BaseResourceCheck):  # type: ignore[misc]
    """scheduledEventsPolicy sets automaticallyApprove false for user reboot/redeploy and all-instances-down: with
    true, those events skip Scheduled and the project's approval rules never see them."""

    def __init__(self) -> None:
        super().__init__(
            name="Scale set leaves scheduled-event approval to the project's rules (no automatic approval)",
            id="CKV_SE_3",
            categories=(CheckCategories.GENERAL_SECURITY,),
            supported_resources=("Microsoft.Compute/virtualMachineScaleSets",),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        policy = dig(conf, "properties", "scheduledEventsPolicy")
        for kind in ("userInitiatedRedeploy", "userInitiatedReboot", "allInstancesDown"):
            if dig(policy, kind, "automaticallyApprove") is not False:
                return CheckResult.FAILED
        return CheckResult.PASSED


# Resource type -> (property path, the value that means "local auth off").
_SWITCHES: dict[str, tuple[tuple[str, ...], bool]] = {
    "Microsoft.EventHub/namespaces": (("properties", "disableLocalAuth"), True),
    "Microsoft.ServiceBus/namespaces": (("properties", "disableLocalAuth"), True),
    "Microsoft.Storage/storageAccounts": (("properties", "allowSharedKeyAccess"), False),
    "Microsoft.Insights/components": (("properties", "DisableLocalAuth"), True),
    "Microsoft.OperationalInsights/workspaces": (("properties", "features", "disableLocalAuth"), True),
}


class LocalAuthDisabled(BaseResourceCheck):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(
            name="Local (key/SAS) authentication is disabled: Entra ID only",
            id="CKV_SE_4",
            categories=(CheckCategories.IAM,),
            supported_resources=tuple(_SWITCHES),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        path, wanted = _SWITCHES[self.entity_type]
        return CheckResult.PASSED if dig(conf, *path) is wanted else CheckResult.FAILED


class NoSasAuthorizationRules(BaseResourceCheck):  # type: ignore[misc]
    """Any declared SAS rule is a key that can leak; Relay has no disableLocalAuth, so this is its guard."""

    def __init__(self) -> None:
        super().__init__(
            name="No SAS authorization rules (keys) are declared",
            id="CKV_SE_5",
            categories=(CheckCategories.IAM,),
            supported_resources=(
                "Microsoft.Relay/namespaces/authorizationRules",
                "Microsoft.Relay/namespaces/hybridConnections/authorizationRules",
                "Microsoft.Relay/namespaces/wcfRelays/authorizationRules",
                "Microsoft.EventHub/namespaces/authorizationRules",
                "Microsoft.EventHub/namespaces/eventhubs/authorizationRules",
                "Microsoft.ServiceBus/namespaces/authorizationRules",
            ),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        return CheckResult.FAILED


# Names that announce a secret-bearing value.
_SECRET_NAME = re.compile(r"connection_?string|connstr|(account|access|shared|sas)_?key|password|secret|sig$", re.I)
# Fragments that only appear in key-bearing values.
_SECRET_TEXT = re.compile(r"AccountKey=|SharedAccessKey=|SharedAccessSignature|[?&]sig=", re.I)
# Application Insights' connection string holds no secret when the component has local auth off (CKV_SE_4), and
# the Functions host reads telemetry settings only from this name.
_ALLOWED_NAMES = frozenset({"APPLICATIONINSIGHTS_CONNECTION_STRING"})
# A Key Vault reference is the sanctioned way to hand a secret to an app: the setting holds only the secret's URI.
_KEY_VAULT_REFERENCE = "@Microsoft.KeyVault("


class NoKeysInAppSettings(BaseResourceCheck):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(
            name="App settings hold no keys, listKeys() results or connection strings",
            id="CKV_SE_6",
            categories=(CheckCategories.SECRETS,),
            supported_resources=("Microsoft.Web/sites", "Microsoft.Web/sites/config"),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        if self.entity_type == "Microsoft.Web/sites":
            settings = dig(conf, "properties", "siteConfig", "appSettings")
            pairs = [(item.get("name"), item.get("value")) for item in settings or [] if isinstance(item, dict)]
        else:
            properties = conf.get("properties")
            pairs = list(properties.items()) if isinstance(properties, dict) else []
        for name, value in pairs:
            if any(fn.lower().startswith("list") for fn in function_types(value)):
                return CheckResult.FAILED
            if isinstance(name, str) and name in _ALLOWED_NAMES:
                continue
            text = text_of(value)
            if _KEY_VAULT_REFERENCE in text:
                continue
            if (isinstance(name, str) and _SECRET_NAME.search(name)) or _SECRET_TEXT.search(text):
                return CheckResult.FAILED
        return CheckResult.PASSED


class SignInRequired(BaseResourceCheck):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__(
            name="App Service Authentication v2 requires an Entra ID sign-in for every request",
            id="CKV_SE_7",
            categories=(CheckCategories.IAM,),
            supported_resources=("Microsoft.Web/sites/config",),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        if conf.get("name") != "authsettingsV2":
            return CheckResult.UNKNOWN  # another config document (app settings, logs...): not this check's
        properties = conf.get("properties")
        required = (
            dig(properties, "platform", "enabled") is True
            and dig(properties, "globalValidation", "requireAuthentication") is True
            and dig(properties, "globalValidation", "unauthenticatedClientAction") != "AllowAnonymous"
            and dig(properties, "identityProviders", "azureActiveDirectory", "enabled") is True
        )
        return CheckResult.PASSED if required else CheckResult.FAILED


# checkov registers each check when it is instantiated.
terminate_check = TerminateNotificationEnabled()
timeout_param_check = NoticeTimeoutParameterBounded()
auto_approval_check = NoPlatformAutoApproval()
local_auth_check = LocalAuthDisabled()
sas_rules_check = NoSasAuthorizationRules()
app_settings_check = NoKeysInAppSettings()
sign_in_check = SignInRequired()
