"""Pure parts of the relay approval path: tokens, message framing, freshness and the approval judgement."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote

import pytest

from contracts.attested import decision_nonce
from contracts.envelope import VmIdentity
from contracts.sas import relay_resource_uri, sas_token
from contracts.wire import ApprovalFacts, ApprovalRequest, Attestation, ScheduledEvent, ScheduledEventsDocument
from coordinator.adapters.relay_admin import hybrid_connections_to_delete, namespace_for_vm
from emulators.relay.auth import AuthError, Right, SasRule, TokenChecker, create_sas_token
from forwarder.approval_rules import Freshness, judge, refuse_stale
from forwarder.approver import Approver
from forwarder.decisions import LedgerEntry, MemoryLedger
from forwarder.imds import ImdsDeadlinePassed, ImdsInvalidResponse
from forwarder.relay_protocol import RelayRequest, RelayResponse, relative_path, response_frame
from forwarder.relay_tokens import SasTokenProvider

NOW = datetime(2026, 11, 21, 6, 0, tzinfo=UTC)
KEY = "c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="


def approval(**changes: object) -> ApprovalRequest:
    values: dict[str, object] = {
        "eventId": "E1",
        "decisionId": "d-1",
        "rule": "approve-freeze",
        "issuedAt": NOW - timedelta(seconds=5),
        "expiresAt": NOW + timedelta(minutes=10),
        "notAfter": NOW + timedelta(minutes=10),
    }
    values.update(changes)
    return ApprovalRequest.from_mapping(values)


def document(*events: dict[str, object]) -> ScheduledEventsDocument:
    return ScheduledEventsDocument.from_mapping({"DocumentIncarnation": 7, "Events": list(events)})


def event(
    event_id: str = "E1", status: str = "Scheduled", resources: tuple[str, ...] = ("WestNO_0",)
) -> dict[str, object]:
    return {"EventId": event_id, "EventType": "Freeze", "Resources": list(resources), "EventStatus": status}


# ---------------------------------------------------------------------------------------------- SAS


def test_sas_token_matches_the_hyco_construction_and_is_accepted_by_the_relay_checker():
    resource = relay_resource_uri("wss://ns.servicebus.windows.net", "vm-abc")
    assert resource == "http://ns.servicebus.windows.net/vm-abc"
    mine = sas_token(resource_uri=resource, key_name="listen", key=KEY, expires_on=2_000_000_000)
    theirs = create_sas_token(resource, key_name="listen", key=KEY, expires_in=2_000_000_000, now=0)
    assert mine == theirs
    checker = TokenChecker(sas_rules={"listen": SasRule(KEY, frozenset({Right.LISTEN}))}, clock=lambda: 1_900_000_000)
    assert checker.authorize(mine, hybrid_connection="vm-abc", right=Right.LISTEN).kind == "sas"
    with pytest.raises(AuthError) as refused:
        checker.authorize(mine, hybrid_connection="vm-other", right=Right.LISTEN)
    assert refused.value.status == 403


def test_sas_signature_is_fully_url_encoded():
    # Find an expiry whose signature contains '/' or '+': quote() with the default safe='/' would leave it raw.
    resource = "http://ns/vm-a"
    for expires_on in range(1_000, 1_200):
        token = sas_token(resource_uri=resource, key_name="k", key=KEY, expires_on=expires_on)
        sig = token.split("sig=")[1].split("&")[0]
        raw = base64.b64encode(
            hmac.new(KEY.encode(), f"http%3A%2F%2Fns%2Fvm-a\n{expires_on}".encode(), hashlib.sha256).digest()
        ).decode()
        if "/" in raw or "+" in raw:
            assert "/" not in sig
            assert "+" not in sig
            assert unquote(sig) == raw
            return
    pytest.fail("no signature with '/' or '+' in 200 tries")


def test_sas_provider_reads_the_key_file_each_time(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    provider = SasTokenProvider(resource_uri="http://ns/vm-a", key_name="listen", key_file=key_file)
    first = provider.get_token()
    assert first.token.startswith("SharedAccessSignature sr=http%3A%2F%2Fns%2Fvm-a&sig=")
    key_file.write_text("rotated")
    assert provider.get_token().token != first.token
    key_file.unlink()
    with pytest.raises(RuntimeError, match="cannot read the SAS key file"):
        provider.get_token()


def test_relay_resource_uri_needs_a_host():
    with pytest.raises(ValueError, match="no host name"):
        relay_resource_uri("not a url", "vm-a")


# ---------------------------------------------------------------------------------------------- framing


def test_response_frame_drops_hop_by_hop_headers_and_reserved_statuses():
    frame = json.loads(
        response_frame("r1", RelayResponse(502, "x", {"Content-Length": "3", "X-Ok": "1", "Connection": "close"}, b"a"))
    )["response"]
    assert frame == {
        "requestId": "r1",
        "statusCode": 500,
        "statusDescription": "x",
        "responseHeaders": {"X-Ok": "1"},
        "body": True,
    }
    assert json.loads(response_frame("r2", RelayResponse(204)))["response"]["body"] is False


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/vm-a/approve?x=1", "/approve"),
        ("/VM-A/approve", "/approve"),
        ("/approve", "/approve"),
        ("/vm-a", "/"),
        ("/vm-ab/approve", "/vm-ab/approve"),
    ],
)
def test_relative_path_strips_the_hybrid_connection(target, expected):
    assert relative_path(target, "vm-a") == expected


# ---------------------------------------------------------------------------------------------- approval rules


def test_fresh_request_passes():
    assert refuse_stale(approval(), now=NOW, freshness=Freshness()) is None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"expiresAt": NOW - timedelta(seconds=1)}, "expired at"),
        ({"issuedAt": NOW + timedelta(minutes=5)}, "in the future"),
        ({"issuedAt": NOW - timedelta(hours=1)}, "older than"),
        ({"issuedAt": NOW, "expiresAt": NOW}, "is not after issuedAt"),
    ],
)
def test_stale_requests_are_refused(changes, reason):
    assert reason in (refuse_stale(approval(**changes), now=NOW, freshness=Freshness()) or "")


def test_small_clock_skew_is_tolerated():
    assert refuse_stale(approval(issuedAt=NOW + timedelta(seconds=90)), now=NOW, freshness=Freshness()) is None


def test_a_request_is_refused_from_the_tolerance_before_its_not_after():
    """The listener never executes a decision past its notAfter: from 2 s before it (the clock tolerance), on its own
    clock, it refuses, naming the condition that ended."""
    just_in_time = approval(notAfter=NOW + timedelta(seconds=2.001), notAfterReason="blackout 'night' opens")
    assert refuse_stale(just_in_time, now=NOW, freshness=Freshness()) is None
    too_late = approval(notAfter=NOW + timedelta(seconds=2), notAfterReason="blackout 'night' opens")
    reason = refuse_stale(too_late, now=NOW, freshness=Freshness()) or ""
    assert reason.startswith(f"expired at {(NOW + timedelta(seconds=2)).isoformat()} (blackout 'night' opens)")
    assert "refused from 2 s before it" in reason
    # expiresAt counts too when it is the earlier (a request as any coordinator dates it).
    assert "expired at" in (refuse_stale(approval(expiresAt=NOW), now=NOW, freshness=Freshness()) or "")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"notAfter": None}, "names no notAfter"),
        # No far-future approvals: year 9999, or anything more than 15 minutes ahead.
        ({"notAfter": datetime(9999, 12, 31, tzinfo=UTC)}, "is more than 0:15:00 ahead"),
        ({"notAfter": NOW + timedelta(minutes=15, seconds=1)}, "is more than 0:15:00 ahead"),
        # Never past the event's NotBefore (+ the tolerance), even within 15 minutes.
        (
            {
                "notAfter": NOW + timedelta(minutes=5, seconds=3),
                "facts": {
                    "eventType": "Freeze",
                    "eventSource": "Platform",
                    "durationInSeconds": 5,
                    "notBefore": NOW + timedelta(minutes=5),
                    "resources": ["WestNO_0"],
                },
            },
            "is after the event's NotBefore",
        ),
    ],
)
def test_a_request_without_a_not_after_or_dated_too_far_is_refused(changes, reason):
    assert reason in (refuse_stale(approval(**changes), now=NOW, freshness=Freshness()) or "")


def test_the_memory_ledger_keeps_the_durable_ones_bounds():
    ledger = MemoryLedger(keep=timedelta(hours=1), max_entries=2)
    ledger.remember_decision(LedgerEntry("d-1", "E1", "approved", NOW))
    ledger.remember_decision(LedgerEntry("d-2", "E2", "refused", NOW + timedelta(minutes=1)))
    assert ledger.decision("d-1") is not None
    ledger.remember_decision(LedgerEntry("d-3", "E3", "refused", NOW + timedelta(minutes=2)))
    assert [ledger.decision(f"d-{i}") is not None for i in (1, 2, 3)] == [False, True, True]
    ledger.remember_decision(LedgerEntry("d-4", "E4", "refused", NOW + timedelta(hours=1, minutes=2)))
    assert [ledger.decision(f"d-{i}") is not None for i in (2, 3, 4)] == [False, True, True]


def decided(raw: dict[str, object], **changes: object) -> ApprovalRequest:
    """The request a coordinator sends for `raw` (an event as IMDS lists it), the facts taken from it."""
    facts = ApprovalFacts.of(ScheduledEvent.from_mapping(raw))
    return approval(eventId=raw["EventId"], facts=facts.replace(**changes))


def test_judge():
    me = "WestNO_1"  # a peer of WestNO_0 in the group: it may approve WestNO_0's Freeze
    assert judge(decided(event()), document(event()), vm_name=me) == ("approved", "")
    assert judge(approval(), document(event("E2")), vm_name=me)[0] == "not-found"
    assert judge(approval(), document(event(status="Started")), vm_name=me) == ("not-scheduled", "the event is Started")
    assert judge(approval(), document(event(resources=())), vm_name=me)[0] == "rejected"


def test_a_terminate_is_approved_only_by_the_vm_it_deletes():
    def terminate(*resources: str) -> ScheduledEventsDocument:
        return document({**event(resources=resources), "EventType": "Terminate"})

    def terminate_of(*resources: str) -> ApprovalRequest:
        return decided({**event(resources=resources), "EventType": "Terminate"})

    assert judge(terminate_of("web_2"), terminate("web_2"), vm_name="web_2") == ("approved", "")
    assert judge(terminate_of("web_1", "web_2"), terminate("web_1", "web_2"), vm_name="web_2") == ("approved", "")
    assert judge(approval(), terminate("web_2"), vm_name="web_0") == (
        "rejected",
        "Terminate of web_2 can be approved only by web_2 itself, not by web_0 "
        "(Azure: each VM approves only the EventId relevant to it)",
    )
    outcome, reason = judge(approval(), terminate("web_1", "web_2"), vm_name="web_0")
    assert outcome == "rejected"
    assert reason.startswith("Terminate of web_1, web_2 can be approved only by web_1 or web_2 itself")
    # Matched on the IMDS compute name exactly, as Resources lists it (never the hostname, never a prefix).
    assert judge(approval(), terminate("web_2"), vm_name="web_")[0] == "rejected"


@pytest.mark.parametrize(
    ("decided_on", "named"),
    [
        # What a VM lying to the coordinator could have made it decide on, each refused by the VM's own IMDS.
        ({"eventType": "Freeze"}, "EventType is 'Reboot' here, the decision rested on 'Freeze'"),
        ({"durationInSeconds": 5}, "DurationInSeconds is -1 here, the decision rested on 5"),
        ({"eventSource": "User"}, "EventSource is 'Platform' here, the decision rested on 'User'"),
        ({"resources": ["WestNO_0"]}, "Resources is ['WestNO_0', 'WestNO_1'] here"),
        ({"notBefore": NOW}, "NotBefore is datetime.datetime(2026, 11, 21, 6, 15"),
    ],
)
def test_the_listener_refuses_facts_its_own_imds_document_does_not_show(decided_on, named):
    raw = {
        **event(resources=("WestNO_0", "WestNO_1")),
        "EventType": "Reboot",
        "DurationInSeconds": -1,
        "NotBefore": "Sat, 21 Nov 2026 06:15:00 GMT",
    }
    assert judge(decided(raw), document(raw), vm_name="WestNO_1") == ("approved", "")
    outcome, reason = judge(decided(raw, **decided_on), document(raw), vm_name="WestNO_1")
    assert outcome == "rejected"
    assert reason.startswith("facts differ from this VM's IMDS document: ")
    assert named in reason


def test_the_same_facts_in_another_notation_agree():
    # Resources in another order and NotBefore as ISO 8601 (Microsoft's mock server) are the same facts.
    raw = {**event(resources=("WestNO_0", "WestNO_1")), "NotBefore": "Sat, 21 Nov 2026 06:15:00 GMT"}
    other = {**raw, "Resources": ["WestNO_1", "WestNO_0"], "NotBefore": "2026-11-21T07:15:00+01:00"}
    assert judge(decided(raw), document(other), vm_name="WestNO_0") == ("approved", "")


def test_a_request_without_facts_is_refused():
    outcome, reason = judge(approval(), document(event()), vm_name="WestNO_0")
    assert (outcome, reason) == (
        "rejected",
        "the request names no facts to check against this VM's IMDS document (upgrade the coordinator)",
    )


def test_a_decision_resting_on_this_vms_hooks_needs_its_own_ledger_to_agree():
    raw = {**event(resources=("web_2",)), "EventType": "Terminate"}
    request = decided(raw, hooksRequired=["web_2"])
    ledger = {"E1": "failed"}  # the coordinator was told "succeeded" by someone else with the fleet identity
    outcome, reason = judge(request, document(raw), vm_name="web_2", prepare_outcome=ledger.get)
    assert (outcome, reason) == (
        "rejected",
        "the decision rested on web_2's prepare hooks, and its own ledger says failed",
    )
    outcome, reason = judge(request, document(raw), vm_name="web_2", prepare_outcome=dict[str, str]().get)
    assert reason.endswith("its own ledger says they have not finished")
    assert judge(request, document(raw), vm_name="web_2", prepare_outcome={"E1": "succeeded"}.get) == ("approved", "")
    # Without a ledger at all (a listener built without the store) such a decision is refused, never assumed.
    assert judge(request, document(raw), vm_name="web_2")[0] == "rejected"
    # A decision that did not rest on this VM's hooks does not consult the ledger.
    assert judge(decided(raw), document(raw), vm_name="web_2", prepare_outcome=ledger.get) == ("approved", "")


# ---------------------------------------------------------------------------------------------- admin


def vm(vm_id: str) -> VmIdentity:
    return VmIdentity(name=f"n-{vm_id}", vmId=vm_id, resourceId=f"/subscriptions/s/vms/{vm_id}")


def test_namespace_sharding_is_stable_and_spread():
    namespaces = ["https://a", "https://b", "https://c", "https://d"]
    rng = random.Random(7)
    ids = [f"{rng.getrandbits(128):032x}" for _ in range(4000)]
    picks = [namespace_for_vm(vm(i), namespaces) for i in ids]
    assert picks == [namespace_for_vm(vm(i.upper()), namespaces) for i in ids]  # case-insensitive, deterministic
    counts = {ns: picks.count(ns) for ns in namespaces}
    assert all(850 < count < 1150 for count in counts.values()), counts
    with pytest.raises(ValueError, match="at least one"):
        namespace_for_vm(vm("x"), [])


def test_which_hybrid_connections_to_delete():
    existing = ["vm-live", "vm-silent", "vm-gone", "vm-unknown", "shared-ops", "VM-Recent"]
    last_seen = {
        "vm-live": NOW - timedelta(minutes=1),
        "vm-silent": NOW - timedelta(days=2),
        "vm-gone": NOW - timedelta(minutes=1),
        "vm-recent": NOW - timedelta(hours=23),
    }
    doomed = hybrid_connections_to_delete(
        existing, last_seen=last_seen, gone=["VM-GONE"], now=NOW, silence_limit=timedelta(days=1)
    )
    assert doomed == ["vm-gone", "vm-silent", "vm-unknown"]


def test_a_request_that_lapses_while_the_fresh_document_is_read_is_not_executed():
    """Once a request lapses the coordinator may send the event to a peer (pipeline/act.py reroute_at): the listener
    checks notAfter again right before its POST, so a read that waited (IMDS's rate limit) cannot make two VMs
    execute one event."""

    class SlowImds:
        def __init__(self) -> None:
            self.posts: list[list[str]] = []

        def get_document(self) -> ScheduledEventsDocument:
            clock.now += timedelta(seconds=1)  # the read waited a second
            return document(event())

        def approve(self, event_ids: Iterable[str], *, before: float | None = None) -> None:
            self.posts.append(list(event_ids))

    class Clock:
        now = NOW

        def __call__(self) -> datetime:
            return self.now

    clock, imds = Clock(), SlowImds()
    approver = Approver(imds=imds, vm_name="WestNO_0", clock=clock)
    facts = ApprovalFacts(eventType="Freeze", eventSource="Platform", durationInSeconds=-1, notBefore=None,
                          resources=["WestNO_0"])  # fmt: skip

    def relay(request: ApprovalRequest) -> dict[str, Any]:
        body = request.to_json_bytes()
        headers = {"Content-Type": "application/json"}
        answer = approver(RelayRequest("r", "POST", "/vm/approve", "/approve", headers, body))
        answer_body: dict[str, Any] = json.loads(answer.body)
        return answer_body

    # Valid on arrival (2.5 s before notAfter, the tolerance 2 s), lapsed once the read is done.
    lapsing = approval(notAfter=NOW + timedelta(seconds=2.5), expiresAt=NOW + timedelta(seconds=2.5), facts=facts)
    answer = relay(lapsing)
    assert (answer["outcome"], imds.posts) == ("rejected", [])
    assert str(answer["reason"]).startswith("expired at")
    # With time to spare it is executed, once.
    clock.now = NOW
    assert relay(approval(decisionId="d-2", facts=facts))["outcome"] == "approved"
    assert imds.posts == [["E1"]]


class _ApprovingImds:
    """A stand-in IMDS: an approved event is Started in every later read."""

    def __init__(self, *event_ids: str) -> None:
        self.started: set[str] = set()
        self.event_ids = event_ids
        self.posts: list[list[str]] = []

    def get_document(self) -> ScheduledEventsDocument:
        return document(*(event(e, "Started" if e in self.started else "Scheduled") for e in self.event_ids))

    def approve(self, event_ids: Iterable[str], *, before: float | None = None) -> None:
        self.posts.append(list(event_ids))
        self.started.update(event_ids)


def _together(approver: Approver, *requests: ApprovalRequest) -> list[str]:
    """The requests arrive at once (their proofs are made together), then are decided one at a time."""
    answers: dict[int, str] = {}

    def relay(index: int, request: ApprovalRequest) -> None:
        body = request.to_json_bytes()
        relayed = RelayRequest(
            str(index), "POST", "/vm/approve", "/approve", {"Content-Type": "application/json"}, body
        )
        answers[index] = json.loads(approver(relayed).body)["outcome"]

    threads = [threading.Thread(target=relay, args=(i, r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    return [answers[i] for i in range(len(requests))]


def _request(event_id: str = "E1", decision_id: str = "d-1") -> ApprovalRequest:
    facts = ApprovalFacts.of(document(event(event_id)).Events[0])
    return approval(eventId=event_id, decisionId=decision_id, facts=facts)


def _approver(imds: _ApprovingImds, arriving: int) -> Approver:
    barrier = threading.Barrier(arriving)
    calls = iter(range(1_000))

    def attest(nonce: str) -> Attestation:
        if next(calls) < arriving:
            barrier.wait(5)  # the first ``arriving`` requests have all arrived before any is decided
        raise ImdsInvalidResponse("no attested document here")

    return Approver(imds=imds, vm_name="WestNO_0", clock=lambda: NOW, attest=attest)


def test_approvals_that_arrive_together_are_judged_on_one_read_made_after_they_arrived():
    """IMDS allows ~5 requests/s per VM: a peer executing several approvals at once read the document once each,
    and a burst of four took 8-10 s (oracle seeds 5 and 41). A document whose read began after a request arrived
    is as fresh as one read on its arrival."""
    imds = _ApprovingImds("E1", "E2", "E3")
    approver = _approver(imds, 3)
    requests = [_request(e, f"d-{e}") for e in ("E1", "E2", "E3")]
    assert _together(approver, *requests) == ["approved", "approved", "approved"]
    assert sorted(map(tuple, imds.posts)) == [("E1",), ("E2",), ("E3",)]
    assert approver.imds_reads == 1
    # A request that arrives later is judged on a read made after it arrived.
    assert _together(approver, _request("E1", "d-late"))[0] == "not-scheduled"
    assert approver.imds_reads == 2


def test_an_event_posted_since_the_shared_read_is_read_again():
    """Two decisions for one event arriving together (a person's and a rule's, or a reroute): the second is judged
    on a read made after the first's POST, and finds it Started."""
    imds = _ApprovingImds("E1")
    approver = _approver(imds, 2)
    outcomes = _together(approver, _request(decision_id="d-a"), _request(decision_id="d-b"))
    assert sorted(outcomes) == ["approved", "not-scheduled"]
    assert imds.posts == [["E1"]]
    assert approver.imds_reads == 2


def test_a_request_that_lapses_while_its_post_waits_its_turn_is_refused_and_not_sent():
    """The POST waits for IMDS's rate limit (or a retry) after the last check: the listener gives it the request's
    own deadline, and a POST that could only start after it is not sent and the request is refused as expired."""

    class QueuedImds(_ApprovingImds):
        def approve(self, event_ids: Iterable[str], *, before: float | None = None) -> None:
            assert before is not None
            if before - time.monotonic() < 60:  # the limiter's queue here is a minute long
                raise ImdsDeadlinePassed("IMDS POST not sent: its deadline passed while it waited its turn")
            super().approve(event_ids)

    imds = QueuedImds("E1")
    approver = Approver(imds=imds, vm_name="WestNO_0", clock=lambda: NOW)
    short = approval(notAfter=NOW + timedelta(seconds=30), facts=_request().facts)
    answer = json.loads(
        approver(
            RelayRequest(
                "r", "POST", "/vm/approve", "/approve", {"Content-Type": "application/json"}, short.to_json_bytes()
            )
        ).body
    )
    assert (answer["outcome"], imds.posts) == ("rejected", [])
    assert "expired while waiting to reach IMDS" in answer["reason"]
    assert approver.imds_posts == 0


def test_requests_for_one_decision_arriving_together_share_one_proof():
    """The nonce names the decision: three runs sending one decision at once each spent one of the VM's IMDS
    requests on its proof, and the POST behind them lapsed (oracle seed 56). One attested call answers them all."""
    imds = _ApprovingImds("E1")
    made: list[str] = []
    lock = threading.Lock()

    def attest(nonce: str) -> Attestation:
        with lock:
            made.append(nonce)
        time.sleep(0.2)  # IMDS's answer takes a moment: the other requests arrive while it is made
        return Attestation(encoding="pkcs7", signature="c2lnbmVk")

    approver = Approver(imds=imds, vm_name="WestNO_0", clock=lambda: NOW, attest=attest)
    same = _request(decision_id="d-same")
    assert sorted(_together(approver, same, same, same)) == ["approved", "approved", "approved"]
    assert made == [decision_nonce("d-same")]
    assert imds.posts == [["E1"]]
    # Another decision gets its own proof.
    _together(approver, _request(decision_id="d-other"))
    assert made == [decision_nonce("d-same"), decision_nonce("d-other")]
