"""Remote acknowledge (preview) end to end over the IMDS emulator's ARM face: the real sender with a real
azure-identity managed-identity credential (tokens from the emulator), the real coordinator, the emulator's state.

The ARM face refuses a request without a token (401) or with a token of another audience (403); an acknowledge
approves the event as its VM's StartRequests would, so the event proceeds; 429 and 5xx are retried (Retry-After
honoured), 404 and 403 are reported with ARM's reason in the history and, after three attempts, the
approval-failed card."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from azure.identity import ManagedIdentityCredential

from contracts.approval import ApprovalFacts, ApprovalRequest
from contracts.envelope import VmIdentity
from coordinator.adapters.arm import ArmOptions
from coordinator.adapters.callback import ApprovalDeliveryError
from coordinator.adapters.census import ArmCensusReader, Census
from coordinator.adapters.remote_acknowledge import API_VERSION, RemoteAcknowledgeSender, acknowledge_target
from coordinator.domain.policy_file import PolicyError, parse_policy
from coordinator.pipeline.ingest import RawMessage
from coordinator.service import Coordinator
from emulators.azurite import AzuriteEndpoints
from emulators.imds import ImdsEmulator
from emulators.tokens import mint_token
from tests.coordinator import runs
from tests.coordinator.conftest import Clock
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, web_vms

REMOTE_POLICY = """
version: 1
rules:
  - name: freeze-remote
    match: {eventType: [Freeze]}
    action: approve-now
    callback: remote-acknowledge
  - name: rest-wait
    action: wait-for-person
