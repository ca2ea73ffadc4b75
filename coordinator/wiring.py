"""Builds a Coordinator from settings: its ``Parts`` (Azure implementations in Azure, local ones (Azurite, SQLite, a
cards folder) in the local mode) and its ``Options`` (``build_options``, one line per setting), once. The only place
that chooses between them. Approvals go through Azure Relay (the Relay emulator locally); a caller may hand in
another ``ApprovalCallback`` (local/direct_callback.py, never deployed)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import quote

from azure.core.credentials import AzureSasCredential, TokenCredential
from azure.identity import DefaultAzureCredential

from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.callback import ApprovalCallback
from coordinator.adapters.census import ArmCensusReader, Census
from coordinator.adapters.deadline import session
from coordinator.adapters.delivery_queue import StorageQueueDeliveries
from coordinator.adapters.gates import AzureMonitorReader
from coordinator.adapters.heap import HEAP
from coordinator.adapters.history import DEFAULT_SQLITE_PATH, HistorySink, LogsIngestionHistory, SqliteHistory
from coordinator.adapters.issuers import AiaIssuers
from coordinator.adapters.repairs import ArmRepairs
from coordinator.adapters.teams import AlertSink, FolderCardSink, TeamsWebhookSink
from coordinator.domain.attestation import Attestations, AttestationVerifier, TrustAnchors, load_pem_certificates
from coordinator.domain.policy import Policy
from coordinator.domain.policy_file import load_policy
from coordinator.pipeline.run import APPROVAL_WORKERS, Options, Parts
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings, SettingsError
from coordinator.state.tables import TableStateStore


def build_coordinator(settings: CoordinatorSettings, *, callback: ApprovalCallback | None = None) -> Coordinator:
    """The composition root: each part from its settings (one builder each, below), then the coordinator; and the
    process's collector policy (adapters/heap.py: what survives a full pass is not traversed again)."""
    HEAP.install()
    credential = DefaultAzureCredential(managed_identity_client_id=settings.managed_identity_client_id)
    policy = load_policy(settings.policy_path)
    shadow = load_policy(settings.shadow_policy_path) if settings.shadow_policy_path else None
    both = [policy, shadow] if shadow is not None else [policy]
    path = build_approval_path(settings, credential, callback)
    parts = Parts(
        store=build_store(settings, credential),
        history=build_history(settings, credential),
        alerts=build_alerts(settings),
        callback=path.callback,
        remote_acknowledge=build_remote_acknowledge(settings, credential),
        monitor=build_monitor(both, credential, arm_endpoint=settings.arm_endpoint),
        deliveries=build_deliveries(settings, credential),
        attestations=build_attestations(settings),
        census=build_census(settings, credential, needed=any(p.needs_census for p in both) or settings.suspend_repairs),
        repairs=ArmRepairs(credential=credential, arm=ArmOptions(endpoint=settings.arm_endpoint))
        if settings.suspend_repairs
        else None,
    )
    return Coordinator(
        parts,
        build_options(settings),
        policy,
        # A batch returns once its approvals are sent and its positions written; its tail runs on these threads
        # (each mostly waits: for its approvals' answers, at most IN_RUN_DELIVERY + slack, and its sinks).
        after_batch=concurrent.futures.ThreadPoolExecutor(max_workers=APPROVAL_WORKERS, thread_name_prefix="tail"),
        on_new_vm=path.on_new_vm,
        housekeeping=path.housekeeping,
        shadow=shadow,
    )


def build_store(settings: CoordinatorSettings, credential: TokenCredential) -> TableStateStore:
    """The state table: Azurite's connection string locally, the account's endpoint and the identity in Azure; its
    clients on the deadline module's sessions (the environment's proxy settings read once per host, not per write)."""
    if settings.storage_connection_string is not None:
        return TableStateStore.from_connection_string(
            settings.storage_connection_string.get_secret_value(), table_name=settings.state_table, session=session
        )
    assert settings.table_endpoint is not None  # settings validation: exactly one of the two
    return TableStateStore.from_endpoint(
        settings.table_endpoint, credential=credential, table_name=settings.state_table, session=session
    )


