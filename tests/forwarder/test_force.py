"""A force request (an escalation ladder's last step, ``facts.forceHook``) on the VM: judged as any request, answered
"accepted" while this VM's own ``force.d/NAME`` hook runs on a thread of its own, and StartRequests sent only if the
hook succeeded and a document read after it still allows it (forwarder/approver.py, forwarder/force.py). IMDS is a
stand-in at the approver's seam (``ScheduledEventsSource``); the hooks are real processes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.wire import ApprovalFacts, ApprovalRequest, ScheduledEvent, ScheduledEventsDocument, VmIdentity
from forwarder.approver import Approver
from forwarder.decisions import LedgerEntry, MemoryLedger
from forwarder.durable_state import Store
from forwarder.force import ForceHooks, force_deadline
from forwarder.hooks import HookRunner
from forwarder.relay_protocol import RelayRequest
from forwarder.telemetry import IdTracer
from forwarder.worker_parts import WorkerParts
from tests.forwarder.conftest import write_hook
from tests.polling import wait_for

NOW = datetime(2026, 11, 21, 6, 0, tzinfo=UTC)
NOT_BEFORE = NOW + timedelta(seconds=60)
IDENTITY = {
    "name": "web_0",
    "resourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/web_0",
    "vmId": "00000000-0000-0000-0000-000000000001",
}


def _event(status: str = "Scheduled") -> dict[str, object]:
    return {
        "EventId": "E1",
        "EventType": "Freeze",
        "ResourceType": "VirtualMachine",
        "Resources": ["web_0"],
        "EventStatus": status,
        "NotBefore": NOT_BEFORE.strftime("%a, %d %b %Y %H:%M:%S GMT"),
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": 5,
    }


def _request(
    decision_id: str = "d-1", *, not_after: datetime = NOT_BEFORE - timedelta(seconds=5), **facts: Any
) -> ApprovalRequest:
    seen = ApprovalFacts.of(ScheduledEvent.from_mapping(_event()))
    return ApprovalRequest.from_mapping(
        {
            "eventId": "E1",
            "decisionId": decision_id,
            "rule": "ladder",
            "issuedAt": NOW - timedelta(seconds=1),
            "expiresAt": not_after,
            "notAfter": not_after,
            "facts": seen.replace(forceHook="drain", nearNotBeforeSeconds=120, **facts).to_mapping(),
        }
    )


class _Imds:
    """IMDS at the approver's seam: the event is Started once approved, or once ``started_by`` exists (the platform
    started it meanwhile); each POST notes whether ``hook_ran`` existed then."""

    def __init__(self, *, hook_ran: Path, started_by: Path | None = None) -> None:
        self.hook_ran, self.started_by = hook_ran, started_by
        self.posts: list[tuple[list[str], bool]] = []
        self.reads = 0

    def get_document(self) -> ScheduledEventsDocument:
        self.reads += 1
        started = self.posts or (self.started_by is not None and self.started_by.exists())
        return ScheduledEventsDocument.from_mapping(
            {"DocumentIncarnation": 3 + len(self.posts), "Events": [_event("Started" if started else "Scheduled")]}
        )

    def approve(self, event_ids: Iterable[str], *, before: float | None = None) -> None:
        self.posts.append((list(event_ids), self.hook_ran.exists()))


class _Vm:
    """One VM's listener with its hooks folder under ``root``, its ledger and its IMDS stand-in."""

    def __init__(
        self,
        root: Path,
        *,
        clock: Callable[[], datetime] = lambda: NOW,
        store: Store | None = None,
        timeout: float = 10.0,
        grace: float = 0.3,
        started_by: Path | None = None,
    ) -> None:
        self.root = root
        self.imds = _Imds(hook_ran=root / "hook-ran", started_by=started_by)
        self.runner = HookRunner(hooks_dir=root / "hooks", timeout=timeout, margin=5.0, grace=grace)
        self.spooled: list[int] = []
        parts = None
        if store is not None:
            parts = WorkerParts(store=store, tracer=IdTracer(), counters={}, spooled=lambda: self.spooled.append(1))
        self.force = ForceHooks(self.runner, identity=VmIdentity.from_mapping(IDENTITY), parts=parts, post_reserve=0.5)
        self.ledger = store if store is not None else MemoryLedger()
        self.approver = Approver(imds=self.imds, vm_name="web_0", clock=clock, ledger=self.ledger, force=self.force)

    def install(self, script: str, name: str = "drain") -> Path:
        return write_hook(self.root / "hooks" / "force.d", name, script)

    def ask(self, request: ApprovalRequest) -> dict[str, Any]:
        relayed = RelayRequest(
            "r", "POST", "/vm/approve", "/approve", {"Content-Type": "application/json"}, request.to_json_bytes()
        )
        answer = self.approver(relayed)
        assert answer.status_code == 200, answer.body
        body: dict[str, Any] = json.loads(answer.body)
        return body

    def settled(self, decision_id: str = "d-1") -> dict[str, Any]:
        """The decision's final answer once the force hook's thread has decided it ("approved" or "refused")."""

        def done() -> LedgerEntry | None:
            entry = self.ledger.decision(decision_id)
            return entry if entry is not None and entry.status in ("approved", "refused") else None

        entry: LedgerEntry = wait_for(done, timeout=15, what=f"decision {decision_id} settled")
        result: dict[str, Any] = json.loads(entry.result)
        result["status"] = entry.status
        return result