"""


@pytest.fixture
def arm() -> Iterator[ImdsEmulator]:
    vms = [*web_vms("web_0", "web_1"), {"name": "solo", "placementGroupId": "pg-solo"}]
    with runs.imds_serving("remote-acknowledge", vms) as emulator:
        yield emulator


@pytest.fixture
def credential(arm: ImdsEmulator, monkeypatch: pytest.MonkeyPatch) -> ManagedIdentityCredential:
    """azure-identity's own managed-identity client, pointed at the emulator's token endpoint."""
    for name, value in arm.identity_environment("solo").items():
        monkeypatch.setenv(name, value)
    return ManagedIdentityCredential()


def identity(arm: ImdsEmulator, name: str) -> VmIdentity:
    spec = next(v for v in arm.vms() if v.name == name)
    return VmIdentity.model_validate(spec.model_dump(include=set(VmIdentity.model_fields)))


def request_for(event_id: str) -> ApprovalRequest:
    return ApprovalRequest(
        eventId=event_id,
        decisionId=str(uuid.uuid4()),
        rule="test",
        issuedAt=DOC_NOW,
        expiresAt=DOC_NOW + timedelta(seconds=30),
        notAfter=DOC_NOW + timedelta(seconds=30),
        facts=ApprovalFacts(
            eventType="Freeze", eventSource="Platform", durationInSeconds=5, notBefore=None, resources=["web_0"]
        ),
    )


def status_of(arm: ImdsEmulator, event_id: str) -> str:
    return str(next(e for e in arm.events() if e["EventId"] == event_id)["state"])


def test_the_arm_face_refuses_a_request_without_a_token_or_for_another_audience(arm: ImdsEmulator) -> None:
    event_id = arm.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    vm = identity(arm, "web_0")
    url = (
        f"{arm.arm_url}{acknowledge_target(vm)}/providers/Microsoft.Maintenance/scheduledevents/{event_id}"
        f"/acknowledge?api-version={API_VERSION}"
    )
    bare = requests.post(url, json={}, timeout=5)
    assert bare.status_code == 401
    assert bare.json()["error"]["code"] == "AuthenticationFailed"
    relay_token, _ = mint_token(audience="https://relay.azure.net", identity_resource_id=vm.resourceId)
    wrong = requests.post(url, json={}, headers={"Authorization": f"Bearer {relay_token}"}, timeout=5)
    assert wrong.status_code == 403
    assert wrong.json()["error"]["code"] == "InvalidAuthenticationTokenAudience"
    forged = requests.post(url, json={}, headers={"Authorization": "Bearer not-a-token"}, timeout=5)
    assert forged.status_code == 401
    assert status_of(arm, event_id) == "Scheduled"
    assert arm.approvals() == []


def test_an_acknowledge_on_the_scale_set_approves_the_event_as_its_vm_would(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    event_id = arm.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)["EventId"]
    sender = RemoteAcknowledgeSender(credential=credential, endpoint=arm.arm_url, clock=lambda: DOC_NOW)
    result = sender.send(request_for(event_id), vm=identity(arm, "web_1"))
    assert result.outcome == "approved"
    assert "Maintenance RP" in result.reason
    assert "virtualMachineScaleSets/web" in result.reason
    assert [(a["EventId"], a["vm"]) for a in arm.approvals()] == [(event_id, "web_1")]
    arm.clock.advance(1)  # type: ignore[attr-defined]
    assert status_of(arm, event_id) == "Started"


def test_throttling_and_server_errors_are_retried_honouring_retry_after(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    event_id = arm.create_event(EventType="Freeze", Resources=["solo"], NoticeSeconds=900)["EventId"]
    arm.inject_arm_fault(status=429, count=1, retryAfterSeconds=1)
    arm.inject_arm_fault(status=503, count=1)
    sender = RemoteAcknowledgeSender(
        credential=credential, endpoint=arm.arm_url, deadline_seconds=10, backoff=(0.05, 0.1), clock=lambda: DOC_NOW
    )
    result = sender.send(request_for(event_id), vm=identity(arm, "solo"))
    assert result.outcome == "approved"
    status = arm.arm_status()
    assert status["faultsAnswered"] == 2
    assert status["requests"] == 3
    assert [a["EventId"] for a in status["acknowledged"]] == [event_id]


def test_errors_that_outlast_the_deadline_are_reported_for_a_later_retry(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    event_id = arm.create_event(EventType="Freeze", Resources=["solo"], NoticeSeconds=900)["EventId"]
    arm.inject_arm_fault(status=500, count=50)
    sender = RemoteAcknowledgeSender(
        credential=credential, endpoint=arm.arm_url, deadline_seconds=0.5, backoff=(0.1, 0.2), clock=lambda: DOC_NOW
    )
    with pytest.raises(ApprovalDeliveryError, match=r"ARM 500.*retried later"):
        sender.send(request_for(event_id), vm=identity(arm, "solo"))
    assert arm.approvals() == []


def test_nothing_is_acknowledged_past_the_requests_not_after(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    """No VM checks an acknowledge's dates, so the sender does: not within the listener's 2 s tolerance of notAfter,
    and ARM's 429s are not retried past it either."""
    event_id = arm.create_event(EventType="Freeze", Resources=["solo"], NoticeSeconds=900)["EventId"]
    sender = RemoteAcknowledgeSender(
        credential=credential, endpoint=arm.arm_url, clock=lambda: DOC_NOW + timedelta(seconds=29)
    )
    with pytest.raises(ApprovalDeliveryError, match="not sent: it expired at"):
        sender.send(request_for(event_id), vm=identity(arm, "solo"))  # notAfter DOC_NOW + 30 s
    assert arm.arm_status()["requests"] == 0
    arm.inject_arm_fault(status=429, count=50)
    started = time.monotonic()
    late = RemoteAcknowledgeSender(
        credential=credential,
        endpoint=arm.arm_url,
        deadline_seconds=10,
        backoff=(0.05, 0.1),
        clock=lambda: DOC_NOW + timedelta(seconds=27),
    )
    with pytest.raises(ApprovalDeliveryError, match="ARM 429"):
        late.send(request_for(event_id), vm=identity(arm, "solo"))
    assert time.monotonic() - started < 2  # 1 s left before the tolerance, not the 10 s deadline
    assert arm.approvals() == []


@pytest.mark.parametrize(
    ("fault", "expected"),
    [(None, r"ARM 404 \(no such scheduled event"), (403, r"ARM 403 \(the coordinator's identity lacks")],
)
def test_refusals_are_reported_at_once_with_arm_reason(
    arm: ImdsEmulator, credential: ManagedIdentityCredential, fault: int | None, expected: str
) -> None:
    if fault is not None:
        event_id = arm.create_event(EventType="Freeze", Resources=["solo"], NoticeSeconds=900)["EventId"]
        arm.inject_arm_fault(status=fault, count=1)
    else:
        event_id = str(uuid.uuid4()).upper()
    sender = RemoteAcknowledgeSender(
        credential=credential, endpoint=arm.arm_url, deadline_seconds=10, clock=lambda: DOC_NOW
    )
    with pytest.raises(ApprovalDeliveryError, match=expected):
        sender.send(request_for(event_id), vm=identity(arm, "solo"))
    assert arm.arm_status()["requests"] == 1  # not retried
    assert arm.approvals() == []


