"""Approvals from RelayApprovalSender.send(...) through the Relay emulator to the IMDS emulator, and refusals."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from azure.core.credentials import AzureNamedKeyCredential

from contracts.envelope import VmIdentity
from coordinator.adapters.callback import ApprovalCallback, ApprovalDeliveryError
from coordinator.adapters.relay_sender import RelayApprovalSender
from emulators.imds import ImdsEmulator
from emulators.relay import RelayEmulator
from emulators.relay.auth import create_sas_token
from forwarder.decisions import LedgerEntry
from forwarder.durable_state import Store
from tests.relay.conftest import (
    SEND_KEY,
    VM_A0,
    VM_A1,
    VM_B0,
    MintedCredential,
    Vm,
    approval,
    facts_of,
    imds_client,
    scheduled_event,
)


def approved_ids(imds: ImdsEmulator) -> list[str]:
    return [item["EventId"] for item in imds.approvals()]


def test_approval_reaches_imds_end_to_end(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    callback: ApprovalCallback = sender
    result = callback.send(approval(event_id), vm=vm.identity)
    assert result.outcome == "approved"
    assert [(item["EventId"], item["vm"]) for item in imds.approvals()] == [(event_id, VM_A0)]
    assert result.documentIncarnation == imds.approvals()[0]["incarnation"]


def test_a_vm_may_approve_an_event_of_its_group_for_another_member(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    vm = start_vm(VM_A1)
    event_id = scheduled_event(imds, VM_A0)  # same placement group: visible in web_1's document
    assert sender.send(approval(event_id), vm=vm.identity).outcome == "approved"
    assert [(item["EventId"], item["vm"]) for item in imds.approvals()] == [(event_id, VM_A1)]


def test_a_terminate_is_approved_only_through_the_vm_it_deletes(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    """Azure: every VM of a scale set approves only the EventId relevant to it. A peer that sees web_1's delete in
    its own document (same placement group) still refuses to approve it."""
    peer, doomed = start_vm(VM_A0), start_vm(VM_A1)
    created = imds.create_event(EventType="Terminate", Resources=[VM_A1])
    facts_of(created)  # what the coordinator recorded: the listener checks the request's facts too
    event_id = created["EventId"]
    refused = sender.send(approval(event_id), vm=peer.identity)
    assert refused.outcome == "rejected"
    assert refused.reason == (
        f"Terminate of {VM_A1} can be approved only by {VM_A1} itself, not by {VM_A0} "
        "(Azure: each VM approves only the EventId relevant to it)"
    )
    assert refused.documentIncarnation is not None  # judged on a fresh document, where the event is listed
    assert imds.approvals() == []
    assert sender.send(approval(event_id), vm=doomed.identity).outcome == "approved"
    assert [(item["EventId"], item["vm"]) for item in imds.approvals()] == [(event_id, VM_A1)]


def test_same_decision_again_is_idempotent_and_another_event_with_it_is_a_replay(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    vm = start_vm(VM_A0, auth="sas")
    first, second = scheduled_event(imds, VM_A0), scheduled_event(imds, VM_A0)
    request = approval(first, decision="decision-1")
    assert sender.send(request, vm=vm.identity).outcome == "approved"
    again = sender.send(request, vm=vm.identity)
    assert again.outcome == "approved"
    replay = sender.send(approval(second, decision="decision-1"), vm=vm.identity)
    assert replay.outcome == "rejected"
    assert "already used for event" in replay.reason
    assert approved_ids(imds) == [first]
    assert vm.approver.imds_posts == 1


def test_a_decision_replayed_after_the_listener_restarts_is_not_executed_again(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender, tmp_path: Path
) -> None:
    """The listener's decision ledger lives in the forwarder's state, next to the spool: a decision it executed is
    answered from there after a restart, without a second StartRequests; one whose execution a crash interrupted is
    judged again on a document read now: POSTed while its event is still Scheduled, refused once it started."""
    state = tmp_path / "state" / "forwarder.sqlite"
    store = Store(state)
    vm = start_vm(VM_A0, auth="sas", ledger=store)
    event_id = scheduled_event(imds, VM_A0)
    request = approval(event_id, decision="decision-1")
    assert sender.send(request, vm=vm.identity).outcome == "approved"
    vm.listener.stop(timeout=5)
    store.close()

    restarted = Store(state)  # the forwarder process started again, with its state directory
    again = start_vm(VM_A0, auth="sas", ledger=restarted)
    replayed = sender.send(request, vm=again.identity)
    assert (replayed.outcome, replayed.decisionId) == ("approved", "decision-1")  # the stored answer
    assert approved_ids(imds) == [event_id]  # one StartRequests in all
    assert again.approver.imds_posts == 0

    # A crash between "executing" and IMDS's answer, IMDS never reached: the event is still Scheduled, so the retry
    # starts it (refused, the rule's approval was lost until NotBefore).
    other = scheduled_event(imds, VM_A0)
    restarted.remember_decision(LedgerEntry("decision-2", other, "executing", datetime.now(UTC)))
    interrupted = sender.send(approval(other, decision="decision-2"), vm=again.identity)
    assert (interrupted.outcome, interrupted.reason) == ("approved", "")
    assert approved_ids(imds) == [event_id, other]
    assert again.approver.imds_posts == 1

    # The same crash after IMDS took the POST: the event is no longer Scheduled, so nothing is POSTed again.
    restarted.remember_decision(LedgerEntry("decision-3", event_id, "executing", datetime.now(UTC)))
    taken = sender.send(approval(event_id, decision="decision-3"), vm=again.identity)
    assert (taken.outcome, taken.reason) == ("not-scheduled", "the event is Started")
    assert approved_ids(imds) == [event_id, other]
    assert again.approver.imds_posts == 1


def test_the_listener_refuses_a_request_past_its_not_after_or_dated_far_ahead(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], relay: RelayEmulator
) -> None:
    """Whatever the sender believes (its clock behind), the listener's own clock decides: a request whose notAfter
    has come is refused, and so is one dated year 9999; nothing reaches IMDS."""
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    now = datetime.now(UTC)
    late = approval(event_id, issued=now - timedelta(seconds=40), valid_for=timedelta(seconds=41))
    far = approval(event_id).model_copy(update={"notAfter": datetime(9999, 12, 31, tzinfo=UTC)})
    with RelayApprovalSender(
        endpoint=relay.base_url,
        credential=AzureNamedKeyCredential("send", SEND_KEY),
        clock=lambda: now - timedelta(minutes=1),
    ) as behind:
        refused_late = behind.send(late, vm=vm.identity)
        refused_far = behind.send(far, vm=vm.identity)
    assert refused_late.outcome == "rejected"
    assert refused_late.reason.startswith("expired at")
    assert refused_far.outcome == "rejected"
    assert "9999-12-31T00:00:00+00:00 is more than 0:15:00 ahead" in refused_far.reason
    assert imds.approvals() == []


@pytest.mark.parametrize(
    ("issued", "valid_for", "reason"),
    [
        (timedelta(minutes=-20), timedelta(minutes=10), "expired at"),
        (timedelta(minutes=10), timedelta(minutes=10), "in the future"),
        (timedelta(hours=-2), timedelta(hours=3), "older than"),
    ],
)
def test_expired_and_badly_dated_requests_are_refused(  # noqa: PLR0917 - fixtures plus parameters
    imds: ImdsEmulator,
    start_vm: Callable[..., Vm],
    relay: RelayEmulator,
    issued: timedelta,
    valid_for: timedelta,
    reason: str,
) -> None:
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    request = approval(event_id, issued=datetime.now(UTC) + issued, valid_for=valid_for)
    # The sender itself would not send an expired request; give it a clock that believes it is still valid.
    with RelayApprovalSender(
        endpoint=relay.base_url,
        credential=AzureNamedKeyCredential("send", SEND_KEY),
        clock=lambda: request.issuedAt,
    ) as skewed:
        result = skewed.send(request, vm=vm.identity)
    assert result.outcome == "rejected"
    assert reason in result.reason
    assert imds.approvals() == []


def test_sender_does_not_send_what_has_already_expired(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    vm = start_vm(VM_A0)
    request = approval(scheduled_event(imds, VM_A0), issued=datetime.now(UTC) - timedelta(minutes=20))
    with pytest.raises(ApprovalDeliveryError, match="expired"):
        sender.send(request, vm=vm.identity)
    assert imds.approvals() == []


def test_events_of_another_group_unknown_or_started_are_not_approved(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender
) -> None:
    vm = start_vm(VM_A0)
    other_group = scheduled_event(imds, VM_B0)
    started = imds.create_event(EventType="Reboot", Resources=[VM_A0], EventStatus="Started")["EventId"]
    unknown = str(uuid.uuid4()).upper()
    outcomes = {
        name: sender.send(approval(event_id), vm=vm.identity)
        for name, event_id in {"other": other_group, "started": started, "unknown": unknown}.items()
    }
    assert {name: result.outcome for name, result in outcomes.items()} == {
        "other": "not-found",
        "started": "not-scheduled",
        "unknown": "not-found",
    }
    assert all(result.documentIncarnation is not None for result in outcomes.values())
    assert imds.approvals() == []


def post_raw(
    relay: RelayEmulator, path: str, body: bytes, *, method: str = "POST", **headers: str
) -> requests.Response:
    url = f"{relay.base_url}/{path}"
    token = create_sas_token(relay.resource_uri(path.split("/", maxsplit=1)[0]), key_name="send", key=SEND_KEY)
    return requests.request(method, url, data=body, headers={"ServiceBusAuthorization": token, **headers}, timeout=10)


def test_malformed_requests_get_a_4xx_naming_the_problem(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], relay: RelayEmulator
) -> None:
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    hc = vm.identity.hybrid_connection_name
    good = approval(event_id).model_dump_json().encode()
    missing_rule = json.dumps({k: v for k, v in json.loads(good).items() if k != "rule"}).encode()
    naive = json.loads(good) | {"issuedAt": "2026-11-21T06:00:00"}
    cases = [
        (post_raw(relay, f"{hc}/approve", b"{not json", **{"Content-Type": "application/json"}), 400, "invalid"),
        (
            post_raw(relay, f"{hc}/approve", missing_rule, **{"Content-Type": "application/json"}),
            400,
            "rule: Field required",
        ),
        (post_raw(relay, f"{hc}/approve", json.dumps(naive).encode()), 400, "issuedAt: must carry a UTC offset"),
        (post_raw(relay, f"{hc}/approve", good, **{"Content-Type": "text/plain"}), 415, "text/plain"),
        (post_raw(relay, f"{hc}/approve", b"", method="GET"), 405, "use POST"),
        (post_raw(relay, f"{hc}/delete-everything", good), 404, "/approve"),
    ]
    for response, status, reason in cases:
        assert response.status_code == status, response.text
        assert reason in response.json()["error"]
    assert imds.approvals() == []


def test_oversized_request_travels_by_rendezvous_and_is_refused(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], relay: RelayEmulator
) -> None:
    vm = start_vm(VM_A0)
    response = post_raw(relay, f"{vm.identity.hybrid_connection_name}/approve", b"x" * 100_000)
    assert response.status_code == 413
    assert vm.listener.stats.rendezvous == 1
    assert imds.approvals() == []


def test_entra_sender_token_is_accepted(imds: ImdsEmulator, start_vm: Callable[..., Vm], relay: RelayEmulator) -> None:
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    with RelayApprovalSender(endpoint=relay.base_url, credential=MintedCredential("https://relay.azure.net")) as entra:
        assert entra.send(approval(event_id), vm=vm.identity).outcome == "approved"


@pytest.mark.parametrize(
    ("credential", "message"),
    [
        (AzureNamedKeyCredential("send", "d3Jvbmcta2V5"), "HTTP 401"),
        (AzureNamedKeyCredential("nobody", SEND_KEY), "HTTP 401"),
        (MintedCredential("https://eventhubs.azure.net"), "HTTP 401"),
    ],
    ids=["bad-sas-signature", "unknown-sas-rule", "wrong-audience-jwt"],
)
def test_forged_senders_are_refused_by_the_relay(
    imds: ImdsEmulator,
    start_vm: Callable[..., Vm],
    relay: RelayEmulator,
    credential: AzureNamedKeyCredential | MintedCredential,
    message: str,
) -> None:
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    with (
        RelayApprovalSender(endpoint=relay.base_url, credential=credential) as forged,
        pytest.raises(ApprovalDeliveryError, match=message),
    ):
        forged.send(approval(event_id), vm=vm.identity)
    assert vm.listener.stats.requests == 0
    assert imds.approvals() == []


def test_sender_retries_until_a_listener_is_there(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], sender: RelayApprovalSender, relay: RelayEmulator
) -> None:
    identity = imds_identity(imds, VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    late = threading.Timer(0.5, start_vm, args=(VM_A0,))
    late.start()
    started = time.monotonic()
    result = sender.send(approval(event_id), vm=identity)
    late.join()
    assert result.outcome == "approved"
    assert time.monotonic() - started >= 0.4
    refused = sum(count for kind, count in relay.counters().items() if "http_request" in kind)
    assert refused >= 1  # answered 503 while nobody listened
    assert approved_ids(imds) == [event_id]


def _impatient(endpoint: str) -> RelayApprovalSender:
    """A sender that gives up on "no listener" after half a second."""
    return RelayApprovalSender(
        endpoint=endpoint,
        credential=AzureNamedKeyCredential("send", SEND_KEY),
        backoff_initial=0.05,
        backoff_maximum=0.1,
        max_retry_seconds=0.5,
    )


def test_sender_gives_up_with_a_delivery_error(imds: ImdsEmulator, relay: RelayEmulator) -> None:
    identity = imds_identity(imds, VM_A0)
    with (
        _impatient(relay.base_url) as impatient,
        pytest.raises(ApprovalDeliveryError, match="HTTP 503") as failed,
    ):
        impatient.send(approval(scheduled_event(imds, VM_A0)), vm=identity)
    # The relay said no listener was connected, every time: nobody can be executing it.
    assert failed.value.unreached


def test_a_send_whose_connections_are_refused_reached_no_one(imds: ImdsEmulator) -> None:
    """The Relay down (connections refused): the failure says no listener can have the request, so another VM may
    be sent the event at once rather than after this request lapses (coordinator/pipeline/attempt.py open_after)."""
    identity = imds_identity(imds, VM_A0)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with (
        _impatient(f"http://127.0.0.1:{port}") as sender,
        pytest.raises(ApprovalDeliveryError, match="ConnectionError") as failed,
    ):
        sender.send(approval(scheduled_event(imds, VM_A0)), vm=identity)
    assert failed.value.unreached


def test_sender_finds_a_late_listener_within_its_short_no_listener_cap(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], relay: RelayEmulator
) -> None:
    """An on-demand listener connects as the coordinator sends: with the production defaults (other failures back
    off up to 10 s) the "no listener" retries are capped at 1 s, so the listener is found about a second after it
    connects, however long the sender has been waiting."""
    identity = imds_identity(imds, VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    connected_at: list[float] = []

    def connect_late() -> None:
        start_vm(VM_A0)
        connected_at.append(time.monotonic())

    late = threading.Timer(4.0, connect_late)
    late.start()
    with RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY)) as sender:
        result = sender.send(approval(event_id), vm=identity)
    answered_at = time.monotonic()
    late.join()
    assert result.outcome == "approved"
    assert answered_at - connected_at[0] <= 1.5


def test_sender_gives_up_at_the_requests_deadline_saying_no_listener_connected(
    imds: ImdsEmulator, relay: RelayEmulator
) -> None:
    identity = imds_identity(imds, VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    started = time.monotonic()
    with (
        RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY)) as sender,
        pytest.raises(ApprovalDeliveryError, match=r"no listener connected within 2\.0 s"),
    ):
        # notAfter 4 s away: the sender waits until the listener would refuse it (2 s before), no more.
        sender.send(approval(event_id, valid_for=timedelta(seconds=4)), vm=identity)
    assert 1.0 <= time.monotonic() - started <= 2.5
    assert approved_ids(imds) == []


def test_a_send_given_seconds_ends_within_them_however_the_listener_hangs(
    imds: ImdsEmulator, start_vm: Callable[..., Vm], relay: RelayEmulator
) -> None:
    """A run gives each approval a few seconds, then hands it to the delivery queue (coordinator/pipeline/act.py):
    the send must be over by then, even while a connected listener never answers (the attempt's own timeout would
    be 70 s), so that the queue's attempt never meets the run's."""
    vm = start_vm(VM_A0)
    relay.set_listener_fault(vm.identity.hybrid_connection_name, dead=True)
    event_id = scheduled_event(imds, VM_A0)
    started = time.monotonic()
    with (
        RelayApprovalSender(endpoint=relay.base_url, credential=AzureNamedKeyCredential("send", SEND_KEY)) as sender,
        pytest.raises(ApprovalDeliveryError, match=r"could not reach web_0 .* after 1 attempts") as failed,
    ):
        sender.send_within(approval(event_id), vm=vm.identity, seconds=1.0)
    assert not failed.value.unreached  # the listener got it and did not answer: it may still execute it
    assert time.monotonic() - started <= 1.6
    relay.set_listener_fault(vm.identity.hybrid_connection_name)
    assert approved_ids(imds) == []


def imds_identity(imds: ImdsEmulator, vm_name: str) -> VmIdentity:
    return VmIdentity.of(imds_client(imds, vm_name).get_identity())


def test_every_request_is_logged_once_with_its_outcome(
    imds: ImdsEmulator,
    start_vm: Callable[..., Vm],
    sender: RelayApprovalSender,
    relay: RelayEmulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    vm = start_vm(VM_A0)
    event_id = scheduled_event(imds, VM_A0)
    with caplog.at_level(logging.INFO, logger="forwarder.approver"):
        sender.send(approval(event_id, decision="logged"), vm=vm.identity)
        sender.send(approval(event_id, decision="logged"), vm=vm.identity)
        post_raw(relay, f"{vm.identity.hybrid_connection_name}/approve", b"[]")
    lines = [record.fields for record in caplog.records if record.name == "forwarder.approver"]  # type: ignore[attr-defined]
    assert [(line.get("outcome"), line.get("idempotent"), line["status"]) for line in lines] == [
        ("approved", False, 200),
        ("approved", True, 200),
        (None, None, 400),
    ]
    assert all(line["eventId"] == event_id for line in lines[:2])
    assert "approval request is invalid" in lines[2]["reason"]