def test_accepted_then_started_once_after_the_hook_succeeded(tmp_path: Path) -> None:
    vm = _Vm(tmp_path)
    told = tmp_path / "told"
    vm.install(f'cat > "{told}.stdin"\necho "$SCHEDULED_EVENT_PHASE $SCHEDULED_EVENT_ID" > "{told}"\nsleep 0.3\n'
               f'touch "{vm.imds.hook_ran}"\n')  # fmt: skip
    answer = vm.ask(_request())
    assert answer["outcome"] == "accepted"
    assert answer["reason"].startswith(
        "force hook drain running; StartRequests once it succeeds, by 2026-11-21T06:00:53"
    )
    entry = vm.ledger.decision("d-1")
    assert entry is not None
    assert entry.status == "forcing"  # while the hook runs
    settled = vm.settled()
    assert (settled["status"], settled["outcome"], settled["reason"]) == ("approved", "approved", "")
    assert vm.imds.posts == [(["E1"], True)]  # once, and after the hook had run
    assert told.read_text().split() == ["force", "E1"]
    assert json.loads(Path(f"{told}.stdin").read_text())["EventId"] == "E1"
    # A repeat afterwards gets the stored answer: no second POST, no second run.
    assert vm.ask(_request())["outcome"] == "approved"
    assert len(vm.imds.posts) == 1


@pytest.mark.parametrize("installed", ["nothing", "not executable", "another hook"])
def test_a_force_hook_this_vm_has_not_installed_is_rejected(tmp_path: Path, installed: str) -> None:
    vm = _Vm(tmp_path)
    if installed == "not executable":
        vm.install("exit 0\n").chmod(0o644)
    elif installed == "another hook":
        vm.install("exit 0\n", name="drain-all")
    answer = vm.ask(_request())
    assert answer["outcome"] == "rejected"
    assert answer["reason"] == (
        f"force hook drain is not installed on this VM: no executable {tmp_path}/hooks/force.d/drain"
    )
    assert vm.imds.posts == []
    entry = vm.ledger.decision("d-1")
    assert entry is not None
    assert entry.status == "refused"


def test_a_force_request_for_an_event_that_does_not_name_this_vm_runs_nothing(tmp_path: Path) -> None:
    vm = _Vm(tmp_path)
    vm.approver = Approver(imds=vm.imds, vm_name="web_1", clock=lambda: NOW, ledger=vm.ledger, force=vm.force)
    vm.install("touch " + str(tmp_path / "hook-ran") + "\nexit 0\n")
    answer = vm.ask(_request())
    assert answer["outcome"] == "rejected"
    assert answer["reason"] == "a force request for E1, which does not name this VM (web_1)"
    time.sleep(0.3)
    assert not (tmp_path / "hook-ran").exists()
    assert vm.imds.posts == []


