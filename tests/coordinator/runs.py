"""A ``Run`` (coordinator/pipeline/run.py) on the in-memory store, for the fast tests of each stage
(tests/coordinator/test_pipeline_*.py): what every stage takes, built without Azurite, a Relay or Teams.

Stand-ins only where a part cannot be local: ``RecordingCallback`` for an approval path (the Relay sender, or the
Maintenance RP's acknowledge), ``RecordingAlerts`` for the card sink (Teams), ``MemoryDeliveries`` for the delivery
queue (a Storage queue); history goes to ``MemoryHistory``.
``put_event`` and ``put_vm`` store state as earlier runs would have left it: an event's record in its entity, each
VM's position (with its sightings) in its VM group. The scenario tests (test_service.py and the others on Azurite)
show the same behaviour across every part; these show each module's own. ``make_coordinator`` builds theirs from one
keyword per part or option, and ``imds_serving`` serves their VMs on the IMDS emulator, on the coordinator's clock.
"""

from __future__ import annotations

import json
import random
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from contracts.approval import ApprovalOutcome, ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.adapters.delivery_queue import DeliveryQueueError, QueuedDelivery
from coordinator.adapters.teams import AlertError, FolderCardSink
from coordinator.domain.model import EventRecord, SightingStatus, VmGroupRecord, VmRecord, VmSighting, group_key
from coordinator.domain.policy import Policy
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.domain.rows import HistoryRow
from coordinator.pipeline.fleet import Fleet
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.run import Options, Parts, Report, Run, RunKind
from coordinator.service import Coordinator
from coordinator.state.events import read_event
from coordinator.state.tables import TableStateStore
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator, Scenario
from emulators.imds.clock import ManualClock
from local.direct_callback import DirectImdsCallback
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, event_record, vm
from tests.coordinator.memory_store import MemoryStateStore

# The documented notice: a quarter of an hour.
NOT_BEFORE = DOC_NOW + timedelta(minutes=15)


class RecordingCallback:
    """A stand-in for an approval path (the Relay sender, or remote acknowledge): records each request with the VM
    it went to and answers ``outcome`` (or raises ``error``). While ``hold`` is set to an unset ``threading.Event``,
    each send waits for it: a listener that does not answer in time."""

    def __init__(self, outcome: ApprovalOutcome = "approved", *, error: Exception | None = None) -> None:
        self.outcome: ApprovalOutcome = outcome
        self.error = error
        self.reason = ""
        self.hold: threading.Event | None = None
        self.sent: list[tuple[ApprovalRequest, VmIdentity]] = []

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.sent.append((request, vm))
        if self.hold is not None:
            self.hold.wait(timeout=10)
        if self.error is not None:
            raise self.error
        return ApprovalResult(
            outcome=self.outcome,
            eventId=request.eventId,
            decisionId=request.decisionId,
            documentIncarnation=7,
            reason=self.reason,
        )

    @property
    def vms(self) -> list[str]:
        return [vm.name for _, vm in self.sent]


class DeadFor(RecordingCallback):
    """A bounded approval path (``send_within``, as the Relay sender's) on which the listeners of ``dead`` fail each
    request as ``fail`` says; the others answer as ``RecordingCallback``. Notes how long each send was given."""

    def __init__(self, *dead: str) -> None:
        super().__init__()
        self.dead = set(dead)
        self.within: list[float] = []

    def send_within(self, request: ApprovalRequest, *, vm: VmIdentity, seconds: float) -> ApprovalResult:
        self.within.append(seconds)
        if vm.name in self.dead:
            self.sent.append((request, vm))
            self.fail(vm, seconds)
        return self.send(request, vm=vm)

    def fail(self, vm: VmIdentity, seconds: float) -> NoReturn:
        raise NotImplementedError


class AnswersInTurn:
    """An approval path whose answers come from a list, one a request: the listeners Relay hands them to, in turn."""

    def __init__(self, answers: list[ApprovalResult]) -> None:
        self.answers = answers
        self.sent = 0

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.sent += 1
        return self.answers.pop(0)


class MemoryDeliveries:
    """A stand-in for the delivery queue (an Azure Storage queue): keeps what each run handed over, in order;
    refuses with ``DeliveryQueueError`` while ``failing``."""

    def __init__(self) -> None:
        self.queued: list[QueuedDelivery] = []
        self.delays: list[timedelta] = []
        self.failing = False

    def put(self, delivery: QueuedDelivery, *, delay: timedelta = timedelta(0)) -> None:
        if self.failing:
            raise DeliveryQueueError("the queue is unreachable (stand-in)")
        self.queued.append(delivery)
        self.delays.append(delay)


class RecordingAlerts:
    """A stand-in for the card sink (Teams): keeps each card sent with its key, in order; refuses every card with
    ``AlertError`` while ``failing``."""

    def __init__(self) -> None:
        self.cards: list[tuple[str, dict[str, Any]]] = []
        self.failing = False

    def send(self, card: dict[str, Any], *, key: str) -> None:
        if self.failing:
            raise AlertError(f"card {key} refused (stand-in)")
        self.cards.append((key, card))

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.cards]


