"""The IMDS client over real HTTP against the IMDS emulator."""

from __future__ import annotations

import json
import time

import pytest

from contracts.envelope import MAX_TAG_VALUE, MAX_TAGS
from emulators.imds import ImdsEmulator, Scenario
from forwarder.imds import (
    IDLE_DISABLE_SECONDS,
    MAX_BODY,
    ImdsClient,
    ImdsDeadlinePassed,
    ImdsInvalidResponse,
    ImdsUnavailable,
    read_document,
    tags_of,
)
from forwarder.retry import IMDS_LIMITER, Backoff, RateLimiter
from tests.forwarder.conftest import ScriptedImds


def client(imds: ImdsEmulator, vm: str = "web_0", **options: object) -> ImdsClient:
    return ImdsClient(base_url=imds.url_for(vm), limiter=RateLimiter(requests=500), **options)  # type: ignore[arg-type]


def test_document_identity_and_approval(imds: ImdsEmulator) -> None:
    created = imds.create_event(EventType="Reboot", Resources=["web_1"], NoticeSeconds=900)
    imds_client = client(imds, "web_1")
    identity = imds_client.get_identity()
    assert identity.name == "web_1"
    assert identity.vmScaleSetName == "web"
    assert identity.resourceId.endswith("/virtualMachineScaleSets/web/virtualMachines/1")
    assert identity.extras == {}  # osProfile, tags etc. stay out of envelopes
    document = imds_client.get_document()
    assert [e.EventId for e in document.Events] == [created["EventId"]]
    imds_client.approve([created["EventId"]])
    assert [a["EventId"] for a in imds.approvals()] == [created["EventId"]]
    assert imds_client.get_document().Events[0].EventStatus == "Started"


def test_one_connection_is_reused(imds: ImdsEmulator) -> None:
    imds_client = client(imds)
    imds_client.get_document_bytes()
    first = imds_client._conn._sock
    assert first is not None
    for _ in range(5):
        imds_client.get_document_bytes()
    assert imds_client._conn._sock is first


def test_proxy_settings_are_ignored(imds: ImdsEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert client(imds).get_document().DocumentIncarnation >= 1


def test_5xx_and_429_are_transient_with_status(imds: ImdsEmulator) -> None:
    imds.inject_fault(kind="error-burst", vm="web_0", status=503, count=1)
    imds_client = client(imds)
    with pytest.raises(ImdsUnavailable) as caught:
        imds_client.get_document_bytes()
    assert caught.value.status == 503
    assert imds_client.get_document().DocumentIncarnation >= 1  # the next call works


def test_hang_times_out_and_the_connection_recovers(imds: ImdsEmulator) -> None:
    imds_client = client(imds, timeout=0.3, first_call_timeout=0.3)
    imds.inject_fault(kind="hang", vm="web_0", seconds=2, count=1)
    started = time.monotonic()
    with pytest.raises(ImdsUnavailable, match="timed out"):
        imds_client.get_document_bytes()
    assert time.monotonic() - started < 1.5
    assert imds_client.get_document().DocumentIncarnation >= 1


def test_malformed_document_is_invalid_not_transient(imds: ImdsEmulator) -> None:
    imds.inject_fault(kind="malformed-json", vm="web_0", count=1)
    with pytest.raises(ImdsInvalidResponse, match="scheduled-events document is invalid"):
        client(imds).get_document()


def test_approve_retries_transient_errors(imds: ImdsEmulator) -> None:
    created = imds.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)
    imds.inject_fault(kind="error-burst", vm="web_0", status=500, count=2)
    client(imds).approve([created["EventId"]], backoff=Backoff(initial=0.01, maximum=0.02))
    assert len(imds.approvals()) == 1


def test_approve_sends_no_attempt_past_its_deadline(imds: ImdsEmulator) -> None:
    """An approval's validity ends at ``before``: a POST that would start later (its retry's backoff reaching past
    it, or its turn at the rate limiter) is not sent, since the coordinator may by then have sent the event to a
    peer (forwarder/approver.py)."""
    created = imds.create_event(EventType="Freeze", Resources=["web_0"], NoticeSeconds=900)
    with pytest.raises(ImdsDeadlinePassed, match="deadline passed"):
        client(imds).approve([created["EventId"]], before=time.monotonic() - 0.001)
    imds.inject_fault(kind="error-burst", vm="web_0", status=500, count=1)
    with pytest.raises(ImdsDeadlinePassed, match="not retried"):
        client(imds).approve(
            [created["EventId"]], backoff=Backoff(initial=1.0, maximum=1.0), before=time.monotonic() + 0.5
        )
    assert imds.approvals() == []
    client(imds).approve([created["EventId"]], before=time.monotonic() + 5)
    assert len(imds.approvals()) == 1