def test_a_rule_option_is_validated() -> None:
    with pytest.raises(PolicyError, match="callback"):
        parse_policy(
            "version: 1\nrules:\n  - name: never\n    action: never-approve\n    callback: remote-acknowledge\n"
        )
    with pytest.raises(PolicyError, match=r"rules\.0\.callback: Input should be 'relay' or 'remote-acknowledge'"):
        parse_policy("version: 1\nrules:\n  - name: x\n    action: approve-now\n    callback: carrier-pigeon\n")


def make_coordinator(
    azurite: AzuriteEndpoints, arm: ImdsEmulator, credential: ManagedIdentityCredential, tmp_path: Path, **options: Any
) -> tuple[Coordinator, MemoryHistory]:
    clock = Clock(DOC_NOW)
    return runs.table_coordinator(
        azurite,
        arm,
        "t" + uuid.uuid4().hex[:16],
        tmp_path / "cards",
        clock,
        policy=parse_policy(options.pop("policy", REMOTE_POLICY)),
        # The same clock as the coordinator's: it checks the requests' notAfter.
        remote_acknowledge=RemoteAcknowledgeSender(
            credential=credential, endpoint=arm.arm_url, deadline_seconds=3, backoff=(0.05, 0.1), clock=clock
        ),
        **options,
    )


def report(arm: ImdsEmulator, name: str, sequence: int) -> RawMessage:
    vm = identity(arm, name)
    document = arm.document(name)
    data = envelope(
        vm.model_dump(), sequence=sequence, incarnation=document["DocumentIncarnation"], events=document["Events"]
    )
    return RawMessage(body=json.dumps(data).encode(), partition_key=vm.resourceId.lower())


def test_a_rule_with_remote_acknowledge_approves_through_arm_and_the_event_proceeds(
    azurite: AzuriteEndpoints, arm: ImdsEmulator, credential: ManagedIdentityCredential, tmp_path: Path
) -> None:
    coordinator, history = make_coordinator(azurite, arm, credential, tmp_path)
    event_id = arm.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    coordinator.process_batch([report(arm, "web_0", 1)])
    assert [a["EventId"] for a in arm.arm_status()["acknowledged"]] == [event_id]
    approvals = [r for r in history.rows if r.RecordType == "Approval" and r.EventId == event_id]
    assert approvals[-1].Outcome == "approved"
    assert "no VM checked the facts" in (approvals[-1].Reason or "")
    assert any(r.RecordType == "Transition" and r.State == "Approved" for r in history.rows)
    arm.clock.advance(1)  # type: ignore[attr-defined]
    coordinator.process_batch([report(arm, "web_0", 2)])
    assert status_of(arm, event_id) == "Started"
    assert any(r.RecordType == "Transition" and r.State == "Started" for r in history.rows if r.EventId == event_id)


def test_a_refused_acknowledge_is_in_the_history_and_after_three_attempts_on_the_approval_failed_card(
    azurite: AzuriteEndpoints, arm: ImdsEmulator, credential: ManagedIdentityCredential, tmp_path: Path
) -> None:
    coordinator, history = make_coordinator(azurite, arm, credential, tmp_path)
    clock = coordinator.parts.clock
    assert isinstance(clock, Clock)
    event_id = arm.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)["EventId"]
    arm.inject_arm_fault(status=403, count=3)
    coordinator.process_batch([report(arm, "web_1", 1)])
    failed = [r for r in history.rows if r.RecordType == "Approval" and r.Outcome == "failed"]
    assert failed
    assert "ARM 403" in (failed[-1].Reason or "")
    for _ in range(2):
        clock.now += timedelta(seconds=coordinator.options.approval_backoff[1] + 1)
        coordinator.tick()
    failed_cards = [p.read_text() for p in (tmp_path / "cards").glob(f"{event_id}-approval-failed.json")]
    assert len(failed_cards) == 1
    assert "ARM 403" in failed_cards[0]
    assert "lacks the scheduled-event acknowledge role" in failed_cards[0]
    assert status_of(arm, event_id) == "Scheduled"
    assert arm.approvals() == []


def test_without_remote_acknowledge_the_rule_sends_nothing(
    azurite: AzuriteEndpoints, arm: ImdsEmulator, credential: ManagedIdentityCredential, tmp_path: Path
) -> None:
    coordinator, history = make_coordinator(azurite, arm, credential, tmp_path)
    coordinator.parts = replace(coordinator.parts, remote_acknowledge=None)
    arm.create_event(EventType="Freeze", Resources=["solo"], NoticeSeconds=900)
    coordinator.process_batch([report(arm, "solo", 1)])
    failed = [r for r in history.rows if r.RecordType == "Approval" and r.Outcome == "failed"]
    assert failed
    assert "remote acknowledge, which is off" in (failed[-1].Reason or "")
    assert arm.arm_status()["requests"] == 0
    assert arm.approvals() == []