class Bound(random.Random):
    """Jitter at one end of its range (``high``: the ceiling, else 0), so a delay shows the backoff itself; notes
    each range it was asked for."""

    def __init__(self, *, high: bool) -> None:
        super().__init__()
        self.high = high
        self.asked: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.asked.append((a, b))
        return b if self.high else a


@dataclass
class Bench:
    """The parts a run talks to, kept across runs (as the coordinator keeps them): ``run`` starts one as
    ``Coordinator.start`` does, with ``options`` (and the call's) as its ``Options``."""

    store: MemoryStateStore = field(default_factory=MemoryStateStore)
    history: MemoryHistory = field(default_factory=MemoryHistory)
    alerts: RecordingAlerts = field(default_factory=RecordingAlerts)
    callback: RecordingCallback = field(default_factory=RecordingCallback)
    remote_acknowledge: RecordingCallback | None = None
    deliveries: MemoryDeliveries | None = None
    policy: Policy = field(default_factory=lambda: load_policy(DEFAULT_POLICY_PATH))
    now: datetime = DOC_NOW
    options: dict[str, Any] = field(default_factory=dict)
    # Seeded: the backoff's jitter is the same in every test run.
    rng: random.Random = field(default_factory=lambda: random.Random(20))
    _executor: ThreadPoolExecutor | None = None

    def run(self, kind: RunKind = "batch", **options: Any) -> Run:
        parts = Parts(
            store=self.store,
            history=self.history,
            alerts=self.alerts,
            callback=self.callback,
            remote_acknowledge=self.remote_acknowledge,
            deliveries=self.deliveries,
            rng=self.rng,
        )
        return Run(
            kind=kind,
            parts=parts,
            options=Options(**{**self.options, **options}),
            policy=self.policy,
            now=self.now,
            fleet=Fleet(self.store),
            pool=self.pool,
            report=Report(kind=kind),
        )

    def pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="approval-test")
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def event(self, event_id: str) -> EventRecord:
        """The event as stored now, with its VMs' sightings."""
        stored = read_event(self.store, event_id)
        assert stored is not None, f"no event {event_id}"
        return stored.record

    def vm(self, name: str, *, scale_set: str = "") -> VmRecord:
        """A VM's position as stored now."""
        who = identity(name, scale_set=scale_set)
        key = group_key(who)
        group = self.store.get_vm_groups([key]).get(key)
        assert group is not None, f"no group {key}"
        return group.record.vms[who.vmId.lower()]

    def rows(self, record_type: str, **columns: Any) -> list[HistoryRow]:
        """The history rows of one type (and these column values) the sink holds, in order."""
        return [
            row
            for row in self.history.rows
            if row.RecordType == record_type and all(getattr(row, name) == value for name, value in columns.items())
        ]


def make_coordinator(
    *,
    policy: Policy,
    after_batch: Executor | None = None,
    on_new_vm: Callable[[VmIdentity], None] | None = None,
    housekeeping: Callable[[dict[str, datetime], datetime], None] | None = None,
    **settings: Any,
) -> Coordinator:
    """A ``Coordinator(parts, options, policy)`` from one keyword per part or option, as the scenario tests name
    them: each of ``settings`` goes to ``Parts`` or ``Options`` by its field's name (a name of neither is refused);
    ``Options.tail_after_batch`` is on with an ``after_batch`` executor, as in wiring.py."""
    in_parts = {part.name for part in fields(Parts)}
    parts = Parts(**{name: value for name, value in settings.items() if name in in_parts})
    options = Options(
        tail_after_batch=after_batch is not None,
        **{name: value for name, value in settings.items() if name not in in_parts},
    )
    return Coordinator(parts, options, policy, after_batch=after_batch, on_new_vm=on_new_vm, housekeeping=housekeeping)


def folder_coordinator(cards: Path, *, policy: Policy | None = None, **settings: Any) -> Coordinator:
    """``make_coordinator`` with its cards written to the folder ``cards``, on ``policy`` (None: the default
    policy file's); ``settings`` name the other parts and options."""
    policy = policy if policy is not None else load_policy(DEFAULT_POLICY_PATH)
    return make_coordinator(alerts=FolderCardSink(cards), policy=policy, **settings)


def table_coordinator(
    azurite: AzuriteEndpoints,
    imds: ImdsEmulator,
    table: str,
    cards: Path,
    clock: Callable[[], datetime],
    *,
    policy: Policy | None = None,
    store_class: type[TableStateStore] = TableStateStore,
    **settings: Any,
) -> tuple[Coordinator, MemoryHistory]:
    """One instance of a fleet that shares an Azurite ``table``: approvals straight into the IMDS emulator, cards
    to the folder ``cards``, and a history of its own (given back with it); ``policy`` and ``settings`` as
    ``folder_coordinator`` takes them."""
    history = MemoryHistory()
    coordinator = folder_coordinator(
        cards,
        policy=policy,
        store=store_class.from_connection_string(azurite.connection_string, table_name=table),
        history=history,
        callback=DirectImdsCallback(base_url=imds.url),
        clock=clock,
        **settings,
    )
    return coordinator, history


