"""The tail after the batch (Options.tail_after_batch, with ``Coordinator(..., after_batch=...)``): a batch returns
once its approvals are sent and its positions written, so the partition's next batch waits for no listener; its tail
commits each outcome (the Approval row, the transition, its card) when the answer comes, and writes its history; a tail
that never ran (the process stopped) leaves the approvals to the timer after their in-flight grace, with the same
decisionId. On the in-memory store, with the approval path a stand-in (``RecordingCallback``: the Relay and a VM's
listener cannot be in a fast test)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from contracts.approval import ApprovalRequest, ApprovalResult
from contracts.envelope import VmIdentity
from coordinator.domain.model import EventRecord
from coordinator.domain.policy import Policy
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy, parse_policy
from coordinator.pipeline.decide import IN_FLIGHT_GRACE
from coordinator.pipeline.ingest import RawMessage
from coordinator.pipeline.run import Sending
from coordinator.service import Coordinator
from local.runner import wait_until
from tests.coordinator.helpers import DOC_NOW, MemoryHistory, envelope, scheduled_event, vm
from tests.coordinator.memory_store import MemoryStateStore
from tests.coordinator.runs import RecordingAlerts, RecordingCallback, make_coordinator, message


class HeldFor(RecordingCallback):
    """A listener that does not answer for one VM until ``release`` is set (the others answer at once)."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.release = threading.Event()

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.sent.append((request, vm))
        if vm.name == self.held:
            self.release.wait(timeout=10)
        return ApprovalResult(
            outcome="approved", eventId=request.eventId, decisionId=request.decisionId, documentIncarnation=1
        )


class Clock:
    def __init__(self) -> None:
        self.now = DOC_NOW

    def __call__(self) -> object:
        return self.now


@pytest.fixture
def after_batch() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tail-test")
    yield executor
    executor.shutdown(wait=True, cancel_futures=True)


def coordinator_with(callback: RecordingCallback, after_batch: ThreadPoolExecutor, clock: Clock) -> Coordinator:
    return make_coordinator(
        store=MemoryStateStore(),
        history=MemoryHistory(),
        alerts=RecordingAlerts(),
        callback=callback,
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=clock,
        after_batch=after_batch,
    )


def event(coordinator: Coordinator, event_id: str) -> EventRecord:
    stored = coordinator.event(event_id)
    assert stored is not None, f"no event {event_id}"
    return stored.record


def outcomes(coordinator: Coordinator, event_id: str) -> list[str]:
    history = coordinator.parts.history
    assert isinstance(history, MemoryHistory)
    return [row.Outcome for row in history.rows if row.RecordType == "Approval" and row.EventId == event_id]


def test_a_batch_returns_once_its_approval_is_sent_and_its_tail_commits_the_answer_after_it(
    after_batch: ThreadPoolExecutor,
):
    callback = HeldFor("WestNO_0")
    coordinator = coordinator_with(callback, after_batch, Clock())
    started = time.monotonic()
    run = coordinator.run_batch([message_of("WestNO_0", 1, "EV-A")])
    returned = time.monotonic() - started

    # Returned with the listener still holding the request: not waited for (a batch's own wait was up to 3.5 s).
    assert returned < 1.0
    assert not callback.release.is_set()
    assert run.report.approvals_sent == 0  # its tail waits for the answer
    assert wait_until(lambda: len(callback.sent) == 1, timeout=5.0, interval=0.02)
    record = event(coordinator, "EV-A")
    assert record.state == "Scheduled"
    assert record.approval is not None
    assert not record.approval.delivered
    assert outcomes(coordinator, "EV-A") == []  # the history is the tail's, written once the answer is in

    callback.release.set()
    assert wait_until(lambda: event(coordinator, "EV-A").state == "Approved", timeout=5.0, interval=0.02)
    approval = event(coordinator, "EV-A").approval
    assert approval is not None
    assert (approval.delivered, approval.outcome, approval.attempts) == (True, "approved", 1)
    assert wait_until(lambda: outcomes(coordinator, "EV-A") == ["sending", "approved"], timeout=5.0, interval=0.02)
    assert run.stages[-4:] == ["deliver", "cards", "budgets", "history"]
    assert run.report.approvals_sent == 1
    assert [request.decisionId for request, _ in callback.sent] == [approval.decisionId]