def test_the_stable_api_version_is_used_and_the_list_form_takes_only_it(arm: ImdsEmulator) -> None:
    assert API_VERSION == "2025-11-01"
    token, _ = mint_token(audience="https://management.azure.com", identity_resource_id="/arm-test")
    target = acknowledge_target(identity(arm, "web_0"))
    url = f"{arm.arm_url}{target}/providers/Microsoft.Maintenance/scheduledevents?api-version=2023-10-01-preview"
    answer = requests.post(url, json={"value": ["X"]}, headers={"Authorization": f"Bearer {token}"}, timeout=5)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "InvalidApiVersionParameter"


def test_the_list_form_acknowledges_several_events_of_a_resource_in_one_request(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    first = arm.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    second = arm.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)["EventId"]
    sender = RemoteAcknowledgeSender(credential=credential, endpoint=arm.arm_url, clock=lambda: DOC_NOW)
    assert sender.batch_key(identity(arm, "web_0")) == sender.batch_key(identity(arm, "web_1"))
    outcomes = sender.send_many(
        [(request_for(first), identity(arm, "web_0")), (request_for(second), identity(arm, "web_1"))], seconds=5
    )
    assert [getattr(outcome, "outcome", None) for outcome in outcomes] == ["approved", "approved"]
    assert all("a list of 2 events" in getattr(outcome, "reason", "") for outcome in outcomes)
    assert arm.arm_status()["requests"] == 1
    assert sorted(a["EventId"] for a in arm.approvals()) == sorted([first, second])
    with pytest.raises(ValueError, match="one resource"):
        sender.send_many(
            [(request_for(first), identity(arm, "web_0")), (request_for(second), identity(arm, "solo"))], seconds=5
        )


def test_a_lists_per_event_errors_fail_those_events_alone(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    """The list names the event it could not acknowledge (its code and message); the event it does not name is
    acknowledged again alone (the spec does not say whether an error answer approved it), so it ends approved."""
    real = arm.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    unknown = str(uuid.uuid4()).upper()
    expired = request_for(str(uuid.uuid4()).upper()).model_copy(update={"notAfter": DOC_NOW, "expiresAt": DOC_NOW})
    sender = RemoteAcknowledgeSender(credential=credential, endpoint=arm.arm_url, clock=lambda: DOC_NOW)
    vm = identity(arm, "web_0")
    outcomes = sender.send_many(
        [(request_for(real), vm), (request_for(unknown), vm), (expired, vm), (request_for(unknown.lower()), vm)],
        seconds=5,
    )
    approved, refused, not_sent, refused_too = outcomes
    assert getattr(approved, "outcome", None) == "approved"
    assert isinstance(refused, ApprovalDeliveryError)
    assert f"remote acknowledge of {unknown} refused in a list of 3 (ARM 400): NotFound" in str(refused)
    assert isinstance(not_sent, ApprovalDeliveryError)
    assert "not sent: it expired" in str(not_sent)
    assert isinstance(refused_too, ApprovalDeliveryError)
    assert arm.arm_status()["requests"] == 2  # the list, then the real event alone
    assert [a["EventId"] for a in arm.approvals()] == [real, real]


def test_a_waves_acknowledges_go_in_one_list_per_resource_each_outcome_committed(
    azurite: AzuriteEndpoints, arm: ImdsEmulator, credential: ManagedIdentityCredential, tmp_path: Path
) -> None:
    """Three Freezes decided in one batch: the two of scale set web in one list acknowledge (one of them canceled
    meanwhile, which the list names), the standalone VM's alone; each event's outcome is its own."""
    coordinator, history = make_coordinator(azurite, arm, credential, tmp_path)
    on_web_0 = arm.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)["EventId"]
    on_web_1 = arm.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)["EventId"]
    on_solo = arm.create_event(EventType="Freeze", Resources=["solo"], NoticeSeconds=900)["EventId"]
    batch = [report(arm, "web_0", 1), report(arm, "web_1", 1), report(arm, "solo", 1)]
    arm.cancel_event(on_web_1)
    coordinator.process_batch(batch)
    status = arm.arm_status()
    assert status["requests"] == 3  # web's list, web_0's event again alone (not named among the errors), solo's
    assert sorted({a["EventId"] for a in status["acknowledged"]}) == sorted([on_web_0, on_solo])
    outcomes = {
        r.EventId: r for r in history.rows if r.RecordType == "Approval" and r.Outcome in ("approved", "failed")
    }
    assert outcomes[on_web_0].Outcome == "approved"
    assert outcomes[on_solo].Outcome == "approved"
    assert outcomes[on_web_1].Outcome == "failed"
    assert "refused in a list of 2 (ARM 400): NotFound" in (outcomes[on_web_1].Reason or "")