def build_history(settings: CoordinatorSettings, credential: TokenCredential) -> HistorySink:
    """Log Analytics through the Logs Ingestion API when its endpoint and rule are set, else SQLite."""
    if settings.logs_ingestion_endpoint and settings.logs_dcr_immutable_id:
        return LogsIngestionHistory(
            endpoint=settings.logs_ingestion_endpoint,
            rule_id=settings.logs_dcr_immutable_id,
            stream_name=settings.logs_stream,
            credential=credential,
        )
    return SqliteHistory(settings.history_sqlite_path or DEFAULT_SQLITE_PATH)


def build_alerts(settings: CoordinatorSettings) -> AlertSink:
    """Teams through its workflow's webhook when set, else a folder of cards."""
    if settings.teams_webhook_url is not None:
        return TeamsWebhookSink(webhook_url=settings.teams_webhook_url.get_secret_value())
    return FolderCardSink(settings.cards_folder or ".local/cards")


@dataclass(frozen=True)
class ApprovalPath:
    """How approvals reach the VMs, and the hooks that keep each VM's hybrid connection (Azure Relay only)."""

    callback: ApprovalCallback
    on_new_vm: Callable[[VmIdentity], None] | None = None
    housekeeping: Callable[[dict[str, datetime], datetime], None] | None = None


def build_approval_path(
    settings: CoordinatorSettings, credential: TokenCredential, callback: ApprovalCallback | None
) -> ApprovalPath:
    """The caller's callback when it hands one in; else Azure Relay (the emulator locally), with the hybrid
    connections managed through ARM when the namespace's resource group is known."""
    if callback is not None:
        return ApprovalPath(callback)
    if not (settings.relay_namespace or settings.relay_endpoint):
        raise SettingsError(
            "no approval path: set COORDINATOR_RELAY_NAMESPACE (Azure) or COORDINATOR_RELAY_ENDPOINT (the Relay "
            "emulator)"
        )
    from coordinator.adapters.relay_sender import RelayApprovalSender  # noqa: PLC0415 -- only when Relay is configured

    endpoint = settings.relay_endpoint or f"https://{settings.relay_namespace}"
    # The sender gives up a little before the coordinator's per-approval deadline, so a listener that never answers
    # does not keep a worker of the approval pool busy much past it.
    sender = RelayApprovalSender(
        endpoint=endpoint,
        credential=credential,
        attempt_timeout=max(1.0, settings.approval_deadline_seconds - 2.0),
        max_retry_seconds=max(1.0, settings.approval_deadline_seconds - 2.0),
        not_after_tolerance=timedelta(seconds=settings.clock_tolerance_seconds),
    )
    if not (settings.relay_namespace and settings.relay_subscription_id and settings.relay_resource_group):
        return ApprovalPath(sender)
    from coordinator.adapters.relay_admin import HybridConnectionAdmin, hybrid_connections_to_delete  # noqa: PLC0415

    admin = HybridConnectionAdmin(
        credential=credential,
        subscription_id=settings.relay_subscription_id,
        resource_group=settings.relay_resource_group,
        namespace=settings.relay_namespace.split(".")[0],
        arm=ArmOptions(endpoint=settings.arm_endpoint),
    )
    silence = timedelta(seconds=settings.hybrid_connection_silence_seconds)

    def housekeeping(last_seen: dict[str, datetime], now: datetime) -> None:
        existing = [connection.name for connection in admin.list()]
        for name in hybrid_connections_to_delete(existing, last_seen=last_seen, now=now, silence_limit=silence):
            admin.delete(name)

    def on_new_vm(vm: VmIdentity) -> None:
        admin.ensure(vm)

    return ApprovalPath(sender, on_new_vm=on_new_vm, housekeeping=housekeeping)


def build_remote_acknowledge(settings: CoordinatorSettings, credential: TokenCredential) -> ApprovalCallback | None:
    """The Maintenance RP's acknowledge (preview), only when enabled."""
    if settings.remote_acknowledge == "off":
        return None
    from coordinator.adapters.remote_acknowledge import RemoteAcknowledgeSender  # noqa: PLC0415 -- only when enabled

    return RemoteAcknowledgeSender(
        credential=credential,
        endpoint=settings.arm_endpoint,
        deadline_seconds=max(1.0, settings.approval_deadline_seconds - 2.0),
        not_after_tolerance=timedelta(seconds=settings.clock_tolerance_seconds),
    )