def test_approve_unknown_event_is_a_clear_error(imds: ImdsEmulator) -> None:
    with pytest.raises(ImdsInvalidResponse, match="400"):
        client(imds).approve(["not-an-event"])


def test_non_http_base_url_is_refused() -> None:
    with pytest.raises(ValueError, match="http://"):
        ImdsClient(base_url="https://169.254.169.254")


def test_rate_limiter_keeps_any_window_within_its_requests() -> None:
    limiter = RateLimiter(requests=2, per_seconds=0.1)
    sent = []
    for _ in range(6):
        limiter.acquire()
        sent.append(time.monotonic())
    assert sent[1] - sent[0] < 0.05  # two at once
    for index in range(2, 6):  # each later one a full window after the one two before it
        assert sent[index] - sent[index - 2] >= 0.1 - 1e-3


def test_default_rate_stays_under_the_imds_throttle(imds: ImdsEmulator) -> None:
    imds.inject_fault(kind="throttle", requestsPerSecond=5)
    imds_client = ImdsClient(base_url=imds.url_for("web_0"))  # the process-wide limiter
    for _ in range(10):  # as fast as the limiter lets it: 4 in any second (about 2 s)
        imds_client.get_document_bytes()


def test_an_approval_just_after_a_poll_is_not_held_back() -> None:
    """The approver's attested document (the answer's proof), its fresh GET and its StartRequests POST follow the poll
    by a few hundred ms at most: all three must go out at once, or every approval waits for the limiter (and the
    coordinator's batch holds its partition meanwhile)."""
    limiter = RateLimiter(requests=IMDS_LIMITER.requests, per_seconds=IMDS_LIMITER.per_seconds)  # its shape, own window
    limiter.acquire()  # the poll that saw the event
    time.sleep(0.1)  # envelope -> Event Hubs -> coordinator -> Relay
    started = time.monotonic()
    limiter.acquire()  # approver: the attested document for the proof
    limiter.acquire()  # approver: GET the current document
    limiter.acquire()  # approver: POST StartRequests
    assert time.monotonic() - started < 0.05
    assert IMDS_LIMITER.requests / IMDS_LIMITER.per_seconds < 5  # under IMDS's ~5 in any one-second window


