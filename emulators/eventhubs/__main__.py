"""``python -m emulators.eventhubs --port PORT [--hub NAME[:PARTITIONS]]... [--consumer-group NAME]...
[--sas-key-name N --sas-key K] [--data-dir DIR]``: serves on 127.0.0.1, prints one JSON line with the
connection string, runs until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from types import FrameType

from emulators.eventhubs.emulator import DEFAULT_CONSUMER_GROUP, DEFAULT_HUBS, DEFAULT_SAS_KEY_NAME, EventHubsEmulator
from emulators.tls import local_tls


def _hub(value: str) -> tuple[str, int]:
    name, _, count = value.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--hub {value!r}: give NAME or NAME:PARTITIONS")
    try:
        partitions = int(count) if count else 4
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hub {value!r}: PARTITIONS must be an integer") from None
    if partitions < 1:
        raise argparse.ArgumentTypeError(f"--hub {value!r}: PARTITIONS must be at least 1")
    return name, partitions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulators.eventhubs", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 = any free port)")
    parser.add_argument("--hub", type=_hub, action="append", default=[], help="NAME[:PARTITIONS], repeatable")
    parser.add_argument("--consumer-group", action="append", default=[], help="besides $Default, repeatable")
    parser.add_argument("--sas-key-name", default=DEFAULT_SAS_KEY_NAME)
    parser.add_argument(
        "--sas-key",
        default=os.environ.get("EVENTHUBS_EMULATOR_SAS_KEY"),
        help="namespace key (default: $EVENTHUBS_EMULATOR_SAS_KEY, else random; printed in the connection string)",
    )
    parser.add_argument("--data-dir", default=None, help="keep events in append-only files here (default: memory)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    emulator = EventHubsEmulator(
        hubs=dict(args.hub) if args.hub else DEFAULT_HUBS,
        consumer_groups=[DEFAULT_CONSUMER_GROUP, *args.consumer_group],
        data_dir=args.data_dir,
        sas_key_name=args.sas_key_name,
        sas_key=args.sas_key,
        port=args.port,
    )
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    connection_string = emulator.start()
    line = {
        "connection_string": connection_string,
        "port": emulator.port,
        # The REST API (the forwarders' sends); both it and AMQP speak TLS with the local CA's certificate
        # (emulators/tls.py): an SDK client reaches AMQP with emulators.eventhubs.client_options(connection_string).
        "rest": emulator.rest_url,
        "ca": str(local_tls().ca),
        "hubs": emulator.hubs,
        "consumer_groups": [DEFAULT_CONSUMER_GROUP, *args.consumer_group],
        "data_dir": args.data_dir,
    }
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    stop.wait()
    emulator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
