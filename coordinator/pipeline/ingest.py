"""Ingest, the first stage: Event Hubs messages (bytes) -> validated envelopes, grouped per VM in arrival order.

Takes a batch of ``RawMessage`` and the channel it came on; gives each VM's envelopes in the order of its Event Hubs
partition (the partition key is the VM), and sets aside every message that fails: a dead letter (one log line naming
the message and the reason, a row in the dead-letter table, a ``DeadLetter`` history row), counted, while the rest
of the batch goes on. Deduplication by (stateId, sequence) happens next, against each VM's stored position
(coordinator/pipeline/fold.py).

Two channels, two hubs (infra/modules/eventhubs.bicep): ``vms``, the hub every VM's identity may send to, carries
envelopes only; ``platform``, the hub only the Event Grid system topic's identity may send to, carries Event Grid's
events only. An Event Grid event on the VMs' hub can only have been sent by a VM (or by an event subscription still
pointing there): it is dead-lettered with that reason, never read. So what Event Grid says is the platform's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import ValidationError

from contracts import bounded_json
from contracts.envelope import Envelope, VmIdentity
from coordinator.adapters import telemetry
from coordinator.domain.history_rows import dead_letter_row
from coordinator.pipeline import attest, event_grid
from coordinator.pipeline.attest import StoreOutage
from coordinator.pipeline.run import Run, Work
from coordinator.state.store import DeadLetter

log = logging.getLogger("coordinator")

# Event Hubs carries at most 1 MB per message (Premium and Dedicated; 256 KB on Standard): a larger body is not a
# forwarder's, and none is parsed. The envelope's own parser (pydantic-core) refuses more than 200 levels of nesting;
# an Event Grid body is read with contracts.bounded_json (64 levels).
MAX_MESSAGE_BYTES = 1 << 20
MAX_EVENTS_PER_DOCUMENT = 100
MAX_RESOURCES_PER_EVENT = 1000
# Bounds on what one envelope may carry, so that nothing it holds can break a write for others: Table Storage,
# Log Analytics and SQLite hold 64-bit integers; a VM name is at most 64 characters in Azure (256 is generous).
INT64 = (-(2**63), 2**63 - 1)
MAX_NAME_CHARS = 256
MAX_TEXT_CHARS = 4096
# observedAt is the VM's clock: a replay from the spool may be days old, but not older than this project, and a
# clock far ahead would make the VM look alive for ever.
EARLIEST_OBSERVED = datetime(2000, 1, 1, tzinfo=UTC)
MAX_CLOCK_AHEAD = timedelta(days=1)

# The hub a batch came from (function_app.py has one trigger per hub): the VMs', or the platform's (Event Grid).
Channel = Literal["vms", "platform"]
GRID_ON_VM_HUB = (
    "an Event Grid event on the VMs' hub: Event Grid delivers to the platform's own hub, which no VM may send to, so "
    "this one was sent with the VMs' shared identity (a forgery), or by an event subscription still delivering to "
    "the VMs' hub; not read"
)
ENVELOPE_ON_PLATFORM_HUB = "not an Event Grid event: the platform's hub carries only Event Grid's scheduled events"


@dataclass(frozen=True)
class RawMessage:
    """One Event Hubs message as the trigger delivered it (function_app converts func.EventHubEvent)."""

    body: bytes
    partition_key: str | None = None
    sequence_number: int | None = None
    offset: str | None = None
    enqueued_time: datetime | None = None
    # W3C trace context from the message's application properties (the forwarder sets them on the envelopes that
    # report events): the trace an approval of those events continues. "" when the message carried none.
    traceparent: str = ""
    tracestate: str = ""

    def source(self) -> dict[str, Any]:
        return {
            "partitionKey": self.partition_key,
            "sequenceNumber": self.sequence_number,
            "offset": self.offset,
            "enqueuedTime": self.enqueued_time.isoformat() if self.enqueued_time else None,
        }


def _dead_letter_reason(error: Exception) -> str:
    """Why a message was refused, in at most a few hundred characters whatever the message held."""
    if isinstance(error, ValidationError):
        parts = []
        for item in error.errors()[:5]:
            where = ".".join(str(p)[:64] for p in item["loc"]) or "(envelope)"
            parts.append(f"{where}: {str(item['msg'])[:200]}")
        more = f" (+{error.error_count() - 5} more)" if error.error_count() > 5 else ""
        return "invalid envelope: " + "; ".join(parts) + more
    if isinstance(error, UnicodeError):
        return f"body is not UTF-8 text: {str(error)[:300]}"
    if isinstance(error, ValueError):
        return f"refused: {str(error)[:500]}"
    return f"refused: {type(error).__name__}: {str(error)[:500]}"


def _int64(value: int | None, what: str) -> None:
    if value is not None and not INT64[0] <= value <= INT64[1]:
        raise ValueError(f"{what} {str(value)[:40]}… does not fit in 64 bits")


def _text(value: str, what: str, limit: int) -> None:
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters (limit {limit})")


def _check_bounds(envelope: Envelope, now: datetime) -> None:
    """What the envelope contract leaves open but storage cannot hold: integers beyond 64 bits, timestamps that
    overflow arithmetic, names and texts of any length, too many events or resources."""
    _int64(envelope.sequence, "sequence")
    observed = envelope.observedAt
    if observed < EARLIEST_OBSERVED or observed > now + MAX_CLOCK_AHEAD:
        raise ValueError(
            f"observedAt {observed.isoformat()} is not plausible (before {EARLIEST_OBSERVED.year} or more than "
            f"{MAX_CLOCK_AHEAD.days} day ahead of the coordinator's clock {now.isoformat()})"
        )
    vm = envelope.vm
    for name in ("vmScaleSetName", "placementGroupId", "subscriptionId", "resourceGroupName", "location", "zone"):
        _text(str(getattr(vm, name)), f"vm.{name}", MAX_NAME_CHARS)
    _text(vm.platformFaultDomain, "vm.platformFaultDomain", MAX_NAME_CHARS)
    if envelope.document is not None:
        document = envelope.document
        _int64(document.DocumentIncarnation, "DocumentIncarnation")
        if len(document.Events) > MAX_EVENTS_PER_DOCUMENT:
            raise ValueError(f"document lists {len(document.Events)} events (limit {MAX_EVENTS_PER_DOCUMENT})")
        for event in document.Events:
            where = f"event {event.EventId[:128]}"
            _int64(event.DurationInSeconds, f"{where}: DurationInSeconds")
            if len(event.Resources) > MAX_RESOURCES_PER_EVENT:
                raise ValueError(f"{where} lists {len(event.Resources)} resources (limit {MAX_RESOURCES_PER_EVENT})")
            for resource in event.Resources:
                _text(resource, f"{where}: a resource name", MAX_NAME_CHARS)
            for name in ("ResourceType", "EventSource", "NotBefore"):
                _text(str(getattr(event, name)), f"{where}: {name}", MAX_NAME_CHARS)
            _text(event.Description, f"{where}: Description", MAX_TEXT_CHARS)
    if envelope.hook is not None:
        _int64(envelope.hook.exitCode, "hook.exitCode")
        for step in envelope.hook.steps or ():
            _int64(step.exitCode, f"hook step {step.hook[:64]}: exitCode")


@dataclass
class Arrivals:
    """A batch's valid envelopes per VM (vmId, lower case) in arrival order, the messages they came in, and the
    dead letters set aside so far."""

    by_vm: dict[str, list[Envelope]] = field(default_factory=lambda: defaultdict(list))
    raw_of: dict[str, list[RawMessage]] = field(default_factory=lambda: defaultdict(list))
    dead: list[DeadLetter] = field(default_factory=list)
    # The trace context each envelope arrived with, by (vmId, sequence): an event record keeps the one of the
    # envelope that first reported it.
    traces: dict[tuple[str, int], str] = field(default_factory=dict)
    # Event Grid events (pipeline/event_grid.py), valid and first of their Event Grid id in the batch, and how
    # many repeated an id already seen (the platform may publish an event twice).
    grid: list[event_grid.GridEvent] = field(default_factory=list)
    grid_duplicates: int = 0


def validate(message: RawMessage, now: datetime) -> Envelope:
    envelope = Envelope.model_validate_json(message.body)
    if not message.partition_key:
        raise ValueError(
            "no partition key: a forwarder sends with partition key = its vm.resourceId (one VM's envelopes in "
            "one partition, in order); an envelope without one is not a forwarder's"
        )
    if message.partition_key.lower() != envelope.vm.partition_key:
        raise ValueError(
            f"partition key {message.partition_key[:300]!r} is not the envelope's vm.resourceId: a VM reports "
            "only for itself"
        )
    _check_bounds(envelope, now)
    # Unknown identity fields are not kept: the VM's position is stored with its identity.
    vm = VmIdentity.model_validate(envelope.vm.model_dump(include=set(VmIdentity.model_fields)))
    return envelope.model_copy(update={"vm": vm})


def dead_letter(
    message: RawMessage, reason: str, now: datetime, *, dead: list[DeadLetter], work: Work, where: str
) -> None:
    reason = reason[:2000]
    source = {k: (v[:300] if isinstance(v, str) else v) for k, v in message.source().items()}
    log.warning("dead-letter: %s (%s) refused: %s", where, json.dumps(source), reason)
    dead.append(DeadLetter(reason=reason, body=message.body, received_at=now, source=source))
    details = {**source, "bodyBytes": len(message.body), "bodySha256": hashlib.sha256(message.body).hexdigest()}
    work.rows.append(dead_letter_row(now=now, reason=reason, details=details))


def read_batch(run: Run, messages: Sequence[RawMessage], channel: Channel = "vms") -> Arrivals:
    """Validates each message; groups the valid envelopes by VM in arrival order (the batch's order is its Event
    Hubs partition's, whose key is the VM). ``channel``: the hub the batch came from; each carries one kind.

    One boundary per message: whatever is raised while one message is read, validated, verified or bound is that
    message's alone, and sets it aside as a dead letter with the reason; the batch goes on. A state store that
    fails (``StoreOutage``) is the one exception: nothing in the message is at fault, so the batch fails, saying
    so, and Event Hubs delivers it again."""
    run.enter("ingest")
    now = run.now
    arrivals = Arrivals()
    pending: list[tuple[RawMessage, str, attest.Pending]] = []
    for index, message in enumerate(messages):
        where = f"message {index} of the batch"
        try:
            telemetry.message_age(message.enqueued_time, now)
            found = _read_message(run, message, channel, arrivals, where)
        except StoreOutage as outage:
            log.error("batch of %d messages failed at %s: %s; it will be delivered again", len(messages), where, outage)
            raise
        except Exception as error:  # this message's alone: set aside with its reason, counted
            dead_letter(message, _dead_letter_reason(error), now, dead=arrivals.dead, work=run.work, where=where)
            continue
        if found is not None:
            pending.append((message, where, found))
    _bind(run, pending, arrivals, len(messages))
    return arrivals


def _read_message(
    run: Run, message: RawMessage, channel: Channel, arrivals: Arrivals, where: str
) -> attest.Pending | None:
    """One message into ``arrivals``: its envelope under its VM, its Event Grid events, or a dead letter; or, for an
    envelope whose bindings decide, what they must (``_bind`` takes it in). Adds to ``arrivals`` only once nothing
    more can fail, so a message that raises leaves nothing of itself there."""
    now, work = run.now, run.work
    try:
        grid = _event_grid_body(message.body)
    except bounded_json.JsonRefused as error:  # too large or too deep to read
        dead_letter(message, f"refused: {error}", now, dead=arrivals.dead, work=work, where=where)
        return None
    if grid is not None and channel == "platform":
        read_grid(message, grid, now, arrivals=arrivals, work=work, where=where)
        return None
    if grid is not None or channel == "platform":
        reason = GRID_ON_VM_HUB if grid is not None else ENVELOPE_ON_PLATFORM_HUB
        dead_letter(message, reason, now, dead=arrivals.dead, work=work, where=f"{where} ({channel} channel)")
        return None
    envelope = validate(message, now)
    # Whether the envelope is its VM's (Azure's signature; its name, resource id and vmId as ARM's census or the
    # bindings have them): a refusal is a reason; the bindings are decided for the whole batch at once (_bind).
    found = attest.door_problem(
        run.parts.attestations,
        envelope,
        at=message.enqueued_time or now,
        required=run.options.require_attestation,
        census=run.fleet.arm,
    )
    if isinstance(found, attest.Pending):
        return found
    if found:
        dead_letter(message, found[:1000], now, dead=arrivals.dead, work=work, where=where)
    else:
        _admit(message, envelope, arrivals)
    return None


def _bind(run: Run, pending: list[tuple[RawMessage, str, attest.Pending]], arrivals: Arrivals, size: int) -> None:
    """The batch's envelopes whose bindings decide, their bindings read and written together: each accepted or
    dead-lettered with its reason, in the batch's order. A store that fails raises StoreOutage, as it would in
    fold: nothing is dead-lettered for want of a read."""
    attestations = run.parts.attestations
    if not pending or attestations is None:
        return
    try:
        problems = attest.binding_problems(attestations, run.parts.store, [item for _, _, item in pending])
    except StoreOutage as outage:
        log.error(
            "batch of %d messages failed at the bindings of %s and %d more: %s; it will be delivered again",
            size, pending[0][1], len(pending) - 1, outage,
        )  # fmt: skip
        raise
    for (message, where, item), problem in zip(pending, problems, strict=True):
        if problem:
            dead_letter(message, problem[:1000], run.now, dead=arrivals.dead, work=run.work, where=where)
        else:
            _admit(message, item.envelope, arrivals)


def _admit(message: RawMessage, envelope: Envelope, arrivals: Arrivals) -> None:
    vm_id = envelope.vm.vmId.lower()
    traceparent = telemetry.valid_traceparent(message.traceparent)
    arrivals.by_vm[vm_id].append(envelope)
    arrivals.raw_of[vm_id].append(message)
    if traceparent:
        arrivals.traces[(vm_id, envelope.sequence)] = traceparent


def _event_grid_body(body: bytes) -> Any | None:
    """The parsed body when it is Event Grid's (an array, or an object with eventType and no schema), else None.
    A cheap look first: every envelope carries "schema", and most messages are envelopes. Raises ``JsonRefused``
    for a body larger than a message can be, or nested deeper than ``bounded_json.MAX_DEPTH`` (``json.loads``
    raised RecursionError on 20,000 levels, which failed the whole batch)."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise bounded_json.JsonRefused(f"the message is {len(body)} bytes, more than the {MAX_MESSAGE_BYTES} allowed")
    head = body.lstrip()[:1]
    if head != b"[" and not (b'"eventType"' in body and b'"schema"' not in body):
        return None
    try:
        parsed = bounded_json.loads(body, max_bytes=MAX_MESSAGE_BYTES)
    except bounded_json.NotJson:
        return None  # refused by the envelope path, with its reason
    return parsed if event_grid.is_event_grid(parsed) else None


def read_grid(message: RawMessage, parsed: Any, now: datetime, *, arrivals: Arrivals, work: Work, where: str) -> None:
    """Each Event Grid event of one message (from the platform's hub) on its own: the bad ones set the message aside
    as one dead letter naming each bad event and its reason (one per refused message, as for envelopes), a repeated
    Event Grid id is counted as a duplicate, the good ones go on. No partition-key check: the platform sends without
    the VM's key (docs/security.md says what an Event Grid event can and cannot do)."""
    seen = {event.id for event in arrivals.grid}
    refused, good, duplicates = [], [], 0
    for position, item in enumerate(event_grid.read_events(parsed)):
        if isinstance(item, Exception):
            refused.append(f"event {position}: {event_grid.describe(item)}")
        elif item.id in seen:
            duplicates += 1
        else:
            seen.add(item.id)
            good.append(item)
    # Taken in only once the whole message was read: one that raises midway leaves none of its events behind.
    arrivals.grid.extend(good)
    arrivals.grid_duplicates += duplicates
    if refused:
        reason = "invalid Event Grid event(s): " + " | ".join(refused[:5])
        more = f" (+{len(refused) - 5} more)" if len(refused) > 5 else ""
        dead_letter(message, reason + more, now, dead=arrivals.dead, work=work, where=f"Event Grid {where}")