def test_backoff_grows_with_jitter_and_honours_retry_after() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0)
    delays = [backoff.next_delay() for _ in range(6)]
    for delay, ceiling in zip(delays, [1, 2, 4, 8, 8, 8], strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert Backoff(initial=1.0, maximum=60.0).next_delay(retry_after=30) == 30
    backoff.reset()
    assert backoff.next_delay() <= 1.0


def test_the_slow_first_call_gets_the_long_timeout(imds: ImdsEmulator) -> None:
    """IMDS may take up to two minutes to answer the very first request; later ones get the short timeout."""
    imds.inject_fault(kind="first-call-delay", vm="web_0", seconds=1.0)
    imds_client = client(imds, timeout=0.3, first_call_timeout=5.0)
    started = time.monotonic()
    assert imds_client.get_document().DocumentIncarnation >= 1
    assert time.monotonic() - started >= 0.9
    imds.inject_fault(kind="hang", vm="web_0", seconds=2, count=1)
    with pytest.raises(ImdsUnavailable, match="timed out"):
        imds_client.get_document_bytes()


def test_throttling_is_a_transient_429(imds: ImdsEmulator) -> None:
    imds.inject_fault(kind="throttle", requestsPerSecond=1)
    imds_client = client(imds)
    imds_client.get_document_bytes()
    with pytest.raises(ImdsUnavailable) as caught:
        imds_client.get_document_bytes()
    assert caught.value.status == 429


def test_the_first_scheduled_events_call_gets_the_long_timeout_after_the_identity_call(imds: ImdsEmulator) -> None:
    """The identity call does not wake Scheduled Events up: the first scheduled-events call still may take long."""
    imds.inject_fault(kind="first-call-delay", vm="web_0", endpoint="scheduledevents", seconds=1.0)
    imds_client = client(imds, timeout=0.3, first_call_timeout=5.0)
    assert imds_client.get_identity().name == "web_0"
    started = time.monotonic()
    assert imds_client.get_document().DocumentIncarnation >= 1
    assert time.monotonic() - started >= 0.9


def test_after_24_hours_without_an_answer_the_next_call_is_a_first_call_again(imds: ImdsEmulator) -> None:
    now = [1000.0]
    imds_client = client(imds, timeout=0.3, first_call_timeout=5.0, clock=lambda: now[0])
    imds_client.get_document_bytes()
    now[0] += IDLE_DISABLE_SECONDS - 60  # still awake: the short timeout applies
    imds.inject_fault(kind="hang", vm="web_0", seconds=1.0, count=1)
    with pytest.raises(ImdsUnavailable, match="timed out"):
        imds_client.get_document_bytes()
    imds_client.get_document_bytes()
    now[0] += IDLE_DISABLE_SECONDS  # IMDS has switched the service off meanwhile
    imds.inject_fault(kind="first-call-delay", vm="web_0", endpoint="scheduledevents", seconds=1.0)
    started = time.monotonic()
    imds_client.get_document_bytes()
    assert time.monotonic() - started >= 0.9


def test_one_invalid_event_is_set_aside_and_named() -> None:
    raw = json.dumps(
        {
            "DocumentIncarnation": 5,
            "Events": [
                {"EventId": "ok", "EventType": "Freeze", "Resources": ["web_0"], "EventStatus": "Scheduled"},
                {"EventId": "bad", "EventType": "Freeze", "Resources": "web_0", "EventStatus": "Scheduled"},
                ["not", "an", "event"],
                {"EventId": "x" * 300, "EventType": "Freeze", "EventStatus": "Scheduled"},
            ],
            "Unknown": 1,
        }
    ).encode()
    parsed = read_document(raw)
    assert [e.EventId for e in parsed.document.Events] == ["ok"]
    assert parsed.document.extras == {"Unknown": 1}
    bad, not_an_object, too_long = parsed.invalid
    assert bad.event_id == "bad"
    assert bad.reason.startswith("event 'bad' (Events[1]) is invalid: Resources: Input should be a valid list")
    assert json.loads(bad.body)["Resources"] == "web_0"
    assert not_an_object.event_id is None
    assert not_an_object.reason.startswith("event at Events[2] (no EventId) is invalid")
    assert too_long.event_id == "x" * 128
    assert "EventId: String should have at most 128 characters" in too_long.reason


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "Invalid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"Events": []}', "DocumentIncarnation: Field required"),
        (b'{"DocumentIncarnation": "two", "Events": []}', "DocumentIncarnation: Input should be a valid integer"),
        (b'{"DocumentIncarnation": 2, "Events": {}}', "Events: Input should be a valid list"),
        # Raised RecursionError (no ValueError) out of the poll; now refused like any invalid document.
        (b"[" * 20_000 + b"]" * 20_000, "nested deeper than 64 levels"),
        (b'{"DocumentIncarnation": 2, "Events": [' + b"[" * 900 + b"]" * 900 + b"]}", "nested deeper than 64"),
        (b'{"DocumentIncarnation": 2, "Events": [], "x": ' + b"[" * 64 + b"]" * 64 + b"}", "nested deeper than 64"),
        (b" " * (MAX_BODY + 1), f"more than the {MAX_BODY} allowed"),
    ],
)
def test_a_document_invalid_as_a_whole_is_still_refused(raw: bytes, reason: str) -> None:
    with pytest.raises(ImdsInvalidResponse, match="scheduled-events document is invalid") as caught:
        read_document(raw)
    assert reason in str(caught.value)


def test_get_document_keeps_the_valid_events_for_the_approver(scripted_imds: ScriptedImds) -> None:
    """The approver reads documents the same way: one bad event never blocks the approval of another."""
    good = {"EventId": "ok", "EventType": "Freeze", "Resources": ["web_0"], "EventStatus": "Scheduled"}
    scripted_imds.serve(3, good, {**good, "EventId": "bad", "DurationInSeconds": "long"})
    imds_client = ImdsClient(base_url=scripted_imds.url, limiter=RateLimiter(requests=500))
    document = imds_client.get_document()
    assert (document.DocumentIncarnation, [e.EventId for e in document.Events]) == (3, ["ok"])


def test_the_identity_carries_update_domain_and_tags_from_instance_metadata() -> None:
    scenario = Scenario.model_validate(
        {
            "name": "tagged",
            "vms": [
                {
                    "name": "db_0",
                    "vmScaleSetName": "db",
                    "zone": "2",
                    "platformFaultDomain": "1",
                    "platformUpdateDomain": "4",
                    "tags": {"scheduled-events": "manual", "team": "a;b:c"},
                }
            ],
        }
    )
    with ImdsEmulator(scenario=scenario, throttle_rps=0) as emulator:
        identity = client(emulator, "db_0").get_identity()
    assert (identity.zone, identity.platformFaultDomain, identity.platformUpdateDomain) == ("2", "1", "4")
    # tagsList is exact where the 'name:value;...' string is not (a value holding ';' or ':').
    assert identity.tags == {"scheduled-events": "manual", "team": "a;b:c"}


def test_tags_are_kept_within_azures_limits_and_read_from_the_string_form_when_no_list() -> None:
    many = [{"name": f"t{i:03}", "value": "v" * 300} for i in range(60)]
    bounded = tags_of({"tagsList": many})
    assert len(bounded) == MAX_TAGS
    assert all(len(value) == MAX_TAG_VALUE for value in bounded.values())
    assert tags_of({"tags": "a:1;b:2;broken"}) == {"a": "1", "b": "2"}
    assert tags_of({}) == {}
