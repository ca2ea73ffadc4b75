"""Forwarder settings: command-line flags over environment (SE_FORWARDER_*) over a YAML/JSON file over defaults.

Validated with contracts/checks.py (the standard library: no pydantic on the VM); a bad value fails at start with
one line naming the field, where it came from and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from contracts.checks import Choice, Flag, Invalid, Maybe, Number, Record, Text, spec
from contracts.setting_checks import FilePath, Secret, SecretText
from forwarder.imds import DEFAULT_IMDS_URL, FIRST_CALL_TIMEOUT

ENV_PREFIX = "SE_FORWARDER_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

SinkKind = Literal["eventhub", "stdout", "jsonl"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
ListenerMode = Literal["on-demand", "always-on"]


class ConfigError(ValueError):
    """The configuration is unusable; the message names the field, its source and the reason."""


def _number(*, integer: bool = False, **bounds: float) -> Number:
    return Number(integer=integer, lax=True, **bounds)


@dataclass(frozen=True, kw_only=True)
class ForwarderSettings(Record):
    """Every setting, with the description ``python -m forwarder run --help`` shows (docs/forwarder.md's table)."""

    EXTRA = "forbid"

    # IMDS
    imds_url: str = spec(
        Text(pattern="^http://[^/?#]+(/[^?#]*)?$"),
        DEFAULT_IMDS_URL,
        description="IMDS root, or an emulator's per-VM base URL (http://127.0.0.1:PORT/vm/NAME)",
    )
    poll_interval: float = spec(
        _number(ge=0.05, le=60),
        1.0,
        description="seconds between reads of the document",
    )
    imds_timeout: float = spec(
        _number(gt=0, le=120),
        10.0,
        description="seconds an IMDS request may take",
    )
    imds_first_call_timeout: float = spec(
        _number(gt=0, le=600),
        FIRST_CALL_TIMEOUT,
        description="seconds the first Scheduled Events call (and the first after 24 h without one) may take: IMDS may "
        "need up to 2 minutes to wake the service up",
    )
    # Send IMDS attested documents (forwarder/attestor.py): with every envelope, one for the forwarder's state; with
    # every approval answer, one for the decision. Envelopes wait in the spool until the first one is had. Off only
    # where the IMDS has no attested endpoint (a coordinator requiring attestation then refuses what is sent).
    attest: bool = spec(
        Flag(lax=True),
        True,
        description="send IMDS attested documents with every envelope and approval answer (off only where IMDS has no "
        "attested endpoint: a coordinator that requires attestation then refuses what is sent)",
    )
    not_after_tolerance: float = spec(
        _number(ge=0, le=60),
        2.0,
        description="seconds this VM's clock may disagree with the coordinator's: the listener refuses an approval from"
        " this long before its notAfter (the coordinator's COORDINATOR_CLOCK_TOLERANCE_SECONDS must match)",
    )
    # State (spool, sequence, hook ledger)
    state_dir: Path = spec(
        FilePath(),
        Path("/var/lib/scheduled-events-forwarder"),
        description="the SQLite spool, sequence and hook ledger (the unit's StateDirectory)",
    )
    spool_max_entries: int = spec(
        _number(integer=True, ge=1, le=10000000),
        10000,
        description="envelopes kept while Event Hubs cannot be reached; when full, heartbeats are dropped first, then "
        "the oldest others (logged, counted)",
    )
    heartbeat_interval: float = spec(
        _number(gt=0, le=3600),
        60.0,
        description="seconds between heartbeats",
    )
    # Where envelopes go
    sink: SinkKind = spec(
        Choice(get_args(SinkKind)),
        "eventhub",
        description="where envelopes go: Event Hubs, stdout or a JSON-lines file (jsonl_path)",
    )
    jsonl_path: Path | None = spec(
        Maybe(FilePath()),
        None,
        description="the file of the jsonl sink",
    )
    eventhub_namespace: str | None = spec(
        Maybe(Text(pattern="^[A-Za-z0-9.-]+(:\\d+)?$")),
        None,
        description="fully qualified Event Hubs namespace (NS.servicebus.windows.net), reached with the VM's managed "
        "identity",
    )
    eventhub_name: str | None = spec(
        Maybe(Text(min_length=1, max_length=256)),
        None,
        description="the event hub",
    )
    eventhub_connection_string: Secret | None = spec(
        Maybe(SecretText()),
        None,
        description="instead of the managed identity: a SAS connection string, or the local emulator's; never echoed "
        "(prefer the environment variable: a flag shows in ps)",
    )
    managed_identity_client_id: str | None = spec(
        Maybe(Text()),
        None,
        description="a user-assigned identity's client id; the system-assigned identity when unset",
    )
    eventhub_use_tls: bool = spec(
        Flag(lax=True),
        True,
        description="TLS to Event Hubs; off only for a local emulator reached by namespace, not by connection string",
    )
    send_batch_max: int = spec(
        _number(integer=True, ge=1, le=1000),
        100,
        description="envelopes per Event Hubs batch when the spool is replayed",
    )
    # Hooks
    hooks_dir: Path = spec(
        FilePath(),
        Path("/etc/scheduled-events/hooks"),
        description="holds prepare.d/ and recover.d/, whose hooks run in name order, and force.d/, the hooks a "
        "force request may name",
    )
    hook_timeout: float = spec(
        _number(gt=0, le=3600),
        120.0,
        description="the most seconds a hook is given (its budget is less when NotBefore is nearer); at its budget "
        "it gets SIGTERM, then SIGKILL after hook_kill_grace (its phase fails)",
    )
    hook_deadline_margin: float = spec(
        _number(ge=0, le=600),
        5.0,
        description="seconds before the event's NotBefore by which every prepare hook has been stopped",
    )
    hook_kill_grace: float = spec(
        _number(ge=0, le=60),
        3.0,
        description="seconds between a hook's SIGTERM at its budget and its SIGKILL",
    )
    # Proof of impact (forwarder/impact.py)
    impact_tick: float = spec(
        _number(ge=0.01, le=5),
        0.1,
        description="seconds between the clock readings that measure a Freeze's pause (only while one is listed)",
    )
    boot_time_file: Path = spec(
        FilePath(),
        Path("/proc/stat"),
        description="where the VM's boot time is read (its 'btime' line), to tell a reboot from a restart",
    )
    # Azure Relay listener (approvals back to this VM)
    relay_enabled: bool = spec(
        Flag(lax=True),
        False,
        description="run the relay listener, which carries the coordinator's approvals to IMDS",
    )
    relay_namespace: str | None = spec(
        Maybe(Text(pattern="^[A-Za-z0-9.-]+(:\\d+)?$")),
        None,
        description="fully qualified Azure Relay namespace (NS.servicebus.windows.net)",
    )
    relay_hybrid_connection: str | None = spec(
        Maybe(Text(min_length=1, max_length=260)),
        None,
        description="this VM's hybrid connection; unset: vm-{vmId}, the one the coordinator sends to",
    )
    relay_endpoint: str | None = spec(
        Maybe(Text()),
        None,
        description="full listener base URI (default wss://RELAY_NAMESPACE); only for the local Relay emulator",
    )
    # "on-demand": the listener is connected only while this VM's document holds a Scheduled event it could
    # execute, plus relay_listener_grace_seconds (a listener hour is billed while connected: $9.78 a month always
    # on, cents on demand; docs/relay.md). "always-on": connected for the daemon's whole life.
    relay_listener_mode: ListenerMode = spec(
        Choice(get_args(ListenerMode)),
        "on-demand",
        description="on-demand: connected only while the document holds a Scheduled event this VM could approve, plus "
        "the grace (a listener is billed per connected hour); always-on: for the daemon's life",
    )
    # 60 s = twice the coordinator's approval deadline (COORDINATOR_APPROVAL_DEADLINE_SECONDS, 30 s): a request
    # still in flight when the event started gets its answer instead of 503s until its deadline, and an event that
    # follows another within a minute reuses the connection. It costs 60 s of listener time per event ($0.0002).
    relay_listener_grace_seconds: float = spec(
        _number(ge=0, le=3600),
        60.0,
        description="on demand, seconds the listener stays after the last such event is gone or Started",
    )
    log_level: LogLevel = spec(
        Choice(get_args(LogLevel)),
        "INFO",
        description="the JSON log lines' least level, on stderr",
    )
    # Tracing (forwarder/telemetry.py): finished spans appended here as JSON lines; unset = nothing recorded (the
    # trace context is still created and sent). On a VM it must be under state_dir, the unit's one writable place.
    telemetry_spans_file: Path | None = spec(
        Maybe(FilePath()),
        None,
        description="append finished spans here as JSON lines (on a VM, under state_dir); unset: none recorded",
    )

    def validate(self) -> None:
        problem = self._inconsistency()
        if problem:
            raise Invalid([("", problem)])

    def _inconsistency(self) -> str:
        if self.sink == "jsonl" and self.jsonl_path is None:
            return "sink 'jsonl' needs jsonl_path"
        managed_identity_target = self.eventhub_namespace and self.eventhub_name
        if self.sink == "eventhub" and self.eventhub_connection_string is None and not managed_identity_target:
            return (
                "sink 'eventhub' needs eventhub_namespace and eventhub_name (managed identity) "
                "or eventhub_connection_string"
            )
        if self.relay_enabled and not (self.relay_namespace or self.relay_endpoint):
            return "relay_enabled needs relay_namespace"
        return ""

    @property
    def spool_path(self) -> Path:
        return self.state_dir / "forwarder.sqlite"


FIELDS = tuple(f.name for f in ForwarderSettings.specs())


# The YAML settings are read by a child interpreter (``_yaml_mapping``): PyYAML loaded in the daemon stays resident
# for its whole life, 0.94 MiB measured (python -m benchmarks.forwarder_footprint runs the unit's --config), for a file
# read once at start; the child's start (~0.1 s) is paid once. It prints the document as JSON, or the YAML error.
_YAML_TO_JSON = """
import json, sys
import yaml
try:
    data = yaml.safe_load(sys.stdin.buffer)
except yaml.YAMLError as error:
    sys.stderr.write(str(error))
    sys.exit(3)
json.dump(data, sys.stdout, default=str)
"""
YAML_READ_SECONDS = 30


def _yaml_mapping(path: Path, text: bytes) -> Any:
    """The YAML document ``text`` (of ``path``) as Python values, parsed by PyYAML in a child interpreter."""
    try:
        done = subprocess.run(  # noqa: S603 - this interpreter, a fixed script, the file's bytes on stdin
            [sys.executable, "-I", "-c", _YAML_TO_JSON],
            input=text,
            capture_output=True,
            timeout=YAML_READ_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"config file {path}: could not be read as YAML: {exc}") from None
    problem = done.stderr.decode("utf-8", "replace").strip()
    if done.returncode == 3:
        raise ConfigError(f"config file {path}: not valid YAML: {problem}")
    if done.returncode != 0:
        raise ConfigError(f"config file {path}: could not be read as YAML: {problem[-500:]}")
    return json.loads(done.stdout)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot be read: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        data = _yaml_mapping(path, text)
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"config file {path}: not valid JSON: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of setting names to values")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    return data


