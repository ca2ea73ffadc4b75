"""Wiring (coordinator/wiring.py): the one place that picks the parts from the settings: Azurite or a managed
identity for state, SQLite or Logs Ingestion for history, a cards folder or Teams, the Relay (or a given callback),
remote acknowledge, Azure Monitor only for a policy that reads it; each setting reaches the coordinator.

The Table client creates its tables as it is built (a network call): a stand-in keeps the state in memory and notes
how it was reached. Everything else is the real part, built without touching the network."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest

from coordinator import wiring
from coordinator.adapters import deadline, relay_admin, remote_acknowledge
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.census import ArmCensusReader
from coordinator.adapters.delivery_queue import StorageQueueDeliveries
from coordinator.adapters.gates import AzureMonitorReader
from coordinator.adapters.history import LogsIngestionHistory, SqliteHistory
from coordinator.adapters.relay_sender import RelayApprovalSender
from coordinator.adapters.remote_acknowledge import RemoteAcknowledgeSender
from coordinator.adapters.teams import FolderCardSink, TeamsWebhookSink
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings, SettingsError
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingCallback

AZURITE = "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=secret-key;TableEndpoint=http://x"


@dataclass
class Reached:
    how: str
    where: str
    table: str
    credential: Any = None
    session: Any = None


class LocalTables:
    """Stands in for ``TableStateStore``'s constructors: notes how the state was reached, gives an in-memory store."""

    reached: ClassVar[list[Reached]] = []

    @classmethod
    def from_connection_string(cls, connection_string: str, *, table_name: str, session: Any) -> MemoryStateStore:
        cls.reached.append(Reached("connection string", connection_string, table_name, session=session))
        return MemoryStateStore()

    @classmethod
    def from_endpoint(cls, endpoint: str, *, credential: Any, table_name: str, session: Any) -> MemoryStateStore:
        cls.reached.append(Reached("endpoint", endpoint, table_name, credential, session))
        return MemoryStateStore()


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only what each test sets: no COORDINATOR_* variable of the machine's leaks in.
    for name in list(os.environ):
        if name.startswith("COORDINATOR_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(wiring, "TableStateStore", LocalTables)
    LocalTables.reached = []


def settings(monkeypatch: pytest.MonkeyPatch, **variables: str) -> CoordinatorSettings:
    for name, value in variables.items():
        monkeypatch.setenv(f"COORDINATOR_{name.upper()}", value)
    return CoordinatorSettings.from_env()


@pytest.fixture
def local(tmp_path: Path) -> dict[str, str]:
    """The local mode's settings (scripts/local.sh): Azurite, SQLite, a cards folder, the Relay emulator."""
    return {
        "storage_connection_string": AZURITE,
        "state_table": "localstate",
        "history_sqlite_path": str(tmp_path / "history.sqlite"),
        "cards_folder": str(tmp_path / "cards"),
        "relay_endpoint": "http://127.0.0.1:9",
        "public_base_url": "http://127.0.0.1:7071",
    }


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Coordinator]]:
    """``build(variables, callback=...)``: the coordinator those settings wire; its SQLite history closed after."""
    made: list[Coordinator] = []

    def build_from(variables: dict[str, str], **kwargs: Any) -> Coordinator:
        made.append(wiring.build_coordinator(settings(monkeypatch, **variables), **kwargs))
        return made[-1]

    yield build_from
    for coordinator in made:
        if isinstance(coordinator.parts.history, SqliteHistory):
            coordinator.parts.history.close()


def test_the_local_mode_gets_azurite_sqlite_a_cards_folder_and_the_relay_emulator(build, local, tmp_path):
    coordinator = build(local)
    # Its table clients' sessions are the deadline module's (the environment's proxies read once per host).
    assert LocalTables.reached == [Reached("connection string", AZURITE, "localstate", session=deadline.session)]
    assert isinstance(coordinator.parts.store, MemoryStateStore)
    assert isinstance(coordinator.parts.history, SqliteHistory)
    assert coordinator.parts.history.path == tmp_path / "history.sqlite"
    assert isinstance(coordinator.parts.alerts, FolderCardSink)
    assert coordinator.parts.alerts.folder == tmp_path / "cards"
    assert isinstance(coordinator.parts.callback, RelayApprovalSender)
    # Without a namespace there is no hybrid connection to manage, no remote acknowledge, no monitor to read.
    assert coordinator.on_new_vm is None
    assert (coordinator.parts.remote_acknowledge, coordinator.options.remote_acknowledge_fallback) == (None, False)
    assert coordinator.parts.monitor is None
    assert coordinator.policy == load_policy(DEFAULT_POLICY_PATH)
    # The parts make a coordinator that runs: a tick on an empty fleet.
    coordinator.parts = replace(coordinator.parts, clock=lambda: DOC_NOW)
    assert coordinator.tick().as_dict()["open_events"] == 0