def build_census(settings: CoordinatorSettings, credential: TokenCredential, *, needed: bool) -> Census | None:
    """ARM's census of the configured resource groups; none when unset, which a policy that ``needed`` it refuses:
    what the VMs report of themselves is theirs to forge (one shared sender identity), so tags, percent and domain
    budgets rest on ARM's census only."""
    if not settings.census_scopes:
        if needed:
            raise SettingsError(
                f"the policy {settings.policy_path} has tags, percent or domain budgets, or "
                "COORDINATOR_SUSPEND_REPAIRS is on: both read the census from ARM: set "
                "COORDINATOR_CENSUS_RESOURCE_GROUPS (the fleet's resource group ids)"
            )
        return None
    refresh = timedelta(seconds=settings.census_refresh_seconds)
    reader = ArmCensusReader(
        credential=credential, resource_groups=settings.census_scopes, arm=ArmOptions(endpoint=settings.arm_endpoint)
    )
    return Census(reader, refresh_every=refresh, usable_for=3 * refresh, index_at_read=needed)


def build_monitor(
    policies: list[Policy], credential: TokenCredential, *, arm_endpoint: str
) -> AzureMonitorReader | None:
    """Azure Monitor, read with the app's identity, only for policies (the live one, a shadow) with alert or logQuery
    gates."""
    gates = [gate for policy in policies for gate in policy.gates.values()]
    if any(gate.alert is not None or gate.logQuery is not None for gate in gates):
        return AzureMonitorReader(credential=credential, arm_endpoint=arm_endpoint)
    return None


def build_options(settings: CoordinatorSettings) -> Options:
    """The runs' options from the settings, one line each (the rest keep ``Options``' defaults)."""
    return Options(
        dry_run=settings.dry_run,
        repairs_bound=timedelta(seconds=settings.repairs_bound_seconds),
        heartbeat_timeout=timedelta(seconds=settings.heartbeat_timeout_seconds),
        approve_url=approve_links(settings.public_base_url),
        retention=timedelta(days=settings.retention_days),
        retire_grace=timedelta(seconds=settings.retire_grace_seconds),
        approval_deadline=timedelta(seconds=settings.approval_deadline_seconds),
        not_after_tolerance=timedelta(seconds=settings.clock_tolerance_seconds),
        start_bound=timedelta(seconds=settings.start_bound_seconds),
        imds_failing_after=timedelta(seconds=settings.imds_failing_seconds),
        imds_failing_errors=settings.imds_failing_poll_errors,
        remote_acknowledge_fallback=settings.remote_acknowledge == "fallback",
        in_run_delivery=timedelta(seconds=settings.in_run_delivery_seconds),
        require_attestation=settings.require_attestation,
        # The deployed coordinator runs each batch's tail after the batch (build_coordinator's after_batch).
        tail_after_batch=True,
    )


def approve_links(base: str | None) -> Callable[[str], str] | None:
    """An event's approval page on the app's public URL, for the cards; None without one (no link)."""
    if not base:
        return None

    def approve_url(event_id: str) -> str:
        return f"{base}/api/events/{quote(event_id, safe='')}/approve"

    return approve_url


def build_deliveries(settings: CoordinatorSettings, credential: TokenCredential) -> StorageQueueDeliveries | None:
    """The delivery queue, when one is configured: with the managed identity in Azure, a SAS for Azurite."""
    if settings.delivery_queue_url is None:
        return None
    sas = settings.delivery_queue_sas
    return StorageQueueDeliveries(
        queue_url=settings.delivery_queue_url,
        credential=AzureSasCredential(sas.get_secret_value()) if sas is not None else credential,
    )


def build_attestations(settings: CoordinatorSettings) -> Attestations:
    """The verifier of IMDS attested documents, from the trust-anchor settings; errors name the setting."""
    try:
        roots = load_pem_certificates(settings.attestation_trust_anchors.read_bytes(), "the trust anchors")
        intermediates = (
            load_pem_certificates(settings.attestation_intermediates.read_bytes(), "the intermediates")
            if settings.attestation_intermediates
            else ()
        )
        anchors = TrustAnchors(
            roots=roots, intermediates=intermediates, signer_domain=settings.attestation_signer_domain
        )
    except (OSError, ValueError) as error:
        raise SettingsError(
            f"COORDINATOR_ATTESTATION_TRUST_ANCHORS / COORDINATOR_ATTESTATION_INTERMEDIATES: {error}"
        ) from error
    prefixes = [p.strip() for p in settings.attestation_issuer_urls.split(",") if p.strip()]
    issuers = AiaIssuers(prefixes) if prefixes else None
    return Attestations(AttestationVerifier(anchors, issuers=issuers))
