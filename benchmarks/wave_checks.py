"""Whether a wave measured the product (benchmarks/wave.py): what it must leave, and every way it did not.

A wave that only dead-letters, or decides otherwise than its policy says, measures something else than the product.
``left_behind`` reads what the wave left (the open events' states in the state table, the bindings, the cards, the
history), ``problems`` compares it and the coordinator's own report counts with what the wave's policy must leave
(``expected``), naming each difference; benchmarks/wave.py exits 1 when there is any.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from azure.data.tables import TableServiceClient

from benchmarks.wave_budgets import BUDGETS, RULE, budget_problems
from coordinator import CLAIM_PARTITION, SqliteHistory, TableStateStore
from emulators.imds import VmSpec


@dataclass(frozen=True)
class Expected:
    """What the wave's policy makes of it."""

    envelopes: int
    events: int
    bindings: int  # binding rows in the state table: four per VM (none: --warm-up memory)
    rule: str  # the rule that decides every event
    action: str
    dead: int = 0  # envelopes refused and kept as dead letters (a storm: every one)
    approves: bool = False  # a budget wave: part of it approved (benchmarks/wave_budgets.py judges which)


def expected(args: Any, envelopes: int) -> Expected:
    groups = args.vms // args.group_size
    if args.storm:
        # No envelope attested: each refused at the door, kept as a dead letter with its history row; no event.
        return Expected(envelopes, 0, 0, "", "", dead=envelopes)
    # Four per VM: its resource id's and name's owner (its vmId), its vmId's resource id and name.
    bindings = 0 if args.bindings == "warm" and args.warm_up == "memory" else 4 * args.vms
    if args.policy in BUDGETS:
        return Expected(envelopes, groups, bindings, RULE, BUDGETS[args.policy].action, approves=True)
    if args.event_type == "Terminate":
        # The default policy's (and the census policy's) Terminate rule: approve once the prepare hooks succeeded,
        # or at the 240 s deadline; no VM of the wave reports hooks and the tick runs 150 s in, so every delete
        # stays Scheduled, waiting, with no approval.
        return Expected(envelopes, groups, bindings, "terminate-after-prepare-hooks", "approve-after-hooks")
    # Reboot, Redeploy and a 30 s Freeze: a person decides, under both policies.
    return Expected(envelopes, groups, bindings, "everything-else-waits", "wait-for-person")


def check(
    want: Expected,
    *,
    totals: Mapping[str, int],
    tick_totals: Mapping[str, int],
    states: Mapping[str, int],
    rows: Iterable[Mapping[str, Any]],
    claims: int,
    tails_drained: bool,
) -> list[str]:
    """What is wrong with the wave's outcome, each named (none: the wave measured what it claims to)."""
    found = _count_problems(want, totals, tick_totals, tails_drained=tails_drained)
    distinct = sum(states.values())
    if distinct != want.events:
        found.append(f"distinct events {distinct} (expected {want.events})")
    if not want.approves and any(state != "Scheduled" for state in states):
        found.append(f"event states {dict(states)} (expected every event Scheduled: {want.rule})")
    found += _history_problems(want, rows)
    if claims != want.bindings:
        found.append(f"binding rows {claims} (expected {want.bindings}: four per VM bound)")
    return found


def _count_problems(
    want: Expected, totals: Mapping[str, int], tick_totals: Mapping[str, int], *, tails_drained: bool
) -> list[str]:
    """The coordinator's own report counts of the wave's batches and of the two ticks after it."""
    found = []
    if not tails_drained:
        found.append("the batches' tails did not end (the counts and the history are incomplete)")
    if totals.get("accepted", 0) != want.envelopes - want.dead:
        found.append(f"accepted {totals.get('accepted', 0)} of {want.envelopes - want.dead} envelopes")
    if totals.get("dead_lettered", 0) != want.dead:
        found.append(f"dead_lettered {totals.get('dead_lettered', 0)} (expected {want.dead})")
    found += [
        f"{key} {totals[key]} (expected 0)"
        for key in ("set_aside", "alerts_failed", *([] if want.approves else ["approvals_sent"]))
        if totals.get(key, 0)
    ]
    found += [
        f"the tick's {key} {tick_totals[key]} (expected 0)"
        for key in ("approvals_sent", "set_aside", "heartbeats_lost", "vms_retired")
        if tick_totals.get(key, 0)
    ]
    return found


