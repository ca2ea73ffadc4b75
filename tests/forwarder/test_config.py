"""Settings: flags over environment over file, and errors that name the field, its source and the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.config import ConfigError, load_settings


def test_precedence_flags_over_environment_over_file(tmp_path: Path) -> None:
    config = tmp_path / "forwarder.yaml"
    config.write_text("sink: stdout\npoll_interval: 3\nheartbeat_interval: 30\nhook_timeout: 9\n")
    settings = load_settings(
        flags={"poll_interval": "0.5", "hook_timeout": None},
        environ={"SE_FORWARDER_POLL_INTERVAL": "2", "SE_FORWARDER_HEARTBEAT_INTERVAL": "20"},
        config_file=config,
    )
    assert settings.poll_interval == 0.5  # flag
    assert settings.heartbeat_interval == 20  # environment over file
    assert settings.hook_timeout == 9  # file (a None flag means "not given")
    assert settings.sink == "stdout"


def test_config_file_from_environment_and_json(tmp_path: Path) -> None:
    config = tmp_path / "forwarder.json"
    config.write_text(json.dumps({"sink": "jsonl", "jsonl_path": str(tmp_path / "out.jsonl")}))
    settings = load_settings(environ={"SE_FORWARDER_CONFIG": str(config)})
    assert settings.jsonl_path == tmp_path / "out.jsonl"


def test_bad_value_names_field_source_and_reason() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(flags={"sink": "stdout"}, environ={"SE_FORWARDER_POLL_INTERVAL": "0"})
    message = str(caught.value)
    assert "poll_interval = '0'" in message
    assert "environment SE_FORWARDER_POLL_INTERVAL" in message
    assert "greater than or equal to 0.05" in message


def test_eventhub_sink_needs_a_target() -> None:
    with pytest.raises(ConfigError, match="eventhub_namespace and eventhub_name"):
        load_settings(environ={})


def test_managed_identity_target_is_enough() -> None:
    settings = load_settings(
        environ={"SE_FORWARDER_EVENTHUB_NAMESPACE": "ns.servicebus.windows.net", "SE_FORWARDER_EVENTHUB_NAME": "se"}
    )
    assert settings.sink == "eventhub"
    assert settings.relay_enabled is False


def test_connection_string_is_never_echoed() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(
            flags={"eventhub_connection_string": "Endpoint=sb://x;SharedAccessKey=TOPSECRET", "poll_interval": "-1"},
            environ={},
        )
    assert "TOPSECRET" not in str(caught.value)
    settings = load_settings(
        flags={"eventhub_connection_string": "Endpoint=sb://x;SharedAccessKey=TOPSECRET"}, environ={}
    )
    assert "TOPSECRET" not in repr(settings)


def test_unknown_keys_are_errors(tmp_path: Path) -> None:
    config = tmp_path / "forwarder.yaml"
    config.write_text("sink: stdout\npoll_intervall: 1\n")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) poll_intervall"):
        load_settings(config_file=config, environ={})
    with pytest.raises(ConfigError, match="SE_FORWARDER_SINKK"):
        load_settings(environ={"SE_FORWARDER_SINKK": "stdout"})


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_settings(config_file=tmp_path / "missing.yaml", environ={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("sink: [stdout\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(config_file=broken, environ={})
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_settings(config_file=listing, environ={})


def test_relay_settings() -> None:
    with pytest.raises(ConfigError, match="relay_enabled needs relay_namespace"):
        load_settings(flags={"sink": "stdout", "relay_enabled": True}, environ={})
    settings = load_settings(
        flags={"sink": "stdout"},
        environ={"SE_FORWARDER_RELAY_ENABLED": "true", "SE_FORWARDER_RELAY_NAMESPACE": "ns.servicebus.windows.net"},
    )
    assert settings.relay_enabled is True
    assert settings.relay_hybrid_connection is None  # defaults to VmIdentity.hybrid_connection_name at start


def test_imds_url_must_be_plain_http() -> None:
    with pytest.raises(ConfigError, match="imds_url"):
        load_settings(flags={"sink": "stdout", "imds_url": "https://169.254.169.254"}, environ={})


def test_relay_listener_mode_and_grace() -> None:
    settings = load_settings(flags={"sink": "stdout"}, environ={})
    assert (settings.relay_listener_mode, settings.relay_listener_grace_seconds) == ("on-demand", 60.0)
    settings = load_settings(
        flags={"sink": "stdout"},
        environ={"SE_FORWARDER_RELAY_LISTENER_MODE": "always-on", "SE_FORWARDER_RELAY_LISTENER_GRACE_SECONDS": "5"},
    )
    assert (settings.relay_listener_mode, settings.relay_listener_grace_seconds) == ("always-on", 5.0)
    with pytest.raises(ConfigError, match=r"relay_listener_mode = 'sometimes' \(from environment SE_FORWARDER_"):
        load_settings(flags={"sink": "stdout"}, environ={"SE_FORWARDER_RELAY_LISTENER_MODE": "sometimes"})
    with pytest.raises(ConfigError, match=r"relay_listener_grace_seconds = -1 \(from flag --relay-listener-grace"):
        load_settings(flags={"sink": "stdout", "relay_listener_grace_seconds": -1}, environ={})


def test_the_yaml_file_is_read_without_loading_its_parser_into_the_daemon(tmp_path: Path) -> None:
    """PyYAML stays resident once imported: the daemon reads its settings file through a child interpreter."""
    config = tmp_path / "forwarder.yaml"
    config.write_text("sink: stdout\npoll_interval: 3\n# a comment\nhooks_dir: 'hooks dir'\n")
    script = (
        "import sys; from pathlib import Path; from forwarder.config import load_settings;"
        f"s = load_settings(config_file=Path({str(config)!r}), environ={{}});"
        "print(s.sink, s.poll_interval, s.hooks_dir, 'yaml' in sys.modules)"
    )
    shown = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    ).stdout.split()

    assert shown == ["stdout", "3.0", "hooks", "dir", "False"]


def test_a_yaml_reader_that_cannot_start_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "forwarder.yaml"
    config.write_text("sink: stdout\n")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))

    with pytest.raises(ConfigError, match=r"forwarder\.yaml: could not be read as YAML"):
        load_settings(config_file=config, environ={})
