"""Generated hostile input at the door (issue 33): valid attested documents damaged in every byte, length and tag of
their DER, envelopes and impact reports given values no field takes, Event Grid bodies spoiled, each put in a batch
among good messages and run through the real ``process_batch`` (the in-memory store, a coordinator that requires
attested documents, as in Azure).

What must hold for every batch: ``process_batch`` never raises; every good message is applied and its approval
made; every bad message is dead-lettered, with a refusal as its reason, and counted. A document is bad when its
damage touches what its proof rests on (the signed content, the signing certificate, the signature), and then it is
refused by the verifier ("attestation refused: ..."), never by an error escaping it; a damage elsewhere (a version
number, an algorithm the verifier does not read) may leave the proof whole, and then the envelope may be taken, but
only with its signed content unchanged. Fast: about a hundred batches in a few seconds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contracts.attestation import state_nonce
from contracts.attested import signed_content
from coordinator.pipeline.ingest import RawMessage
from coordinator.state.events import read_event
from tests.coordinator import attested
from tests.coordinator.attested import Door, door, freeze, identity, message, with_der
from tests.coordinator.helpers import DOC_NOW, envelope, grid_event

EXAMPLES = 150
_names = itertools.count(1000)

# Numbers no field takes: not finite, or too large for any (a double's edge, beyond a 64-bit integer).
BEYOND_ANY = [float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 2**64]
# Values no field of an envelope, an impact report or an Event Grid event takes where a number, a time or a name is
# expected, and some that one takes and another does not.
HOSTILE: list[Any] = [
    *BEYOND_ANY,
    -(2**63) - 1,
    604_800.5,
    -1,
    -0.001,
    1.5,
    0,
    "",
    "x" * 5000,
    "2022-04-11T22:11:58",
    "\u0000",
    None,
    True,
    [],
    {},
    [None],
]


# --- the DER of a valid document, and its damages ------------------------------------------------------------------


def elements(der: bytes, start: int = 0, end: int | None = None, depth: int = 0) -> list[tuple[int, int]]:
    """(where its tag is, where its length is) of every DER element, inside constructed ones too."""
    end = len(der) if end is None else end
    found: list[tuple[int, int]] = []
    at = start
    while at + 2 <= end and depth < 16:
        tag, first = der[at], der[at + 1]
        count = first & 0x7F if first & 0x80 else 0
        length = int.from_bytes(der[at + 2 : at + 2 + count], "big") if count else first
        value = at + 2 + count
        if value + length > end:
            break
        found.append((at, at + 1))
        if tag & 0x20:
            found.extend(elements(der, value, value + length, depth + 1))
        at = value + length
    return found


@dataclass(frozen=True)
class Damage:
    """A change to a document's DER: ``kind`` at ``at``."""

    kind: str
    at: int
    data: bytes = b""
    count: int = 0

    def apply(self, der: bytes) -> bytes:
        if self.kind == "byte":
            return der[: self.at] + bytes([der[self.at] ^ self.data[0]]) + der[self.at + 1 :]
        if self.kind in ("tag", "length"):
            return der[: self.at] + self.data + der[self.at + 1 :]
        if self.kind == "insert":
            return der[: self.at] + self.data + der[self.at :]
        if self.kind == "delete":
            return der[: self.at] + der[self.at + self.count :]
        assert self.kind == "truncate"
        return der[: self.at]

    def touches_the_proof(self, der: bytes) -> bool:
        """Whether it changes the signed content, the signing certificate or the signature (or cuts the document
        short): then no verifier may take it."""
        if self.kind == "truncate":
            return True
        last = self.at + max(self.count, 1) - 1
        return any(start <= self.at and last < end for start, end in attested.regions(der).values())


def damages(der: bytes) -> st.SearchStrategy[Damage]:
    heads = elements(der)
    anywhere = st.integers(0, len(der) - 1)
    return st.one_of(
        st.builds(Damage, st.just("byte"), anywhere, st.integers(1, 255).map(lambda x: bytes([x]))),
        st.sampled_from(heads).flatmap(
            lambda head: st.builds(
                Damage,
                st.just("tag"),
                st.just(head[0]),
                st.integers(0, 255).filter(lambda t: t != der[head[0]]).map(lambda t: bytes([t])),
            )
        ),
        st.sampled_from(heads).flatmap(
            lambda head: st.builds(
                Damage,
                st.just("length"),
                st.just(head[1]),
                st.sampled_from(
                    [b"\x00", b"\x7f", b"\x80", b"\x81\xff", b"\x84\xff\xff\xff\xff", b"\x89" + b"\x01" * 9]
                    + [bytes([(der[head[1]] + d) % 256]) for d in (-1, 1)]
                ).filter(lambda b: b != der[head[1] : head[1] + 1]),
            )
        ),
        st.builds(Damage, st.just("insert"), anywhere, st.binary(min_size=1, max_size=8)),
        st.builds(Damage, st.just("delete"), anywhere, count=st.integers(1, 8)),
        st.builds(Damage, st.just("truncate"), st.integers(1, len(der) - 1)),
    )