def test_every_timing_and_switch_reaches_the_runs_options(build, local):
    variables = {
        **local,
        "dry_run": "true",
        "heartbeat_timeout_seconds": "600",
        "retire_grace_seconds": "200",
        "approval_deadline_seconds": "20",
        "start_bound_seconds": "120",
        "imds_failing_seconds": "90",
        "imds_failing_poll_errors": "30",
        "retention_days": "7",
    }
    coordinator = build(variables)
    options = coordinator.options
    assert options.dry_run is True
    assert options.heartbeat_timeout == timedelta(seconds=600)
    assert options.retire_grace == timedelta(seconds=200)
    assert options.approval_deadline == timedelta(seconds=20)
    assert options.start_bound == timedelta(seconds=120)
    assert options.imds_failing_after == timedelta(seconds=90)
    assert options.imds_failing_errors == 30
    assert options.retention == timedelta(days=7)
    assert options.approve_url is not None
    # An EventId is one path segment, whatever it holds.
    assert options.approve_url("EV/1 ?") == "http://127.0.0.1:7071/api/events/EV%2F1%20%3F/approve"
    # A batch's tail runs after it, on the coordinator's own threads.
    assert options.tail_after_batch is True
    assert coordinator.after_batch is not None


def test_without_a_public_url_cards_carry_no_approve_link(build, local):
    coordinator = build({k: v for k, v in local.items() if k != "public_base_url"})
    assert coordinator.options.approve_url is None


def test_a_given_callback_is_the_approval_path_and_the_relay_is_not_needed(build, local):
    callback = RecordingCallback()
    coordinator = build({k: v for k, v in local.items() if k != "relay_endpoint"}, callback=callback)
    assert coordinator.parts.callback is callback


def test_no_approval_path_at_all_is_a_settings_error_naming_the_variables(monkeypatch, local):
    variables = {k: v for k, v in local.items() if k != "relay_endpoint"}
    with pytest.raises(SettingsError, match=r"COORDINATOR_RELAY_NAMESPACE .* COORDINATOR_RELAY_ENDPOINT"):
        wiring.build_coordinator(settings(monkeypatch, **variables))


def test_azure_gets_a_managed_identity_teams_logs_ingestion_and_the_relay_with_its_connections(build):
    variables = {
        "table_endpoint": "https://fleet.table.core.windows.net",
        "state_table": "fleetstate",
        "teams_webhook_url": "https://prod.example/workflows/x?sig=secret",
        "logs_ingestion_endpoint": "https://dce.norwayeast.ingest.monitor.azure.com",
        "logs_dcr_immutable_id": "dcr-0123",
        "relay_namespace": "fleet-relay.servicebus.windows.net",
        "relay_subscription_id": "00000000-0000-0000-0000-000000000001",
        "relay_resource_group": "rg-fleet",
        "remote_acknowledge": "fallback",
    }
    coordinator = build(variables)
    [reached] = LocalTables.reached
    assert (reached.how, reached.where, reached.table) == ("endpoint", variables["table_endpoint"], "fleetstate")
    assert reached.credential is not None
    assert reached.session is deadline.session
    assert isinstance(coordinator.parts.history, LogsIngestionHistory)
    assert isinstance(coordinator.parts.alerts, TeamsWebhookSink)
    assert isinstance(coordinator.parts.callback, RelayApprovalSender)
    # Each new VM gets its hybrid connection (the namespace, subscription and resource group say where).
    assert coordinator.on_new_vm is not None
    assert isinstance(coordinator.parts.remote_acknowledge, RemoteAcknowledgeSender)
    assert coordinator.options.remote_acknowledge_fallback is True


@pytest.mark.parametrize(("mode", "sender", "fallback"), [("off", False, False), ("rules", True, False)])
def test_remote_acknowledge_is_built_only_when_on_and_falls_back_only_when_told(build, local, mode, sender, fallback):
    coordinator = build({**local, "remote_acknowledge": mode})
    assert isinstance(coordinator.parts.remote_acknowledge, RemoteAcknowledgeSender) is sender
    assert coordinator.options.remote_acknowledge_fallback is fallback