def test_the_next_batch_is_decided_and_answered_while_a_listener_still_holds_the_first(after_batch: ThreadPoolExecutor):
    callback = HeldFor("WestNO_0")
    coordinator = coordinator_with(callback, after_batch, Clock())
    coordinator.run_batch([message_of("WestNO_0", 1, "EV-A")])
    coordinator.run_batch([message_of("WestNO_1", 2, "EV-B")])

    assert wait_until(lambda: event(coordinator, "EV-B").state == "Approved", timeout=5.0, interval=0.02)
    assert event(coordinator, "EV-A").state == "Scheduled"  # its listener has not answered yet
    callback.release.set()
    assert wait_until(lambda: event(coordinator, "EV-A").state == "Approved", timeout=5.0, interval=0.02)
    assert wait_until(
        lambda: outcomes(coordinator, "EV-A") == outcomes(coordinator, "EV-B") == ["sending", "approved"],
        timeout=5.0,
        interval=0.02,
    )


def test_approvals_of_a_tail_that_never_ran_are_sent_again_by_the_timer_after_the_in_flight_grace(
    after_batch: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture
):
    """The process stops before the batch's tail runs (its executor shut down): the approval record the batch
    committed is what the timer sends again, once its in-flight grace has passed, with the same decisionId (the
    listener executes it once and answers from its ledger)."""
    callback, clock = RecordingCallback(), Clock()
    coordinator = coordinator_with(callback, after_batch, clock)
    after_batch.shutdown(wait=True)
    coordinator.run_batch([message_of("WestNO_0", 1, "EV-A")])
    assert "the tail of a batch of 1 messages not run: stopping" in caplog.text
    assert wait_until(lambda: len(callback.sent) == 1, timeout=5.0, interval=0.02)
    first = event(coordinator, "EV-A").approval
    assert first is not None
    assert not first.delivered

    clock.now = DOC_NOW + IN_FLIGHT_GRACE - timedelta(seconds=1)
    coordinator.tick()
    assert len(callback.sent) == 1  # still in flight as far as anyone knows
    clock.now = DOC_NOW + IN_FLIGHT_GRACE + timedelta(seconds=1)
    coordinator.tick()
    assert [request.decisionId for request, _ in callback.sent] == [first.decisionId] * 2
    assert event(coordinator, "EV-A").state == "Approved"


def message_of(name: str, index: int, event_id: str) -> RawMessage:
    """A VM's envelope listing a short Freeze of itself alone (the default policy approves it at once)."""
    event = scheduled_event(event_id, resources=[name])
    return message(envelope(vm(name, index=index), sequence=1, incarnation=1, events=[event]))


def test_close_lets_the_tails_end_first(after_batch: ThreadPoolExecutor):
    callback = HeldFor("WestNO_0")
    coordinator = coordinator_with(callback, after_batch, Clock())
    coordinator.run_batch([message_of("WestNO_0", 1, "EV-A")])
    assert not coordinator.drain(timeout=0.2)  # its tail awaits the held answer
    threading.Timer(0.3, callback.release.set).start()
    coordinator.close(timeout=5)
    assert outcomes(coordinator, "EV-A") == ["sending", "approved"]
    assert event(coordinator, "EV-A").state == "Approved"


DELETES_NOW = parse_policy(
    "rules:\n  - name: deletes-now\n    match: {eventType: [Terminate]}\n    action: approve-now\n"
)


class HeldTails:
    """An ``after_batch`` executor whose tails run only when released: the next batch comes first."""

    def __init__(self) -> None:
        self.tails: list[tuple[Callable[[], None], Future[None]]] = []

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        self.tails.append((fn, future))
        return future

    def release(self) -> None:
        tails, self.tails = self.tails, []
        for fn, future in tails:
            fn()
            future.set_result(None)