def test_a_failing_force_hook_sends_nothing_and_refuses_the_decision(tmp_path: Path) -> None:
    vm = _Vm(tmp_path)
    vm.install("echo cannot drain\nexit 1\n")
    assert vm.ask(_request())["outcome"] == "accepted"
    settled = vm.settled()
    assert (settled["status"], settled["outcome"]) == ("refused", "rejected")
    assert settled["reason"] == "force hook drain failed (exit 1)"
    assert vm.imds.posts == []
    assert vm.imds.reads == 1  # the judgement before the hook; none after a failure


def test_a_force_hook_outlasting_its_bound_is_killed_and_nothing_is_sent(tmp_path: Path) -> None:
    """The bound comes from the request: its SIGKILL lands before the deadline less the tolerance (2 s) less the
    POST's reserve (0.5 s here), well before NotBefore less the margin."""
    vm = _Vm(tmp_path, grace=0.3)
    child = tmp_path / "child-alive"
    vm.install(f"trap '' TERM\n(trap '' TERM; while true; do touch \"{child}\"; sleep 0.05; done) &\n"
               "while true; do sleep 0.05; done\n")  # fmt: skip
    started = time.monotonic()
    assert vm.ask(_request(not_after=NOW + timedelta(seconds=3.5)))["outcome"] == "accepted"
    settled = vm.settled()
    took = time.monotonic() - started
    # TERM at 3.5 - 2 - 0.5 - 0.3 = 0.7 s, KILL 0.3 s later: 1 s, when 1.5 s of the request were left.
    assert 0.95 <= took < 1.5
    assert settled["reason"].startswith("force hook drain timed out (stopped at its budget of 0.7 s: SIGTERM, SIGKILL")
    assert vm.imds.posts == []
    child.unlink()
    time.sleep(0.2)
    assert not child.exists(), "the hook's child outlived its KILL"


def test_a_repeat_while_forcing_is_accepted_again_and_runs_nothing_twice(tmp_path: Path) -> None:
    vm = _Vm(tmp_path)
    runs = tmp_path / "runs"
    vm.install(f'echo run >> "{runs}"\nsleep 0.6\ntouch "{vm.imds.hook_ran}"\n')
    first = vm.ask(_request())
    wait_for(runs.exists, what="the hook to start")
    again = vm.ask(_request())
    assert (first["outcome"], again) == ("accepted", first)
    # Another decision forcing the same event meanwhile runs no second hook either.
    other = vm.ask(_request("d-2"))
    assert other["outcome"] == "rejected"
    assert other["reason"] == "a force hook for event E1 already runs, for decision 'd-1'"
    assert vm.settled()["outcome"] == "approved"
    assert runs.read_text() == "run\n"
    assert vm.imds.posts == [(["E1"], True)]


def test_an_event_the_platform_started_while_the_hook_ran_is_not_posted(tmp_path: Path) -> None:
    started_by = tmp_path / "platform-started-it"
    vm = _Vm(tmp_path, started_by=started_by)
    vm.install(f'touch "{started_by}"\n')
    assert vm.ask(_request())["outcome"] == "accepted"
    settled = vm.settled()
    assert (settled["status"], settled["outcome"], settled["reason"]) == (
        "refused",
        "not-scheduled",
        "the event is Started",
    )
    assert vm.imds.posts == []
    assert vm.imds.reads == 2  # judged again on a document read after the hook