def test_azure_monitor_is_read_only_for_a_policy_with_alert_or_log_query_gates(build, local, tmp_path):
    policy = tmp_path / "gated.yaml"
    policy.write_text(
        """
version: 1
gates:
  errors:
    logQuery: {workspaceId: 00000000-0000-0000-0000-0000000000aa, query: "AppRequests | where Success == false"}
rules:
  - name: gated
    action: approve-now
    gates: [errors]
"""
    )
    coordinator = build({**local, "policy_path": str(policy)})
    assert isinstance(coordinator.parts.monitor, AzureMonitorReader)
    assert [rule.name for rule in coordinator.policy.rules] == ["gated"]


def test_the_delivery_queue_is_built_with_the_managed_identity_or_an_azurite_sas(build, local):
    """Approvals a run could not deliver in its few seconds continue through the delivery queue; without one, each
    run waits the whole deadline (as before the queue)."""
    assert build(local).parts.deliveries is None
    azure = build(
        {**local, "delivery_queue_url": "https://fleet.queue.core.windows.net/approval-deliveries/"},
    )
    assert isinstance(azure.parts.deliveries, StorageQueueDeliveries)
    assert azure.parts.deliveries.queue_url == "https://fleet.queue.core.windows.net/approval-deliveries"
    assert azure.options.in_run_delivery == timedelta(seconds=3)
    azurite = build(
        {
            **local,
            "delivery_queue_url": "http://127.0.0.1:10001/devstoreaccount1/approval-deliveries",
            "delivery_queue_sas": "sv=2019-02-02&sig=x",
            "in_run_delivery_seconds": "1.5",
        }
    )
    assert isinstance(azurite.parts.deliveries, StorageQueueDeliveries)
    assert azurite.options.in_run_delivery == timedelta(seconds=1.5)


def test_every_arm_client_reaches_the_one_arm_endpoint_setting(build, monkeypatch, tmp_path):
    """A sovereign cloud's ARM (or the local emulator's) is one setting: the census, the hybrid connections'
    management, the Maintenance RP's acknowledge and the alert gates all reach it (the hybrid connections and the
    alert gates went to the public cloud's, whatever it said)."""
    reached: dict[str, str] = {}

    def noting(name: str, real: Any, key: str) -> Callable[..., Any]:
        def made(**kwargs: Any) -> Any:
            value = kwargs[key]
            reached[name] = value.endpoint if isinstance(value, ArmOptions) else value
            return real(**kwargs)

        return made

    monkeypatch.setattr(wiring, "ArmCensusReader", noting("census", ArmCensusReader, "arm"))
    monkeypatch.setattr(wiring, "AzureMonitorReader", noting("gates", AzureMonitorReader, "arm_endpoint"))
    monkeypatch.setattr(
        relay_admin,
        "HybridConnectionAdmin",
        noting("hybrid connections", relay_admin.HybridConnectionAdmin, "arm"),
    )
    monkeypatch.setattr(
        remote_acknowledge,
        "RemoteAcknowledgeSender",
        noting("acknowledge", remote_acknowledge.RemoteAcknowledgeSender, "endpoint"),
    )
    policy = tmp_path / "gated.yaml"
    policy.write_text(
        "version: 1\ngates:\n  alerts: {alert: {alertRuleId: /subscriptions/00000000-0000-0000-0000-000000000001/"
        "resourceGroups/rg/providers/microsoft.insights/metricAlerts/cpu}}\n"
        "rules:\n  - {name: gated, action: approve-now, gates: [alerts]}\n"
    )
    sovereign = "https://management.usgovcloudapi.net"
    build(
        {
            "table_endpoint": "https://fleet.table.core.usgovcloudapi.net",
            "relay_namespace": "fleet-relay.servicebus.usgovcloudapi.net",
            "relay_subscription_id": "00000000-0000-0000-0000-000000000001",
            "relay_resource_group": "rg-fleet",
            "remote_acknowledge": "rules",
            "census_resource_groups": "/subscriptions/00000000-0000-0000-0000-000000000001/resourceGroups/rg-vms",
            "arm_endpoint": sovereign,
            "policy_path": str(policy),
        }
    )
    assert reached == dict.fromkeys(("census", "gates", "hybrid connections", "acknowledge"), sovereign)