@contextmanager
def imds_serving(
    name: str, vms: Sequence[Mapping[str, Any]], *, scale_sets: Mapping[str, Any] | None = None, **options: Any
) -> Iterator[ImdsEmulator]:
    """The IMDS emulator (and its ARM) serving the scenario ``name``: ``vms``, in ``scale_sets``, unthrottled. Its
    clock stands at the coordinator's (DOC_NOW) unless ``options`` say (``clock=None``: the system's): an event
    created with a 900 s notice has the documented NotBefore, so the facts the coordinator decides on are those each
    VM's IMDS shows. ``options`` are the emulator's."""
    scenario = Scenario.model_validate({"name": name, "vms": list(vms), "scaleSets": dict(scale_sets or {})})
    clock = options.pop("clock", ManualClock(DOC_NOW))
    with ImdsEmulator(scenario=scenario, throttle_rps=0, clock=clock, **options) as emulator:
        yield emulator


def batches_at_once(batches: Sequence[tuple[Coordinator, list[RawMessage]]], *, timeout: float = 60) -> None:
    """Each instance processes its batch on a thread of its own, all let go together (a barrier), as the instances
    of one fleet race; an error on any thread fails the test here."""
    barrier = threading.Barrier(len(batches))
    errors: list[BaseException] = []

    def run(instance: Coordinator, batch: list[RawMessage]) -> None:
        try:
            barrier.wait()
            instance.process_batch(batch)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=pair) for pair in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert errors == []


def identity(name: str, *, scale_set: str = "") -> VmIdentity:
    """The helpers' VM of that name, with a vmId of its own (from the name, stable); a scale set's VMs are in the
    placement group ``pg-{scale set}``, the others in ``avset-westno``."""
    group = f"pg-{scale_set}" if scale_set else "avset-westno"
    data = vm(name, index=zlib.crc32(name.encode()) % 10**8, scale_set=scale_set, group=group)
    return VmIdentity.model_validate(data)


def put_vm(
    store: MemoryStateStore,
    name: str,
    *,
    scale_set: str = "",
    last_seen: datetime = DOC_NOW,
    sightings: Mapping[str, VmSighting] | None = None,
    **fields: Any,
) -> VmRecord:
    """Stores a VM's position in its group (beside the group's other VMs), with ``sightings`` added to those it had."""
    who = identity(name, scale_set=scale_set)
    key = group_key(who)
    current = store.get_vm_groups([key]).get(key)
    vms = dict(current.record.vms) if current else {}
    previous = vms.get(who.vmId.lower())
    record = VmRecord.model_validate(
        {
            "identity": who,
            "lastSequence": 1,
            "lastSeen": last_seen,
            **(previous.model_dump() if previous else {}),
            **fields,
            "sightings": {**(previous.sightings if previous else {}), **(sightings or {})},
        }
    ).model_copy(update={"lastSeen": last_seen})
    vms[who.vmId.lower()] = record
    store.save_vm_group(VmGroupRecord(group=key, vms=vms), current.etag if current else None)
    return record


def put_event(
    store: MemoryStateStore,
    event_id: str,
    *,
    vms: Sequence[str] = ("WestNO_0",),
    scale_set: str = "",
    seen: datetime = DOC_NOW,
    status: SightingStatus = "Scheduled",
    **fields: Any,
) -> EventRecord:
    """Stores an event as a batch would have left it: the record (a Reboot naming ``vms``, Scheduled since DOC_NOW,
    unless ``fields`` say) in its entity, and each VM's sighting of it (``status``, last seen at ``seen``) with the
    VM's position. Gives the record as the stages read it."""
    keys = set()
    for name in vms:
        sighting = VmSighting(firstSeen=min(seen, DOC_NOW), lastSeen=seen, lastSequence=1, incarnation=1, status=status)
        put_vm(store, name, scale_set=scale_set, last_seen=seen, sightings={event_id: sighting})
        keys.add(group_key(identity(name, scale_set=scale_set)))
    base: dict[str, Any] = {
        "resources": list(vms),
        "groups": sorted(keys),
        "scaleSets": [scale_set] if scale_set else [],
    }
    store.save_event(event_record(event_id, **{**base, **fields}), None)
    stored = read_event(store, event_id)
    assert stored is not None
    return stored.record


def put_terminate(store: MemoryStateStore, event_id: str, vm_name: str, **fields: Any) -> EventRecord:
    """``put_event`` of a Terminate of ``vm_name``, a VM of scale set web, with the documented notice (NOT_BEFORE)."""
    return put_event(
        store, event_id, vms=(vm_name,), scale_set="web", eventType="Terminate", notBefore=NOT_BEFORE, **fields
    )


def message(data: dict[str, Any]) -> RawMessage:
    """An envelope as the Event Hubs trigger hands it over: partition key = the VM's resource id."""
    return RawMessage(body=json.dumps(data).encode(), partition_key=str(data["vm"]["resourceId"]).lower())