def test_a_wave_acknowledged_in_one_list_when_every_event_is_acknowledgeable(
    azurite: AzuriteEndpoints, arm: ImdsEmulator, credential: ManagedIdentityCredential, tmp_path: Path
) -> None:
    coordinator, history = make_coordinator(azurite, arm, credential, tmp_path)
    ids = [
        arm.create_event(EventType="Freeze", Resources=[vm], NoticeSeconds=900)["EventId"] for vm in ("web_0", "web_1")
    ]
    coordinator.process_batch([report(arm, "web_0", 1), report(arm, "web_1", 1)])
    assert arm.arm_status()["requests"] == 1
    approved = [r for r in history.rows if r.RecordType == "Approval" and r.Outcome == "approved"]
    assert sorted(r.EventId for r in approved) == sorted(ids)
    assert all("a list of 2 events" in (r.Reason or "") for r in approved)


def test_a_list_refused_as_a_whole_falls_back_to_single_acknowledges(
    arm: ImdsEmulator, credential: ManagedIdentityCredential
) -> None:
    """A refusal that names no event (here a 403: a role allowing only the single form) sends each event alone."""
    ids = [
        arm.create_event(EventType="Freeze", Resources=[vm], NoticeSeconds=900)["EventId"] for vm in ("web_0", "web_1")
    ]
    arm.inject_arm_fault(status=403, count=1)
    sender = RemoteAcknowledgeSender(credential=credential, endpoint=arm.arm_url, clock=lambda: DOC_NOW)
    outcomes = sender.send_many(
        [(request_for(i), identity(arm, vm)) for i, vm in zip(ids, ("web_0", "web_1"), strict=True)], seconds=5
    )
    assert [getattr(outcome, "outcome", None) for outcome in outcomes] == ["approved", "approved"]
    assert arm.arm_status()["requests"] == 3
    assert sorted(a["EventId"] for a in arm.approvals()) == sorted(ids)


@pytest.mark.parametrize("census", [True, False])
def test_a_flexible_members_event_is_acknowledged_on_the_scale_set_arm_lists_it_in(
    azurite: AzuriteEndpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, census: bool
) -> None:
    """A Flexible member's scale set is named only by its ``vmScaleSetName``; one that writes another set's name
    there would have ARM acknowledge on that set. With ARM's census the target is the set ARM lists it in (the
    event approved); the control, without a census, acknowledges where the VM says, and ARM finds no such event."""
    with runs.imds_serving("flexible-acknowledge", [{"name": "flex-a", "vmScaleSetName": "flex"}]) as flexible:
        for name, value in flexible.identity_environment("flex-a").items():
            monkeypatch.setenv(name, value)
        credential = ManagedIdentityCredential()
        vm = identity(flexible, "flex-a")
        assert "/virtualMachineScaleSets/" not in vm.resourceId  # a VM resource of its own: Flexible
        group = f"/subscriptions/{vm.subscriptionId}/resourceGroups/{vm.resourceGroupName}"
        reader = ArmCensusReader(
            credential=credential, resource_groups=[group], arm=ArmOptions(endpoint=flexible.arm_url)
        )
        coordinator, history = make_coordinator(
            azurite, flexible, credential, tmp_path, census=Census(reader) if census else None
        )
        event_id = flexible.create_event(EventType="Freeze", Resources=["flex-a"], NoticeSeconds=900)["EventId"]
        message = report(flexible, "flex-a", 1)
        lied = json.loads(message.body)
        lied["vm"]["vmScaleSetName"] = "other"
        coordinator.process_batch([replace(message, body=json.dumps(lied).encode())])
        acknowledged = [(a["EventId"], a["resource"]) for a in flexible.arm_status()["acknowledged"]]
        approvals = [r for r in history.rows if r.RecordType == "Approval" and r.EventId == event_id]
        if census:
            assert acknowledged == [(event_id, f"{group}/providers/Microsoft.Compute/virtualMachineScaleSets/flex")]
            assert approvals[-1].Outcome == "approved"
        else:
            assert acknowledged == []
            assert "virtualMachineScaleSets/other" in (approvals[-1].Reason or ""), approvals[-1].Reason