def _history_problems(want: Expected, rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The history: one decision per event by the expected rule, no census mismatch, no dead letter, no approval."""
    found = []
    kinds: Counter[str] = Counter()
    decided: dict[str, set[tuple[str, str]]] = {}
    mismatches = 0
    for row in rows:
        kind = str(row["RecordType"])
        kinds[kind] += 1
        if kind == "Decision":
            decided.setdefault(str(row["EventId"]), set()).add((str(row["Rule"]), str(row["Action"])))
        mismatches += kind == "Heartbeat" and row["Outcome"] == "census-mismatch"
    if mismatches:
        found.append(f"census-mismatch rows {mismatches} (expected 0)")
    if kinds["DeadLetter"] != want.dead:
        found.append(f"DeadLetter rows {kinds['DeadLetter']} (expected {want.dead})")
    if kinds["Approval"] and not want.approves:
        found.append(f"Approval rows {kinds['Approval']} (expected 0)")
    if len(decided) != want.events:
        found.append(f"events with a decision {len(decided)} (expected {want.events})")
    others = Counter(d for pairs in decided.values() for d in pairs if d != (want.rule, want.action))
    if others:
        shown = ", ".join(f"{rule}/{action} x{n}" for (rule, action), n in others.most_common(3))
        found.append(f"decisions other than {want.rule}/{want.action}: {shown}")
    return found


def left_behind(connection: str, tmp: str, histories: list[str]) -> dict[str, Any]:
    """What the wave left: the open events' states, the binding rows, the cards, the history."""
    store = TableStateStore.from_connection_string(connection, table_name="wave")
    table = TableServiceClient.from_connection_string(connection).get_table_client("wave")
    rows: list[dict[str, Any]] = []
    for name in histories:
        history = SqliteHistory(f"{tmp}/{name}")
        rows += history.query(
            "SELECT RecordType, EventId, Rule, Action, Outcome, Reason FROM ScheduledEventsHistory_CL"
        )
        history.close()
    return {
        "states": {s.record.eventId: s.record.state for s in store.open_events()},
        "claims": sum(
            1
            for _ in table.query_entities(
                f"PartitionKey ge '{CLAIM_PARTITION}-' and PartitionKey lt '{CLAIM_PARTITION}.'", select=["RowKey"]
            )
        ),
        "cards": len(os.listdir(f"{tmp}/cards")) if os.path.isdir(f"{tmp}/cards") else 0,
        "rows": rows,
    }


@dataclass
class Outcome:
    """What the timed part did."""

    seconds: float
    cpu: float
    drained: bool
    histories: list[str]
    totals: Counter[str] = field(default_factory=Counter)
    warmed: Counter[str] = field(default_factory=Counter)
    extra: dict[str, Any] = field(default_factory=dict)


def problems(
    args: Any, envelopes: int, outcome: Outcome, *, left: Mapping[str, Any], tick_totals: Mapping[str, int],
    during_wave: Mapping[str, Any], listed: int, specs: Mapping[str, VmSpec], events: Mapping[str, list[str]],
) -> list[str]:  # fmt: skip
    """Everything the wave left otherwise than its policy must (``check``), and what the warm-up and the
    census must have done."""
    found = []
    warmed = outcome.warmed.get("accepted", 0)
    if args.bindings == "warm" and warmed != args.vms:
        found.append(f"warm-up: accepted {warmed} of {args.vms} heartbeats")
    if listed != args.vms:
        found.append(f"ARM's census lists {listed} VMs (expected {args.vms})")
    found += check(
        expected(args, envelopes),
        totals=outcome.totals,
        tick_totals=tick_totals,
        states=Counter(left["states"].values()),
        rows=left["rows"],
        claims=left["claims"],
        tails_drained=outcome.drained,
    )
    if args.bindings == "warm" and during_wave["binding_table_ops"]:
        found.append(
            f"the warm wave read or wrote {during_wave['binding_table_ops']} bindings in the table (expected 0: "
            "every VM known to the instance)"
        )
    if args.policy in BUDGETS:
        found += budget_problems(args.policy, specs, events, left["states"])
    dead = [str(row["Reason"]) for row in left["rows"] if row["RecordType"] == "DeadLetter"]
    if args.storm:
        other = [reason for reason in dead if "unattested" not in reason]
        if other:
            found.append(f"{len(other)} dead letters for another reason than the storm's, the first: {other[0][:300]}")
    elif dead:
        found.append(f"the first dead letter's reason: {dead[0][:300]}")
    return found