def test_a_delete_a_peer_reported_first_is_sent_by_its_own_vms_batch_before_the_peers_tail_ran():
    """A Terminate heard first from a peer is decided at once and finds no VM to go through (only the VM it deletes
    may execute it). Its own VM's batch comes before the peer's tail: the write that decided it says nothing was
    sent, so that batch sends it (before, it read an approval in flight and sent nothing: the tail's "failed" came
    after it, and the VM's later unchanged documents decided nothing, so the delete went unapproved)."""
    callback, tails = RecordingCallback(), HeldTails()
    coordinator = make_coordinator(
        store=MemoryStateStore(),
        history=MemoryHistory(),
        alerts=RecordingAlerts(),
        callback=callback,
        policy=DELETES_NOW,
        clock=Clock(),
        after_batch=tails,  # type: ignore[arg-type]
    )
    terminate = scheduled_event("EV-T", event_type="Terminate", resources=["WestNO_0"], source="User")
    coordinator.run_batch([message(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=1, events=[terminate]))])
    decided = event(coordinator, "EV-T").approval
    assert decided is not None
    assert callback.sent == []  # no VM to send it through yet
    assert "none of ['WestNO_0'] reported" in decided.reason

    coordinator.run_batch([message(envelope(vm("WestNO_0", index=1), sequence=1, incarnation=1, events=[terminate]))])
    assert [(request.decisionId, sent_to.name) for request, sent_to in callback.sent] == [
        (decided.decisionId, "WestNO_0")
    ]
    tails.release()
    assert event(coordinator, "EV-T").state == "Approved"
    # The failed attempt once (written with the decision), then the send through the VM it deletes.
    assert outcomes(coordinator, "EV-T") == ["failed", "sending", "approved"]


class SlowToStart(ThreadPoolExecutor):
    """An approval pool whose threads start each send 5 ms late: a woken thread waiting for the GIL while the batch
    thread runs on (the interpreter's switch interval is 5 ms)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def late() -> Any:
            time.sleep(0.005)
            return fn(*args, **kwargs)

        return super().submit(late)


class NotingOrder(MemoryStateStore):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    def save_vm_groups(self, items: Any, **kw: Any) -> list[str]:
        self.order.append("positions")
        return super().save_vm_groups(items, **kw)


class NotingSend(RecordingCallback):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    def send(self, request: ApprovalRequest, *, vm: VmIdentity) -> ApprovalResult:
        self.order.append("approval")
        return super().send(request, vm=vm)


def test_a_batch_writes_its_vm_positions_only_once_its_approval_has_left(
    after_batch: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
):
    """The approval is what is waited for: the batch waits (act.LEAVE_FIRST at most) for its sends to start before it
    writes the VM positions, however late the pool's thread starts (benchmarks/hop.py measured the positions' write
    inside the approval's hop when it did not). The bound is raised here so that a loaded machine's scheduling does
    not decide the order: without the wait, the positions come first however long the bound."""
    monkeypatch.setattr("coordinator.pipeline.act.LEAVE_FIRST", 5.0)
    order: list[str] = []
    coordinator = make_coordinator(
        store=NotingOrder(order),
        history=MemoryHistory(),
        alerts=RecordingAlerts(),
        callback=NotingSend(order),
        policy=load_policy(DEFAULT_POLICY_PATH),
        clock=Clock(),
        after_batch=after_batch,
    )
    pool = SlowToStart(max_workers=2)
    coordinator._executor = pool
    try:
        coordinator.run_batch([message_of("WestNO_0", 1, "EV-A")])
        assert order[:2] == ["approval", "positions"]
        assert wait_until(lambda: event(coordinator, "EV-A").state == "Approved", timeout=5.0, interval=0.02)
    finally:
        coordinator.close(timeout=5)
        pool.shutdown(wait=True)


def test_a_batch_waits_only_for_the_sends_its_pool_can_start_at_once():
    """Sends beyond the pool's width start only as earlier ones end (a round trip later): not waited for."""
    futures: dict[Future[Any], list[Any]] = {Future(): [] for _ in range(3)}
    sending = Sending(futures=futures, handing_over=False, within=3.0, until=0.0)
    sending.leaving.release()  # one send started: the pool's one worker busy with it
    started = time.monotonic()
    assert sending.departed(5.0, at_most=1)
    assert time.monotonic() - started < 1.0
    assert not sending.departed(0.05, at_most=3)  # three asked for, none more starts: the bound ends the wait


def answer_when_let(page: Any) -> threading.Event:
    """The gate page answers 200 only once the event returned is set (10 s at most)."""
    answer = threading.Event()

    def answer_once_set(handler: Any) -> None:
        answer.wait(timeout=10)
        handler.send_response(200)
        handler.end_headers()

    page.do_GET = answer_once_set
    return answer