# --- envelopes, impact reports and Event Grid bodies given what no field takes --------------------------------------


def leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in [(*path, key), *leaves(item, (*path, key))]]
    if isinstance(value, list):
        return [p for index, item in enumerate(value) for p in [(*path, index), *leaves(item, (*path, index))]]
    return []


def put(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``value`` with ``path`` set to ``new`` (``...``: taken out)."""
    copy = json.loads(json.dumps(value))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if new is ...:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return copy


def spoiled(data: Any, *, skip: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    """``data`` with one of its fields (at any depth) given a hostile value, or taken out."""
    paths = [p for p in leaves(data) if p[0] not in skip]
    return st.tuples(st.sampled_from(paths), st.sampled_from([*HOSTILE, ...])).map(lambda c: put(data, *c))


# An impact's figures of seconds, and values none of them takes: not finite, beyond a week either way, not numbers.
IMPACT_SECONDS = ("measuredSeconds", "monotonicGapSeconds", "wallGapSeconds", "announcedSeconds")
NOT_SECONDS = [
    *BEYOND_ANY,
    604_800.5,
    -604_800.5,
    "",
    "five",
    [],
    {},
]


def impact_report(who: dict[str, Any], state: str) -> dict[str, Any]:
    data = envelope(who, sequence=2, kind="impact")
    at = DOC_NOW.isoformat()
    data["impact"] = {
        "eventId": f"EV-{who['name']}",
        "eventType": "Freeze",
        "measure": "pause",
        "announcedSeconds": 5,
        "measuredSeconds": 4.8,
        "start": at,
        "end": at,
        "monotonicGapSeconds": 4.8,
        "wallGapSeconds": 4.9,
    }
    data["stateId"] = state
    data["attestation"] = attested.DOCUMENTS.document(who, nonce=state_nonce(state), now=DOC_NOW)
    return data


@dataclass(frozen=True)
class Bad:
    """A hostile message, and whether it must be refused (``certain``) or may pass with its proof whole."""

    message: RawMessage
    certain: bool
    what: str
    original: bytes = b""  # a damaged document: the content it signed


@st.composite
def hostile(draw: st.DrawFn, goods: list[dict[str, Any]]) -> Bad:
    who = identity(f"bad_{next(_names)}", next(_names))
    state = f"bad-{who['name']}"
    valid = freeze(who, f"EV-{who['name']}", state=state)
    key = who["resourceId"].lower()
    kind = draw(st.sampled_from(["document", "document-as-another", "envelope", "impact", "impact-any", "grid"]))
    if kind.startswith("document"):
        # As Azure signs (no signed attributes), or as a CMS library does (with them).
        if draw(st.booleans()):
            valid = with_der(valid, attested.with_signed_attributes(who, state))
        der = attested.der_of(valid)
        damage = draw(damages(der))
        damaged = damage.apply(der)
        if kind == "document-as-another":
            # Its damaged document under a good VM's name and vmId (its own document is of another VM).
            victim = draw(st.sampled_from(goods))
            forged = {**with_der(valid, damaged), "vm": victim}
            return Bad(message(forged), True, f"{kind}: {damage}")
        certain = damage.touches_the_proof(der)
        return Bad(message(with_der(valid, damaged)), certain, f"{kind}: {damage}", signed_content(der))
    if kind == "envelope":
        body = draw(spoiled(valid, skip=("attestation",)))
        return Bad(RawMessage(body=json.dumps(body).encode(), partition_key=key), False, f"{kind}: {body}")
    if kind.startswith("impact"):
        report = impact_report(who, state)
        if kind == "impact":
            field = draw(st.sampled_from(IMPACT_SECONDS))
            value = draw(st.sampled_from(NOT_SECONDS))
            body = put(report, ("impact", field), value)
            return Bad(RawMessage(body=json.dumps(body).encode(), partition_key=key), True, f"{kind}: {field}={value}")
        body = draw(spoiled(report, skip=("attestation",)))
        return Bad(RawMessage(body=json.dumps(body).encode(), partition_key=key), False, f"{kind}: {body}")
    event = draw(spoiled(grid_event(f"EV-{who['name']}", grid_id=f"g-{who['name']}")))
    body = draw(st.sampled_from([event, [event], [grid_event(), event]]))
    # On the VMs' hub, whatever Event Grid's shape it has: only a VM can have sent it.
    return Bad(RawMessage(body=json.dumps(body).encode(), partition_key=key), True, f"grid: {body}")


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def letters(gate: Door) -> dict[str, dict[str, Any]]:
    """The dead-letter table by row key (its rows are ordered by key, not by arrival)."""
    return {str(letter["RowKey"]): letter for letter in gate.store.dead_letters()}


def check(gate: Door, goods: list[tuple[dict[str, Any], str]], bads: list[Bad], report: Any, before: set[str]) -> None:
    new = [letter for key, letter in letters(gate).items() if key not in before]
    dead = Counter(str(letter["BodySha256"]) for letter in new)
    reasons = {str(letter["BodySha256"]): str(letter["Reason"]) for letter in new}
    assert report.dead_lettered == len(new)
    for who, event_id in goods:
        assert (event_id, who["name"]) in gate.listeners.approved, f"{who['name']}'s Freeze was not approved"
        stored = read_event(gate.store, event_id)
        assert stored is not None
        assert stored.record.approval is not None
    for bad in bads:
        digest = sha(bad.message.body)
        if dead[digest]:
            dead[digest] -= 1
            event(f"refused: {bad.what.split(':')[0]}")
            if bad.what.startswith("document"):
                assert reasons[digest].startswith("attestation refused: "), (bad.what, reasons[digest])
            continue
        assert not bad.certain, f"not refused: {bad.what}"
        event(f"taken: {bad.what.split(':')[0]}")
        if bad.original:  # taken: the verifier read the very content the VM's IMDS signed
            body = json.loads(bad.message.body)
            assert signed_content(attested.der_of(body)) == bad.original, bad.what
    assert not +dead, f"dead-lettered and not among the bad: {dead}"


def test_hostile_messages_cost_only_themselves(tmp_path: Path) -> None:
    gate = door(tmp_path / "cards")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data(), good_count=st.integers(1, 3), bad_count=st.integers(1, 4))
    def batch(data: st.DataObject, good_count: int, bad_count: int) -> None:
        goods = []
        for _ in range(good_count):
            who = identity(f"good_{next(_names)}", next(_names))
            goods.append((who, f"EV-{who['name']}"))
        bads = [data.draw(hostile([who for who, _ in goods])) for _ in range(bad_count)]
        good_messages = [message(freeze(who, event_id, state=f"s-{who['name']}")) for who, event_id in goods]
        messages = data.draw(st.permutations([*good_messages, *(bad.message for bad in bads)]))
        before = set(letters(gate))

        report = gate.coordinator.process_batch(messages)

        check(gate, goods, bads, report, before)

    batch()


def test_hostile_event_grid_bodies_cost_only_themselves(tmp_path: Path) -> None:
    """The platform's hub: good Event Grid events beside spoiled ones and envelopes (which only VMs send)."""
    gate = door(tmp_path / "cards")

    @settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data(), good_count=st.integers(1, 3), bad_count=st.integers(1, 4))
    def batch(data: st.DataObject, good_count: int, bad_count: int) -> None:
        goods = []
        for _ in range(good_count):
            n = next(_names)
            event = grid_event(f"EV-G{n}", grid_id=f"g-{n}", scale_set=f"ss{n}", resources=[f"ss{n}_0"])
            goods.append(event)
        bads = []
        for _ in range(bad_count):
            n = next(_names)
            event = data.draw(spoiled(grid_event(f"EV-G{n}", grid_id=f"g-{n}", scale_set=f"ss{n}")))
            who = identity(f"bad_{n}", n)
            envelope_body = freeze(who, f"EV-{n}", state=f"s-{n}")
            body = data.draw(st.sampled_from([event, [event], envelope_body]))
            bads.append(Bad(RawMessage(body=json.dumps(body).encode()), body is envelope_body, f"{body}"))
        messages = data.draw(
            st.permutations([RawMessage(body=json.dumps(good).encode()) for good in goods] + [b.message for b in bads])
        )
        before = set(letters(gate))

        report = gate.coordinator.process_batch(messages, channel="platform")

        new = [letter for key, letter in letters(gate).items() if key not in before]
        assert report.dead_lettered == len(new)
        for good in goods:
            event_id = good["data"]["resourceInfo"]["properties"]["EventId"]
            assert read_event(gate.store, event_id) is not None, f"{event_id} was not applied"
        dead = Counter(str(letter["BodySha256"]) for letter in new)
        for bad in bads:
            if dead[sha(bad.message.body)]:
                dead[sha(bad.message.body)] -= 1
            else:
                assert not bad.certain, f"not refused: {bad.what}"
        assert not +dead, f"dead-lettered and not among the bad: {dead}"

    batch()
