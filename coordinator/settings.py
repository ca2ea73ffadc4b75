"""The coordinator's settings: one pydantic-settings model read from the environment (Function App app settings).

Every variable is ``COORDINATOR_<FIELD>`` in upper case (e.g. ``COORDINATOR_STATE_TABLE``). In Azure, storage is
reached with a managed identity (``COORDINATOR_TABLE_ENDPOINT``); locally with Azurite's connection string
(``COORDINATOR_STORAGE_CONNECTION_STRING``). Secrets (the Teams webhook URL, a connection string) are SecretStr:
never printed, logged or put in a repr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from coordinator.adapters.issuers import AZURE_ISSUER_URL_PREFIXES
from coordinator.domain.arm_ids import is_resource_group
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH
from coordinator.domain.rows import history_schema

PREFIX = "COORDINATOR_"
# The roots of Azure's certificates, shipped with the app (coordinator/trust/azure-imds-roots.pem says which).
AZURE_IMDS_ROOTS = Path(__file__).parent / "trust" / "azure-imds-roots.pem"


class SettingsError(ValueError):
    """The app settings are incomplete or inconsistent; the message names the variables."""


class CoordinatorSettings(BaseSettings):
    # An empty variable counts as unset (an app setting cleared in the portal), as an absent one does.
    model_config = SettingsConfigDict(env_prefix=PREFIX, env_ignore_empty=True, extra="forbid", frozen=True)

    # State (Table Storage): exactly one of the two.
    table_endpoint: str | None = Field(default=None, description="https://{account}.table.core.windows.net (MI)")
    storage_connection_string: SecretStr | None = Field(default=None, description="Azurite / local only")
    state_table: str = Field(default="scheduledevents", pattern=r"^[A-Za-z][A-Za-z0-9]{2,50}$")
    managed_identity_client_id: str | None = Field(default=None, description="user-assigned identity; else system")

    # Rules.
    policy_path: Path = DEFAULT_POLICY_PATH
    dry_run: bool = False
    # A candidate policy decided beside the live one, recorded as Shadow rows and never sent (pipeline/shadow.py).
    shadow_policy_path: Path | None = None
    # Scale sets' automatic repairs suspended while a Reboot, Redeploy or Freeze is in flight on their VMs
    # (pipeline/repairs.py; needs the census), resumed after it, or after the bound.
    suspend_repairs: bool = False
    repairs_bound_seconds: int = Field(default=7200, ge=600, le=86400)

    # Alerts.
    teams_webhook_url: SecretStr | None = None
    cards_folder: Path | None = Field(default=None, description="local mode: write cards here instead of Teams")
    public_base_url: str | None = Field(default=None, description="https://{app}.azurewebsites.net for card links")

    # History: Logs Ingestion in Azure, SQLite locally.
    logs_ingestion_endpoint: str | None = None
    logs_dcr_immutable_id: str | None = None
    logs_stream: str = Field(default_factory=lambda: str(history_schema()["stream"]))
    history_sqlite_path: Path | None = None

    # Approvals: Azure Relay (the Relay emulator locally, through relay_endpoint).
    relay_namespace: str | None = Field(default=None, description="{ns}.servicebus.windows.net")
    relay_endpoint: str | None = Field(default=None, description="override, e.g. http://127.0.0.1:P (emulator)")
    relay_subscription_id: str | None = None
    relay_resource_group: str | None = None
    # Remote acknowledge through the Maintenance RP (preview; docs/deploy.md): "off"; "rules" (only rules with
    # 'callback: remote-acknowledge'); "fallback" (those, and any approval no VM's listener can execute).
    remote_acknowledge: Literal["off", "rules", "fallback"] = "off"
    arm_endpoint: str = Field(
        default="https://management.azure.com", description="override, e.g. the IMDS emulator (http://127.0.0.1:P)"
    )
    # Approvals not answered within in_run_delivery_seconds continue through this Azure Storage queue
    # (adapters/delivery_queue.py): the queue's URL, reached with the managed identity; a SAS only for Azurite.
    delivery_queue_url: str | None = Field(
        default=None, description="https://{account}.queue.core.windows.net/approval-deliveries"
    )
    delivery_queue_sas: SecretStr | None = Field(default=None, description="Azurite / local only")

    # The census (adapters/census.py): the resource groups whose scale sets and VMs ARM lists for budgets and tag
    # rules, read with the coordinator's identity. Required by a policy with tags, percent or domain budgets.
    census_resource_groups: str = Field(
        default="", description="resource group ids, comma-separated: /subscriptions/{id}/resourceGroups/{name}"
    )
    census_refresh_seconds: int = Field(
        default=300,
        ge=60,
        le=3600,
        description="read the census again this often (the timer); it is read sooner "
        "for a VM it does not list, and not used once three times this old",
    )

    # Timing and people.
    heartbeat_timeout_seconds: int = Field(default=300, ge=30)
    retire_grace_seconds: int = Field(
        default=180,
        ge=1,
        description="retire a VM this long after a Terminate/Preempt naming it started (or was approved, or reached "
        "NotBefore) and it fell silent; shorter than the heartbeat timeout",
    )
    clock_tolerance_seconds: float = Field(
        default=2.0,
        ge=0,
        le=60,
        description="how far a VM's clock may disagree with the coordinator's: no approval is sent within this of its "
        "notAfter (the forwarder's not_after_tolerance must match); local mode, on one clock, uses 0.25",
    )
    approval_deadline_seconds: int = Field(
        default=30, ge=1, le=600, description="how long one approval may take to be answered before it is retried"
    )
    in_run_delivery_seconds: float = Field(
        default=3.0,
        ge=0.5,
        le=60,
        description="with a delivery queue: how long a batch, tick or person's approval waits for an approval's "
        "answer before it hands it to the queue",
    )
    start_bound_seconds: int = Field(
        default=300,
        ge=1,
        description="an approval the VM's listener answered 'approved' must be seen Started or gone within this, "
        "else a 'not-started' card",
    )
    imds_failing_seconds: int = Field(
        default=60,
        ge=5,
        description="a heartbeat showing no good IMDS poll for longer than this raises the VM's 'imds-failing' card",
    )
    imds_failing_poll_errors: int = Field(
        default=60,
        ge=1,
        description="with no good IMDS poll since the forwarder started: this many failed polls in a row raise it",
    )
    hybrid_connection_silence_seconds: int = Field(
        default=86_400, ge=3600, description="delete a VM's hybrid connection after this long without a word"
    )
    retention_days: int = Field(default=30, ge=1, description="delete concluded event records after this long")
    # Attested forwarders (pipeline/attest.py, docs/security.md): IMDS attested documents verified against these.
    require_attestation: bool = Field(
        default=True,
        description="refuse envelopes and approval answers without an IMDS attested document of their VM; off only "
        "while forwarders older than attestation are replaced (an attested document is verified either way)",
    )
    attestation_trust_anchors: Path = Field(
        default=AZURE_IMDS_ROOTS,
        description="PEM roots that attested documents must chain to: Azure's (shipped) in Azure, the IMDS "
        "emulator's root locally",
    )
    attestation_intermediates: Path | None = Field(
        default=None, description="PEM issuing CAs known ahead (else fetched from the allowed CA Issuers URLs)"
    )
    attestation_issuer_urls: str = Field(
        default=",".join(AZURE_ISSUER_URL_PREFIXES),
        description="comma-separated URL prefixes the signing certificate's CA Issuers URL may be fetched from",
    )
    attestation_signer_domain: str = Field(
        default="metadata.azure.com",
        pattern=r"^[a-z0-9.-]+$",
        description="the DNS domain of IMDS's signing certificate (metadata.azure.us, metadata.azure.cn in sovereign "
        "clouds)",
    )

    @field_validator(
        "table_endpoint",
        "logs_ingestion_endpoint",
        "public_base_url",
        "relay_endpoint",
        "arm_endpoint",
        "delivery_queue_url",
    )
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("https://", "http://127.0.0.1", "http://localhost")):
            raise ValueError(f"{value!r} must be an https:// URL (http:// only on loopback)")
        return value.rstrip("/") if value else value

    @field_validator("census_resource_groups")
    @classmethod
    def _resource_groups(cls, value: str) -> str:
        for scope in value.split(","):
            if scope.strip() and not is_resource_group(scope.strip().rstrip("/")):
                raise ValueError(f"{scope.strip()!r} is not /subscriptions/{{id}}/resourceGroups/{{name}}")
        return value

    @property
    def census_scopes(self) -> list[str]:
        return [scope.strip().rstrip("/") for scope in self.census_resource_groups.split(",") if scope.strip()]

    @model_validator(mode="after")
    def _consistent(self) -> CoordinatorSettings:
        if (self.table_endpoint is None) == (self.storage_connection_string is None):
            raise ValueError(
                "set exactly one of COORDINATOR_TABLE_ENDPOINT (Azure, managed identity) or "
                "COORDINATOR_STORAGE_CONNECTION_STRING (Azurite)"
            )
        if (self.logs_ingestion_endpoint is None) != (self.logs_dcr_immutable_id is None):
            raise ValueError("COORDINATOR_LOGS_INGESTION_ENDPOINT and COORDINATOR_LOGS_DCR_IMMUTABLE_ID go together")
        if self.retire_grace_seconds >= self.heartbeat_timeout_seconds:
            raise ValueError(
                "COORDINATOR_RETIRE_GRACE_SECONDS must be shorter than COORDINATOR_HEARTBEAT_TIMEOUT_SECONDS: a "
                "removed VM is retired before it would count as a lost heartbeat"
            )
        if self.in_run_delivery_seconds >= self.approval_deadline_seconds:
            raise ValueError(
                "COORDINATOR_IN_RUN_DELIVERY_SECONDS must be shorter than COORDINATOR_APPROVAL_DEADLINE_SECONDS: the "
                "delivery queue continues an approval with the whole deadline"
            )
        if self.delivery_queue_sas is not None and self.delivery_queue_url is None:
            raise ValueError("COORDINATOR_DELIVERY_QUEUE_SAS needs COORDINATOR_DELIVERY_QUEUE_URL")
        if self.teams_webhook_url is not None and self.cards_folder is not None:
            raise ValueError("set COORDINATOR_TEAMS_WEBHOOK_URL or COORDINATOR_CARDS_FOLDER, not both")
        return self

    @classmethod
    def from_env(cls) -> CoordinatorSettings:
        """The settings in the process environment; ``SettingsError`` names each variable that is wrong and why."""
        try:
            return cls()
        except ValidationError as error:
            problems = "; ".join(
                f"{PREFIX}{str(e['loc'][0]).upper() if e['loc'] else '(settings)'}: {e['msg']}" for e in error.errors()
            )
            raise SettingsError(f"coordinator settings: {problems}") from error