def gated(url: str, *rules: str) -> Policy:
    """A policy with the gate ``app-health`` (the page at ``url``, 10 s to answer) and ``rules`` (YAML lines)."""
    gate = f'  app-health: {{http: {{url: "{url}", expectStatus: [200], timeoutSeconds: 10}}}}'
    return parse_policy("\n".join(["gates:", gate, "rules:", *rules]))


def test_a_batch_returns_without_waiting_for_a_slow_gate_and_its_tail_decides_what_needs_it(
    after_batch: ThreadPoolExecutor, health: tuple[str, Any]
):
    """The Freeze's rule reads a gate whose page answers only when the test lets it: the batch sends the Reboot's
    approval, writes the Freeze undecided and returns (its partition goes on); its tail decides the Freeze once the
    gate has answered (at that time: its validity runs from then), sends that approval and commits both answers."""
    url, page = health
    answer = answer_when_let(page)
    callback, clock = RecordingCallback(), Clock()
    coordinator = coordinator_with(callback, after_batch, clock)
    coordinator.policy = gated(
        url,
        "  - {name: freezes-while-healthy, match: {eventType: [Freeze]}, action: approve-now, gates: [app-health]}",
        "  - {name: reboots, match: {eventType: [Reboot]}, action: approve-now}",
    )
    reboot = scheduled_event("EV-R", event_type="Reboot", resources=["WestNO_1"])
    started = time.monotonic()
    coordinator.run_batch(
        [
            message_of("WestNO_0", 1, "EV-F"),
            message(envelope(vm("WestNO_1", index=2), sequence=1, incarnation=1, events=[reboot])),
        ]
    )
    returned = time.monotonic() - started

    assert returned < 1.0
    assert not answer.is_set()
    assert [request.eventId for request, _ in callback.sent] == ["EV-R"]  # sent by the batch
    held = event(coordinator, "EV-F")
    assert (held.state, held.decision, held.approval) == ("Scheduled", None, None)  # written undecided

    clock.now = DOC_NOW + timedelta(seconds=10)  # the gate answers 10 s into the batch: decided then, not before
    answer.set()
    assert wait_until(lambda: event(coordinator, "EV-F").state == "Approved", timeout=5.0, interval=0.02)
    assert event(coordinator, "EV-R").state == "Approved"
    assert [request.eventId for request, _ in callback.sent] == ["EV-R", "EV-F"]
    decision = event(coordinator, "EV-F").decision
    assert decision is not None
    assert (decision.rule, decision.decidedAt) == ("freezes-while-healthy", clock.now)
    request = callback.sent[1][0]
    assert request.deadline > clock.now  # valid from when it was decided (from the batch's start it had expired)
    assert wait_until(lambda: outcomes(coordinator, "EV-F") == ["sending", "approved"], timeout=5.0, interval=0.02)


def test_deletes_that_waited_for_a_slow_gate_are_approved_together_by_the_tail(
    after_batch: ThreadPoolExecutor, health: tuple[str, Any]
):
    """A scale set's two deletes in one batch, their rule's gate slow: both are written undecided, and the tail
    decides both once the gate has answered. The first decided is held by its sibling (not decided yet); deciding the
    sibling frees it in the same tail (``release_held``), not at the timer's next tick."""
    url, page = health
    answer = answer_when_let(page)
    callback = RecordingCallback()
    coordinator = coordinator_with(callback, after_batch, Clock())
    deletes = "{name: deletes-while-healthy, match: {eventType: [Terminate]}, action: approve-now, gates: [app-health]}"
    coordinator.policy = gated(url, f"  - {deletes}")
    messages = []
    for index, (name, event_id) in enumerate([("web_0", "EV-T0"), ("web_1", "EV-T1")], start=1):
        terminate = scheduled_event(event_id, event_type="Terminate", resources=[name], source="User")
        identity = vm(name, scale_set="web", index=index)
        messages.append(message(envelope(identity, sequence=1, incarnation=1, events=[terminate])))
    coordinator.run_batch(messages)
    assert [event(coordinator, e).decision for e in ("EV-T0", "EV-T1")] == [None, None]

    answer.set()
    assert wait_until(
        lambda: all(event(coordinator, e).state == "Approved" for e in ("EV-T0", "EV-T1")), timeout=5.0, interval=0.02
    )
    assert sorted(request.eventId for request, _ in callback.sent) == ["EV-T0", "EV-T1"]
