"""``python -m emulators.relay --port PORT [--sas-key-name NAME --sas-key KEY]``: run the Relay emulator.

Prints one JSON line with the URL templates once it is serving, then runs until SIGINT or SIGTERM.
The SAS key may also come from the environment (``RELAY_EMULATOR_SAS_KEY``) to keep it off the process list.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from types import FrameType

from emulators.relay.auth import parse_rights
from emulators.relay.emulator import RelayEmulator
from emulators.tls import local_tls


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m emulators.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: a free one)")
    parser.add_argument("--sas-key-name", help="name of the SAS rule (e.g. RootManageSharedAccessKey)")
    parser.add_argument("--sas-key", help="SAS rule key (or set RELAY_EMULATOR_SAS_KEY)")
    parser.add_argument("--sas-rights", default="Listen,Send,Manage", help="rights of the SAS rule (default all)")
    parser.add_argument("--response-timeout", type=float, default=60.0, help="seconds a listener has to respond")
    parser.add_argument(
        "--require-known",
        action="store_true",
        help="only declared hybrid connections exist (--hybrid-connection or PUT /_emulator/hybridConnections/NAME)",
    )
    parser.add_argument("--hybrid-connection", action="append", default=[], help="declare one (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="log every connection")
    parser.add_argument(
        "--plain", action="store_true", help="serve ws:// and http:// (default: wss:// and https://, the local CA)"
    )
    arguments = parser.parse_args(argv)
    arguments.sas_key = arguments.sas_key or os.environ.get("RELAY_EMULATOR_SAS_KEY")
    if bool(arguments.sas_key_name) != bool(arguments.sas_key):
        parser.error("--sas-key-name and --sas-key (or RELAY_EMULATOR_SAS_KEY) go together")
    try:
        arguments.rights = parse_rights(arguments.sas_rights)
    except ValueError as error:
        parser.error(str(error))
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(argv)
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    keys = {arguments.sas_key_name: arguments.sas_key} if arguments.sas_key_name else {}
    emulator = RelayEmulator(
        sas_keys=keys,
        sas_rights={name: arguments.rights for name in keys},
        response_timeout=arguments.response_timeout,
        require_known=arguments.require_known,
        hybrid_connections=tuple(arguments.hybrid_connection),
        host=arguments.host,
        port=arguments.port,
        tls=not arguments.plain,
    )
    stopping = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    base = emulator.start()
    authority = base.split("://", 1)[1]
    print(
        json.dumps(
            {
                "relay": base,
                "listen": f"{emulator.ws_url}/$hc/{{path}}?sb-hc-action=listen",
                "connect": f"{emulator.ws_url}/$hc/{{path}}?sb-hc-action=connect",
                "send": f"{base}/{{path}}",
                "resource": f"http://{authority}/{{path}}",
                "control": f"{base}/_emulator/hybridConnections/{{name}}",
                "requireKnown": arguments.require_known,
                # What a client verifies the relay's certificate with (SSL_CERT_FILE, REQUESTS_CA_BUNDLE).
                "caBundle": None if arguments.plain else str(local_tls().bundle),
            }
        ),
        flush=True,
    )
    try:
        stopping.wait()
    finally:
        emulator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