def test_a_request_that_lapsed_while_the_hook_ran_is_not_posted(tmp_path: Path) -> None:
    """The VM's clock says notAfter passed while the hook ran (here: a step of the clock the hook makes): the second
    judgement refuses it, as any request refused past its notAfter."""
    stepped = tmp_path / "clock-stepped"

    def clock() -> datetime:
        return NOW + timedelta(seconds=54) if stepped.exists() else NOW

    vm = _Vm(tmp_path, clock=clock)
    vm.install(f'touch "{stepped}"\n')
    assert vm.ask(_request())["outcome"] == "accepted"
    settled = vm.settled()
    assert (settled["status"], settled["outcome"]) == ("refused", "rejected")
    assert settled["reason"].startswith("expired at 2026-11-21T06:00:55+00:00")
    assert vm.imds.posts == []


def test_the_force_phase_is_reported_as_one_hook_envelope(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.sqlite")
    vm = _Vm(tmp_path, store=store)
    vm.install(f'echo drained\ntouch "{vm.imds.hook_ran}"\n')
    assert vm.ask(_request())["outcome"] == "accepted"
    assert vm.settled()["outcome"] == "approved"
    (spooled,) = wait_for(lambda: store.peek(10), what="the hook report")
    report = json.loads(spooled.body)
    assert (spooled.kind, report["kind"]) == ("hook", "hook")
    hook = report["hook"]
    assert (hook["eventId"], hook["phase"], hook["outcome"]) == ("E1", "force", "succeeded")
    assert [(s["hook"], s["outcome"], s["outputTail"]) for s in hook["steps"]] == [("drain", "succeeded", "drained\n")]
    assert vm.spooled == [1]
    assert spooled.traceparent  # in the trace of the request's listener.approve span
    store.close()


def test_a_decision_left_forcing_by_a_crash_is_judged_again_and_its_hook_run_again(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.sqlite")
    store.remember_decision(LedgerEntry("d-1", "E1", "forcing", NOW, '{"outcome":"accepted"}'))
    runs = tmp_path / "runs"
    vm = _Vm(tmp_path, store=store)  # the restarted process: nothing of it runs
    vm.install(f'echo run >> "{runs}"\ntouch "{vm.imds.hook_ran}"\n')
    answer = vm.ask(_request())
    assert answer["outcome"] == "accepted"
    assert vm.settled()["outcome"] == "approved"
    assert runs.read_text() == "run\n"
    assert vm.imds.posts == [(["E1"], True)]
    # A decisionId already used for another event is still a replay.
    store.remember_decision(LedgerEntry("d-9", "E0", "approved", NOW, "{}"))
    replay = vm.ask(_request("d-9"))
    assert (replay["outcome"], replay["reason"]) == ("rejected", "decisionId 'd-9' was already used for event 'E0'")
    store.close()


def test_a_force_hook_killed_by_the_forwarders_stop_refuses_its_decision(tmp_path: Path) -> None:
    vm = _Vm(tmp_path)
    vm.install(f'touch "{tmp_path}/began"\nsleep 30\n')
    assert vm.ask(_request())["outcome"] == "accepted"
    wait_for((tmp_path / "began").exists, what="the hook to start")
    vm.runner.stop()  # the daemon's stop: its hooks killed, then the force threads joined
    vm.force.join(5)
    settled = vm.settled()
    assert settled["status"] == "refused"
    assert settled["reason"].startswith("force hook drain failed (signal 9; killed: forwarder stopped")
    assert vm.imds.posts == []


def test_the_bound_is_the_earlier_of_the_requests_deadline_and_not_before_less_the_margin() -> None:
    event = ScheduledEvent.from_mapping(_event())
    tolerance = timedelta(seconds=2)

    def term_at(not_after: datetime) -> float:
        request = _request(not_after=not_after)
        return force_deadline(
            request, event, now=NOW, monotonic=100.0, tolerance=tolerance, margin=5, grace=3, reserve=2
        )

    # The usual force request, valid to NotBefore - 5 s: KILL by NotBefore - 5 - 2 - 2, TERM 3 s before.
    assert term_at(NOT_BEFORE - timedelta(seconds=5)) == 100.0 + 60 - 9 - 3
    # Valid up to NotBefore: NotBefore less the margin (5 s) is the earlier.
    assert term_at(NOT_BEFORE) == 100.0 + 60 - 5 - 3