def load_settings(
    *,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> ForwarderSettings:
    """Merge the three sources (flags win, then SE_FORWARDER_*, then the file) and validate.

    `config_file` defaults to $SE_FORWARDER_CONFIG; None values in `flags` mean "not given".
    """
    environ = os.environ if environ is None else environ
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    if config_file is None and environ.get(CONFIG_ENV):
        config_file = Path(environ[CONFIG_ENV])
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    if config_file is not None:
        for key, value in _read_file(config_file).items():
            merged[key], source[key] = value, f"config file {config_file}"
    unknown_env = sorted(
        k
        for k in environ
        if k.startswith(ENV_PREFIX) and k != CONFIG_ENV and k[len(ENV_PREFIX) :].lower() not in FIELDS
    )
    if unknown_env:
        raise ConfigError(f"unknown environment setting(s) {', '.join(unknown_env)}")
    for key in FIELDS:
        env_key = ENV_PREFIX + key.upper()
        if env_key in environ:
            merged[key], source[key] = environ[env_key], f"environment {env_key}"
    for key, value in flags.items():
        if key not in FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        merged[key], source[key] = value, f"flag --{key.replace('_', '-')}"
    try:
        return ForwarderSettings.from_mapping(merged)
    except Invalid as exc:
        problems = []
        for loc, message in exc.problems:
            field = loc.partition(".")[0]
            if field:
                shown = "<secret>" if field == "eventhub_connection_string" else repr(merged.get(field))
                problems.append(f"{field} = {shown} (from {source.get(field, 'default')}): {message}")
            else:
                problems.append(message.removeprefix("Value error, "))
        raise ConfigError("invalid forwarder configuration: " + "; ".join(problems)) from None
