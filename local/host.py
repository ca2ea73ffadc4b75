"""The function host of ``function_app``, built for the local stack: the VMs' and the platform's Event Hubs triggers
(``local.runner.FunctionHost``, checkpoints in Azurite) with the timer and the delivery queue's trigger, and the
HTTP routes behind the sign-in stand-in. The stack builds them in its own process by default (``function_hosts``);
with ``StackOptions.coordinator_process`` they run in a process of their own, ``python -m local.host SPEC`` (started
by ``local/host_process.py``), which a test can SIGKILL as a crash would end a Functions instance and start again
as a new instance: it reads the same app settings (the stack put them in the environment it inherits), resumes from
the checkpoints and serves the people's routes on the listening socket the stack bound and hands it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType

from coordinator import set_graces
from local.direct_callback import direct_coordinator, forwarder_hook_ledger
from local.easy_auth import EasyAuthStandIn, LocalPerson
from local.http_host import FunctionsHttpHost, LocalHttpServer
from local.queue_trigger import QueueSettings, QueueTrigger, StorageQueue
from local.runner import FunctionHost, IngestFunction

log = logging.getLogger("local.host")

REPO_ROOT = Path(__file__).resolve().parent.parent
# The stack's hubs (local/stack.py), named in the app settings the coordinator reads.
HUB_SETTING, PLATFORM_HUB_SETTING = "EVENTHUB_NAME", "PLATFORM_EVENTHUB_NAME"
# How often the host looks whether the process that started it is still there (it ends with it).
PARENT_WATCH_SECONDS = 1.0


@dataclass(frozen=True)
class HostProcessOptions:
    """The coordinator in its own process. Times in real seconds; None keeps the deployed value.

    ``ownership_expiry``: how long a dead instance's claim on a partition holds it from the next (the SDK's 6 load
    balancing intervals, 12 s, by default). ``outbox_grace`` and ``alert_grace``: after how long the timer takes
    over the history rows and the cards a run left (60 s and 30 s deployed; record.py, outbox.py), shortened as the
    stack shortens Azure's other times so that a run with several crashes settles within a test."""

    ownership_expiry: float | None = None
    outbox_grace: float | None = None
    alert_grace: float | None = None


@dataclass(frozen=True)
class HostSpec:
    """What the host process needs beside the app settings in its environment."""

    eventhub_connection_string: str
    timer_interval: float
    http_fd: int  # the people's listening socket, inherited under this number
    people: tuple[LocalPerson, ...] = ()
    options: HostProcessOptions = HostProcessOptions()
    # Without the Relay: approvals straight into the IMDS emulator, judged against the VMs' ledgers under vms_dir.
    direct_imds_url: str | None = None
    vms_dir: str | None = None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> HostSpec:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["options"] = HostProcessOptions(**data["options"])
        data["people"] = tuple(LocalPerson(**{**p, "roles": tuple(p["roles"])}) for p in data["people"])
        return cls(**data)


def delivery_queues() -> tuple[StorageQueue, StorageQueue]:
    """The delivery queue and its poison queue, as the app settings name them (the stack created both)."""
    url, sas = os.environ["COORDINATOR_DELIVERY_QUEUE_URL"], os.environ["COORDINATOR_DELIVERY_QUEUE_SAS"]
    return StorageQueue(queue_url=url, sas=sas), StorageQueue(queue_url=f"{url}-poison", sas=sas)


def function_hosts(
    app: ModuleType,
    *,
    eventhub_connection_string: str,
    queues: tuple[StorageQueue, StorageQueue],
    timer_interval: float,
    ingest: IngestFunction | None = None,
    ownership_expiry: float | None = None,
) -> tuple[FunctionHost, FunctionHost]:
    """The VMs' trigger (with the timer and the delivery queue's trigger) and Event Grid's, each its own consumer of
    its own hub, as the Functions host runs each trigger; ``ingest`` replaces ``app.ingest_envelopes`` (a test's
    wrapper)."""
    storage = os.environ["COORDINATOR_STORAGE_CONNECTION_STRING"]
    delivery, poison = queues
    trigger = QueueTrigger(
        queue=delivery,
        poison=poison,
        function=app.continue_approval,
        settings=QueueSettings.from_host_json(REPO_ROOT / "host.json"),
    )
    host = FunctionHost(
        eventhub_connection_string=eventhub_connection_string,
        eventhub_name=os.environ[HUB_SETTING],
        storage_connection_string=storage,
        ingest=ingest or app.ingest_envelopes,
        timer=app.reevaluate,
        timer_interval=timer_interval,
        queue_trigger=trigger,
        ownership_expiry=ownership_expiry,
    )
    platform = FunctionHost(
        eventhub_connection_string=eventhub_connection_string,
        eventhub_name=os.environ[PLATFORM_HUB_SETTING],
        storage_connection_string=storage,
        ingest=app.ingest_platform_events,
        ownership_expiry=ownership_expiry,
    )
    return host, platform


def _apply_graces(options: HostProcessOptions) -> None:
    # The coordinator reads both graces at each tick; the deployed app keeps their values.
    set_graces(
        history=None if options.outbox_grace is None else timedelta(seconds=options.outbox_grace),
        cards=None if options.alert_grace is None else timedelta(seconds=options.alert_grace),
    )


def serve(spec: HostSpec) -> None:
    """Runs the host until SIGTERM (or until the process that started it is gone), then stops it as the Functions
    host stops an instance: the triggers first, then the batches' tails finish."""
    _apply_graces(spec.options)
    import function_app  # noqa: PLC0415 -- imported after the graces are set, with the app settings in the environment

    if spec.direct_imds_url is not None:
        assert spec.vms_dir is not None
        ledger = forwarder_hook_ledger(Path(spec.vms_dir))
        swapped = direct_coordinator(function_app.settings, spec.direct_imds_url, hook_ledger=ledger)
        setattr(function_app, "coordinator", swapped)  # noqa: B010 -- a module attribute the type checker cannot see
    queues = delivery_queues()
    hosts = function_hosts(
        function_app,
        eventhub_connection_string=spec.eventhub_connection_string,
        queues=queues,
        timer_interval=spec.timer_interval,
        ownership_expiry=spec.options.ownership_expiry,
    )
    front = LocalHttpServer(
        EasyAuthStandIn(FunctionsHttpHost(lambda: function_app), spec.people),
        listening=socket.socket(fileno=spec.http_fd),
    )
    stopping = _stop_signal()
    for host in hosts:
        host.start()
    front.start()
    log.info("coordinator host up (pid %d)", os.getpid())
    parent = os.getppid()
    while not stopping.wait(PARENT_WATCH_SECONDS):
        if os.getppid() != parent:
            log.warning("the process that started this host is gone: stopping")
            break
    front.stop()
    for host in hosts:
        host.stop()
    for queue in queues:
        queue.close()
    if function_app.coordinator.cache_info().currsize:
        function_app.coordinator().close()  # the batches' tails end first: they write history
    log.info("coordinator host stopped")


def _stop_signal() -> threading.Event:
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stopping.set())
    return stopping


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m local.host SPEC.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    serve(HostSpec.read(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
