"""`python -m forwarder run|once`: the daemon and a one-shot look at what IMDS says.

Every setting is also a flag (`--poll-interval 0.5`), an environment variable (SE_FORWARDER_POLL_INTERVAL) or a
key of the --config file; flags win over the environment, which wins over the file.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import Field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from contracts.checks import Check, Choice, Flag, Maybe, Number
from contracts.wire import VmIdentity
from forwarder import __version__, logs
from forwarder.config import ENV_PREFIX, FIELDS, ConfigError, ForwarderSettings, load_settings
from forwarder.credential import RELAY_SCOPE, ImdsManagedIdentityCredential, TokenCredential
from forwarder.daemon import Companion, Forwarder
from forwarder.durable_state import Store, open_store
from forwarder.imds import ImdsClient, ImdsError
from forwarder.logs import fields
from forwarder.on_demand import ListenerSession, OnDemandListener
from forwarder.sinks import JsonLinesSink, Sink
from forwarder.telemetry import Telemetry

if TYPE_CHECKING:
    from forwarder.approver import Approver
    from forwarder.force import ForceHooks
    from forwarder.relay_listener import RelayListener
    from forwarder.relay_tokens import EntraTokenProvider

log = logging.getLogger("forwarder")

EXIT_CONFIG = 2
EXIT_IMDS = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m forwarder", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the daemon (poll IMDS, forward changes, run hooks)")
    once = commands.add_parser("once", help="print the current document and this VM's identity as JSON")
    for sub in (run, once):
        sub.add_argument("--config", type=Path, help=f"YAML or JSON settings file (also ${ENV_PREFIX}CONFIG)")
    for name in FIELDS:
        flag = "--" + name.replace("_", "-")
        if isinstance(_check(name), Flag):
            run.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=_help(name))
        else:
            run.add_argument(flag, dest=name, default=None, metavar=_metavar(name), help=_help(name))
    for name in ("imds_url", "imds_first_call_timeout"):
        once.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=None, metavar=_metavar(name), help=_help(name)
        )
    return parser


def _setting(name: str) -> Field[Any]:
    return next(f for f in ForwarderSettings.specs() if f.name == name)


def _check(name: str) -> Check:
    check: Check = _setting(name).metadata["check"]
    return check.inner if isinstance(check, Maybe) else check


def _metavar(name: str) -> str:
    check = _check(name)
    return "{" + ",".join(check.values) + "}" if isinstance(check, Choice) else name.upper()


def _help(name: str) -> str:
    """The setting's description, its allowed values or bounds, its default and its environment variable. Not an
    argparse choices list: every source (flag, environment, file) is validated alike, with the same message."""
    info, check = _setting(name), _check(name)
    facts = []
    if isinstance(check, Choice):
        facts.append("one of " + ", ".join(check.values))
    if isinstance(check, Number):
        bounds = {">=": check.ge, ">": check.gt, "<=": check.le}
        facts.extend(f"{sign} {_plain(bound)}" for sign, bound in bounds.items() if bound is not None)
    facts.append("no default" if info.default is None else f"default {info.default}")
    facts.append(f"${ENV_PREFIX}{name.upper()}")
    return f"{info.metadata['description']} ({'; '.join(facts)})".replace("%", "%%")


def _plain(bound: float) -> str:
    """A bound as it was written (60, not 60.0)."""
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def build_credential(settings: ForwarderSettings, imds: ImdsClient) -> TokenCredential:
    """The VM's managed identity (user-assigned when managed_identity_client_id is set), shared by the Event Hubs
    producer and the relay listener."""
    return ImdsManagedIdentityCredential(imds=imds, client_id=settings.managed_identity_client_id)


def build_sink(settings: ForwarderSettings, imds: ImdsClient) -> Sink:
    if settings.sink == "stdout":
        return JsonLinesSink(stream=sys.stdout)
    if settings.sink == "jsonl":
        assert settings.jsonl_path is not None  # checked by ForwarderSettings
        return JsonLinesSink(path=settings.jsonl_path)
    from forwarder.eventhub import EventHubSink  # noqa: PLC0415 - loaded (with ssl) only when this sink is chosen

    if settings.eventhub_connection_string is not None:
        return EventHubSink.from_connection_string(
            settings.eventhub_connection_string.get_secret_value(), eventhub_name=settings.eventhub_name
        )
    # Both checked by ForwarderSettings.
    assert settings.eventhub_namespace
    assert settings.eventhub_name
    return EventHubSink.with_credential(
        fully_qualified_namespace=settings.eventhub_namespace,
        eventhub_name=settings.eventhub_name,
        credential=build_credential(settings, imds),
        use_tls=settings.eventhub_use_tls,
    )


class _Sessions:
    """What every listener session of this daemon shares: one credential (its cached token keeps token calls off the
    POST's IMDS rate limit, +0.5 s) and one ``Approver`` (its lock serialises approvals; its decision ledger is the
    store's), with the listener's modules. ``warm`` loads them in the background at start rather than the first
    session: an event's session then connects while its envelope travels instead of after ~20 ms of imports (~120 ms
    in a busy process), which the coordinator's approval often won (a "no listener" 503, then a retry). Most real
    approvals are their daemon's first (events are rare; a Reboot or Redeploy restarts it). The idle daemon then holds
    what the connected one does: 28.4 MiB where it was 27.2 at 6e7b082 (benchmarks/forwarder_footprint.py)."""

    def __init__(
        self,
        settings: ForwarderSettings,
        identity: VmIdentity,
        imds: ImdsClient,
        *,
        store: Store | None,
        telemetry: Telemetry | None,
        force: ForceHooks | None,
    ) -> None:
        self._settings, self._identity, self._imds = settings, identity, imds
        self._store, self._telemetry, self._force = store, telemetry, force
        self.endpoint = settings.relay_endpoint or f"wss://{settings.relay_namespace}"
        self.hybrid_connection = settings.relay_hybrid_connection or identity.hybrid_connection_name
        self._credential = build_credential(settings, imds)
        self._made: tuple[type[RelayListener], type[EntraTokenProvider], Approver] | None = None
        self._lock = threading.Lock()

    def warm(self) -> None:
        """The session's parts, then the Relay token (cached about a day by the credential: a cold approval's session
        then needs no IMDS token call before its GET and StartRequests POST, measured +0.5 s without). The parts
        first: they need no IMDS, so an IMDS that cannot give a token at start still leaves them loaded."""
        self._parts()
        self._credential.get_token(RELAY_SCOPE)

    def session(self) -> ListenerSession:
        listener_class, tokens, approver = self._parts()
        return listener_class(
            endpoint=self.endpoint,
            hybrid_connection=self.hybrid_connection,
            token_provider=tokens(credential=self._credential),
            handler=approver,
        )

    def _parts(self) -> tuple[type[RelayListener], type[EntraTokenProvider], Approver]:
        from forwarder.approval_rules import Freshness  # noqa: PLC0415
        from forwarder.approver import Approver  # noqa: PLC0415
        from forwarder.relay_listener import RelayListener  # noqa: PLC0415
        from forwarder.relay_tokens import EntraTokenProvider  # noqa: PLC0415

        with self._lock:
            if self._made is None:
                settings, store, imds = self._settings, self._store, self._imds
                approver = Approver(
                    imds=imds,
                    vm_name=self._identity.name,
                    prepare_outcome=(lambda event_id: store.hook_outcome(event_id, "prepare")) if store else None,
                    ledger=store,  # its decision ledger (in memory without a store): once per decisionId
                    tracer=self._telemetry.tracer if self._telemetry else None,
                    attest=imds.get_attestation if settings.attest else None,
                    freshness=Freshness(not_after_tolerance=timedelta(seconds=settings.not_after_tolerance)),
                    force=self._force,  # a force request's hook: the daemon's hooks folder, runner and sender
                )
                self._made = (RelayListener, EntraTokenProvider, approver)
            return self._made


def relay_companions(
    settings: ForwarderSettings, *, store: Store | None = None, telemetry: Telemetry | None = None
) -> Any:
    """The relay listener (connected on demand or always, `relay_listener_mode`), built by the daemon once the
    identity (and so the default hybrid connection name, `VmIdentity.hybrid_connection_name`) is known. `store`: the
    forwarder's own hook ledger, which the listener checks when a decision rested on this VM's prepare hooks
    (without it such an approval is refused), and where it keeps its decision ledger. `telemetry`: the daemon's, so
    that the listener's spans go where the forwarder's go. The daemon gives ``build`` its force hooks."""

    def build(identity: VmIdentity, imds: ImdsClient, force: ForceHooks | None = None) -> Sequence[Companion]:
        if not settings.relay_enabled:
            return []
        sessions = _Sessions(settings, identity, imds, store=store, telemetry=telemetry, force=force)
        log.info(
            "relay listener configured",
            extra=fields(
                endpoint=sessions.endpoint,
                hybrid_connection=sessions.hybrid_connection,
                mode=settings.relay_listener_mode,
            ),
        )
        listener = OnDemandListener(
            factory=sessions.session,
            vm_name=identity.name,
            always_on=settings.relay_listener_mode == "always-on",
            grace_seconds=settings.relay_listener_grace_seconds,
            warm=sessions.warm,
        )
        return [listener]

    return build


def _settings(args: argparse.Namespace) -> ForwarderSettings:
    flags = {name: getattr(args, name, None) for name in FIELDS}
    if args.command == "once":
        flags["sink"] = "stdout"  # `once` sends nothing; do not ask for Event Hubs settings
    return load_settings(flags=flags, config_file=args.config)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"forwarder: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logs.configure(level=settings.log_level)
    imds = ImdsClient(
        base_url=settings.imds_url,
        timeout=settings.imds_timeout,
        first_call_timeout=settings.imds_first_call_timeout,
    )
    if args.command == "once":
        try:
            identity = imds.get_identity()
            document = imds.get_document()
        except ImdsError as exc:
            print(f"forwarder: {exc}", file=sys.stderr)
            return EXIT_IMDS
        finally:
            imds.close()
        output = {"identity": identity.to_mapping(), "document": document.to_mapping()}
        print(json.dumps(output, indent=2))
        return 0
    stopping = threading.Event()
    running: list[Forwarder] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal received; stopping", extra=fields(signal=signal.Signals(signum).name))
        stopping.set()
        for forwarder in running:
            forwarder.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # A full state disk is waited out here, with backoff, rather than crash-looping under systemd.
    store = open_store(settings.spool_path, max_entries=settings.spool_max_entries, stop=stopping)
    if store is None:
        imds.close()
        return 0
    telemetry = Telemetry(spans_file=settings.telemetry_spans_file)
    forwarder = Forwarder(
        settings=settings,
        imds=imds,
        store=store,
        sink=build_sink(settings, imds),
        companions=relay_companions(settings, store=store, telemetry=telemetry),
        telemetry=telemetry,
    )
    running.append(forwarder)
    if stopping.is_set():
        forwarder.stop()
    try:
        forwarder.run()
    except Exception:
        # Unexpected: one structured line, then a non-zero exit for systemd to restart.
        log.exception("forwarder crashed")
        return 1
    return 0
