"""Coordinator settings from the environment (pydantic-settings): COORDINATOR_* variables, errors that name them."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings, SettingsError

AZURITE = "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=secret-key;TableEndpoint=http://x"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("COORDINATOR_"):
            monkeypatch.delenv(name)


def test_variables_are_read_typed_and_secrets_stay_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDINATOR_STORAGE_CONNECTION_STRING", AZURITE)
    monkeypatch.setenv("COORDINATOR_HEARTBEAT_TIMEOUT_SECONDS", "600")
    monkeypatch.setenv("COORDINATOR_DRY_RUN", "true")
    monkeypatch.setenv("COORDINATOR_PUBLIC_BASE_URL", "https://app.example/")
    monkeypatch.setenv("COORDINATOR_TEAMS_WEBHOOK_URL", "")  # cleared in the portal: unset
    # A variable this version no longer knows (the emulator switch moved to local/) is not an error.
    monkeypatch.setenv("COORDINATOR_IMDS_EMULATOR_URL", "http://127.0.0.1:1")
    settings = CoordinatorSettings.from_env()
    assert settings.heartbeat_timeout_seconds == 600
    assert settings.dry_run is True
    assert settings.public_base_url == "https://app.example"
    assert settings.teams_webhook_url is None
    assert settings.storage_connection_string is not None
    assert "secret-key" not in repr(settings)
    assert not hasattr(settings, "imds_emulator_url")


def test_errors_name_every_variable_that_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDINATOR_HEARTBEAT_TIMEOUT_SECONDS", "ten")
    monkeypatch.setenv("COORDINATOR_TABLE_ENDPOINT", "http://tables.example")
    with pytest.raises(SettingsError) as raised:
        CoordinatorSettings.from_env()
    message = str(raised.value)
    assert message.startswith("coordinator settings: ")
    assert "COORDINATOR_HEARTBEAT_TIMEOUT_SECONDS: Input should be a valid integer" in message
    assert "COORDINATOR_TABLE_ENDPOINT: Value error, 'http://tables.example' must be an https:// URL" in message


def test_inconsistent_settings_name_the_variables_that_go_together(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="set exactly one of COORDINATOR_TABLE_ENDPOINT"):
        CoordinatorSettings.from_env()
    monkeypatch.setenv("COORDINATOR_STORAGE_CONNECTION_STRING", AZURITE)
    monkeypatch.setenv("COORDINATOR_RETIRE_GRACE_SECONDS", "300")
    with pytest.raises(SettingsError, match="COORDINATOR_RETIRE_GRACE_SECONDS must be shorter than"):
        CoordinatorSettings.from_env()


def test_the_delivery_queue_settings_go_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDINATOR_STORAGE_CONNECTION_STRING", AZURITE)
    monkeypatch.setenv("COORDINATOR_IN_RUN_DELIVERY_SECONDS", "30")
    with pytest.raises(SettingsError, match="COORDINATOR_IN_RUN_DELIVERY_SECONDS must be shorter than"):
        CoordinatorSettings.from_env()
    monkeypatch.delenv("COORDINATOR_IN_RUN_DELIVERY_SECONDS")
    monkeypatch.setenv("COORDINATOR_DELIVERY_QUEUE_SAS", "sv=2019-02-02&sig=x")
    with pytest.raises(SettingsError, match="COORDINATOR_DELIVERY_QUEUE_SAS needs COORDINATOR_DELIVERY_QUEUE_URL"):
        CoordinatorSettings.from_env()
    monkeypatch.setenv("COORDINATOR_DELIVERY_QUEUE_URL", "http://queues.example/approval-deliveries")
    with pytest.raises(SettingsError, match="COORDINATOR_DELIVERY_QUEUE_URL"):
        CoordinatorSettings.from_env()
    monkeypatch.setenv("COORDINATOR_DELIVERY_QUEUE_URL", "https://fleet.queue.core.windows.net/approval-deliveries")
    settings = CoordinatorSettings.from_env()
    assert settings.delivery_queue_sas is not None
    assert "sig=x" not in repr(settings)


def test_attestation_is_required_by_default_against_azures_roots(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from coordinator.wiring import build_attestations

    monkeypatch.setenv("COORDINATOR_STORAGE_CONNECTION_STRING", AZURITE)
    settings = CoordinatorSettings.from_env()
    assert settings.require_attestation is True
    assert settings.attestation_signer_domain == "metadata.azure.com"
    attestations = build_attestations(settings)
    assert len(attestations.verifier.anchors.roots) == 4
    # A trust-anchor file that is missing or not PEM stops the start, naming the setting.
    monkeypatch.setenv("COORDINATOR_ATTESTATION_TRUST_ANCHORS", str(tmp_path / "missing.pem"))
    with pytest.raises(SettingsError, match="COORDINATOR_ATTESTATION_TRUST_ANCHORS"):
        build_attestations(CoordinatorSettings.from_env())
    (tmp_path / "bad.pem").write_text("not a certificate")
    monkeypatch.setenv("COORDINATOR_ATTESTATION_TRUST_ANCHORS", str(tmp_path / "bad.pem"))
    with pytest.raises(SettingsError, match="not a PEM bundle of certificates"):
        build_attestations(CoordinatorSettings.from_env())
