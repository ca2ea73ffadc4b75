"""The forwarder daemon in-process over real HTTP against the IMDS emulator, writing real JSON-lines envelopes."""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from contracts.envelope import Envelope
from emulators.imds import ImdsEmulator
from forwarder import daemon
from forwarder.durable_state import HookJob, Store
from tests.forwarder.conftest import Harness, ScriptedImds, fill_disk, write_hook
from tests.polling import wait_for

MakeHarness = Callable[..., Harness]


def test_every_change_yields_exactly_one_envelope(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"))
    h.wait_incarnation(1)
    first = imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(2)
    imds.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)  # same group: web_0 sees it
    h.wait_incarnation(3)
    imds.cancel_event(first["EventId"])
    h.wait_incarnation(4)
    time.sleep(0.3)  # a few more polls of an unchanged document
    assert h.incarnations() == [1, 2, 3, 4]
    envelopes = [Envelope.from_mapping(e) for e in h.envelopes()]
    sequences = [e.sequence for e in envelopes]
    assert sequences == sorted(set(sequences))
    assert {e.vm.partition_key for e in envelopes} == {
        "/subscriptions/00000000-0000-0000-0000-00000000e001/resourcegroups/rg-scheduled-events/providers/"
        "microsoft.compute/virtualmachinescalesets/web/virtualmachines/0"
    }
    # The document is forwarded exactly as read.
    last = h.envelopes("incarnation")[-1]["document"]
    assert last == imds.document("web_0")


def test_incarnation_reset_is_forwarded(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"))
    # The first document is read after the forwarder attests (it asks IMDS for its attested document first): wait for
    # it, so that the events below make incarnations 2 and 3 rather than fold into the first document read.
    h.wait_incarnation(1)
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(2)
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(3)
    imds.inject_fault(kind="incarnation-reset", vm="web_0")
    reset = wait_for(lambda: h.incarnations()[-1] == 1 and h.envelopes("incarnation")[-1], what="reset envelope")
    assert len(reset["document"]["Events"]) == 2
    assert h.incarnations() == [1, 2, 3, 1]


def test_several_vms_each_forward_their_own_view(imds: ImdsEmulator, harness: MakeHarness) -> None:
    forwarders = {name: harness(imds.url_for(name), name=name) for name in ("web_0", "web_1", "web_2")}
    for h in forwarders.values():
        write_hook(h.settings.hooks_dir / "prepare.d", "10-record", f"cat > {h.root}/prepared.json\n")
    created = imds.create_event(EventType="Reboot", Resources=["web_1"], NoticeSeconds=900)
    for h in forwarders.values():
        h.wait_incarnation(2)
    for name, h in forwarders.items():
        (envelope,) = [e for e in h.envelopes("incarnation") if e["document"]["DocumentIncarnation"] == 2]
        assert envelope["vm"]["name"] == name
        assert envelope["document"]["Events"][0]["EventId"] == created["EventId"]
    # Only the VM in Resources prepares.
    wait_for(lambda: forwarders["web_1"].envelopes("hook"), what="web_1's hook report")
    time.sleep(0.3)
    assert forwarders["web_0"].envelopes("hook") == []
    assert forwarders["web_2"].envelopes("hook") == []
    assert not (forwarders["web_0"].root / "prepared.json").exists()


def test_prepare_and_recover_hooks_get_the_event(imds: ImdsEmulator, harness: MakeHarness, tmp_path: Path) -> None:
    h = harness(imds.url_for("web_0"))
    record = tmp_path / "hook-calls"
    script = f'echo "$SCHEDULED_EVENT_PHASE $SCHEDULED_EVENT_ID $SCHEDULED_EVENT_TYPE $VM_NAME" >> {record}\n'
    script += f"cat > {tmp_path}/stdin-$SCHEDULED_EVENT_PHASE.json\necho hello from $0\n"
    write_hook(h.settings.hooks_dir / "prepare.d", "10-drain", script)
    write_hook(h.settings.hooks_dir / "recover.d", "10-undrain", script)
    (h.settings.hooks_dir / "prepare.d" / "README").write_text("not executable, skipped")
    created = imds.create_event(EventType="Redeploy", Resources=["web_0", "web_1"], NoticeSeconds=900)
    event_id = created["EventId"]
    prepared = wait_for(lambda: h.envelopes("hook"), what="prepare report")[0]["hook"]
    assert prepared["phase"] == "prepare"
    assert prepared["outcome"] == "succeeded"
    assert prepared["hook"] == ""  # no hook failed
    assert [step["hook"] for step in prepared["steps"]] == ["10-drain"]  # the README is not executable
    assert prepared["exitCode"] == 0
    assert "hello from" in prepared["outputTail"]
    stdin = json.loads((tmp_path / "stdin-prepare.json").read_text())
    assert stdin["EventId"] == event_id
    assert stdin["Resources"] == ["web_0", "web_1"]
    imds.cancel_event(event_id)
    recovered = wait_for(lambda: len(h.envelopes("hook")) == 2 and h.envelopes("hook")[1], what="recover report")
    assert recovered["hook"]["phase"] == "recover"
    assert record.read_text().splitlines() == [
        f"prepare {event_id} Redeploy web_0",
        f"recover {event_id} Redeploy web_0",
    ]


def test_failing_and_hanging_hooks_are_reported_and_polling_goes_on(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"), hook_timeout=0.5)
    write_hook(h.settings.hooks_dir / "prepare.d", "10-hangs", "sleep 30\n")
    write_hook(h.settings.hooks_dir / "prepare.d", "20-fails", "echo broken >&2\nexit 3\n")
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(2)
    # While the first hook hangs, a new document is still forwarded: hooks never block the poll.
    imds.create_event(EventType="Freeze", Resources=["web_2"], NoticeSeconds=900)
    h.wait_incarnation(3, timeout=0.45)
    (envelope,) = wait_for(lambda: h.envelopes("hook"), what="the phase report")
    report = Envelope.from_mapping(envelope).hook
    assert report is not None
    # The phase takes the outcome of its first hook that did not succeed; every hook ran and is listed.
    assert (report.outcome, report.hook, report.failed_hook) == ("timed-out", "10-hangs", "10-hangs")
    hung, failed = report.steps or []
    assert (hung.hook, hung.outcome) == ("10-hangs", "timed-out")
    assert 0.5 <= hung.durationSeconds < 3
    assert (failed.hook, failed.outcome, failed.exitCode) == ("20-fails", "failed", 3)
    assert "broken" in failed.outputTail
    assert "stopped at its budget of 0.5 s" in report.outputTail  # the failed step's output heads the report


def test_a_failing_hook_before_a_succeeding_one_fails_the_phase(imds: ImdsEmulator, harness: MakeHarness) -> None:
    """Issue 10's case: 10-check fails, 20-drain succeeds; the phase failed, and 20-drain still ran (run-parts)."""
    h = harness(imds.url_for("web_0"))
    write_hook(h.settings.hooks_dir / "prepare.d", "10-check", "echo not ready\nexit 1\n")
    write_hook(h.settings.hooks_dir / "prepare.d", "20-drain", f"touch {h.root}/drained\n")
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    (envelope,) = wait_for(lambda: h.envelopes("hook"), what="the phase report")
    time.sleep(0.2)
    assert len(h.envelopes("hook")) == 1, "one envelope per phase"
    report = envelope["hook"]
    assert (report["outcome"], report["hook"], report["exitCode"]) == ("failed", "10-check", 1)
    assert "not ready" in report["outputTail"]
    assert [(s["hook"], s["outcome"]) for s in report["steps"]] == [("10-check", "failed"), ("20-drain", "succeeded")]
    assert (h.root / "drained").exists()
    assert envelope["stateId"] == h.store.state_id


def test_no_hooks_installed_reports_not_run(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"))
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    report = wait_for(lambda: h.envelopes("hook"), what="report")[0]["hook"]
    assert report["outcome"] == "not-run"
    assert report["steps"] == []


def test_a_hook_runs_once_per_event_across_restarts(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"), name="vm")
    write_hook(h.settings.hooks_dir / "prepare.d", "10-count", f"echo run >> {h.root}/runs\n")
    h.wait_incarnation(1)  # its first document read before the event exists (a loaded machine polls late)
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    wait_for(lambda: h.envelopes("hook"), what="first report")
    h.stop()
    # Same state folder: the event is still in the document, but its prepare hook already ran.
    again = harness(imds.url_for("web_0"), name="vm")
    imds.create_event(EventType="Freeze", Resources=["web_1"], NoticeSeconds=900)
    again.wait_incarnation(3)
    time.sleep(0.3)
    assert (h.root / "runs").read_text() == "run\n"
    assert len(again.envelopes("hook")) == 1
    sequences = [e["sequence"] for e in again.envelopes()]
    assert sequences == sorted(set(sequences)), "sequence must keep increasing across the restart"
    # The restarted forwarder does not resend an unchanged document.
    assert again.incarnations() == [1, 2, 3]


def test_faults_are_counted_and_nothing_invalid_is_forwarded(
    imds: ImdsEmulator, harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="forwarder")
    h = harness(imds.url_for("web_0"), imds_timeout=0.3)
    h.wait_incarnation(1)
    write_hook(h.settings.hooks_dir / "prepare.d", "10-any", "true\n")
    errors = h.forwarder.counters

    imds.inject_fault(kind="malformed-json", vm="web_0", count=3)
    wait_for(lambda: errors["imds_errors"] >= 3, what="three malformed documents")
    assert h.store.counters()["invalid_documents"] == 1  # the same bad body three times is one bad item
    (reason, body) = h.store.rejects()[0]
    assert "scheduled-events document is invalid" in reason
    assert body.startswith(b"{")
    (line,) = [r for r in caplog.records if r.getMessage().startswith("invalid scheduled-events document")]
    assert "DocumentIncarnation" in line.fields["reason"] or "Invalid JSON" in line.fields["reason"]  # type: ignore[attr-defined]

    imds.inject_fault(kind="error-burst", vm="web_0", status=500, count=2)
    wait_for(lambda: errors["imds_errors"] >= 5, what="two 500s")
    imds.inject_fault(kind="hang", vm="web_0", seconds=1, count=1)
    wait_for(lambda: errors["imds_errors"] >= 6, what="a timeout", timeout=15)

    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    h.wait_incarnation(2, timeout=15)
    assert h.incarnations() == [1, 2]  # nothing was forwarded from the bad answers
    hooks = wait_for(lambda: h.envelopes("hook"), what="hook report")
    assert len(hooks) == 1


def test_heartbeats_carry_counters(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"), heartbeat_interval=0.2)
    beats = wait_for(lambda: len(h.envelopes("heartbeat")) >= 3 and h.envelopes("heartbeat"), what="heartbeats")
    assert beats[-1]["counters"]["polls"] > beats[0]["counters"]["polls"]
    assert "spool_depth" in beats[-1]["counters"]


def test_shutdown_flushes_the_spool(imds: ImdsEmulator, harness: MakeHarness) -> None:
    h = harness(imds.url_for("web_0"))
    h.wait_incarnation(1)
    h.stop()
    assert h.store.path.exists()
    assert h.envelopes("incarnation")


class _BrokenCompanion:
    """A companion whose start fails (a stand-in for a relay listener that cannot start)."""

    stopped = False

    def start(self) -> None:
        raise RuntimeError("cannot listen")

    def stop(self) -> None:
        self.stopped = True


class _Companion:
    started = stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True


def test_companions_start_and_stop_with_the_daemon_and_never_break_it(imds: ImdsEmulator, harness: MakeHarness) -> None:
    good, broken = _Companion(), _BrokenCompanion()
    h = harness(imds.url_for("web_0"), name="a", companions=lambda identity, client, force: [broken, good])
    h.wait_incarnation(1)
    assert good.started
    h.stop()
    assert good.stopped
    assert not broken.stopped  # never started, so never stopped

    def unbuildable(identity: object, client: object, force: object) -> list[_Companion]:
        raise ImportError("no websockets")

    failing = harness(imds.url_for("web_1"), name="b", companions=unbuildable)
    failing.wait_incarnation(1)  # forwarding goes on without companions


def test_the_startup_heartbeat_does_not_wait_for_the_slow_first_poll(imds: ImdsEmulator, harness: MakeHarness) -> None:
    """The first scheduled-events call may take two minutes; the VM is heard from as soon as its identity is known,
    and that first call gets the long timeout although the identity call came before it."""
    imds.inject_fault(kind="first-call-delay", vm="web_0", endpoint="scheduledevents", seconds=1.5)
    started = time.monotonic()
    h = harness(imds.url_for("web_0"), imds_timeout=0.3, imds_first_call_timeout=5.0)
    (beat,) = wait_for(lambda: h.envelopes("heartbeat"), timeout=1.0, what="the start-up heartbeat")
    assert h.envelopes("incarnation") == [], "the heartbeat went out while the first poll was still waiting"
    first = h.wait_incarnation(1)
    assert time.monotonic() - started >= 1.4
    assert h.forwarder.counters["imds_errors"] == 0, "the slow first call was not cut short by the 0.3 s timeout"
    assert beat["sequence"] < first["sequence"]


def test_every_envelope_carries_the_state_id_and_a_new_state_gets_a_new_one(
    imds: ImdsEmulator, harness: MakeHarness
) -> None:
    # The three forwarders share one state directory and one output file, so each wait names the state it is
    # about: an envelope of an earlier state already in the file must not satisfy it.
    h = harness(imds.url_for("web_0"), name="vm")
    imds.create_event(EventType="Reboot", Resources=["web_0"], NoticeSeconds=900)
    kinds = {"heartbeat", "incarnation", "hook"}
    wait_for(lambda: {e["kind"] for e in h.envelopes()} == kinds, what=f"one envelope of each kind {sorted(kinds)}")
    state_id = h.store.state_id
    assert len(state_id) == 32
    assert {e["stateId"] for e in h.envelopes()} == {state_id}
    h.stop()

    kept = harness(imds.url_for("web_0"), name="vm")  # same state directory: same state, sequence goes on
    (_, restarted) = wait_for(
        lambda: len(kept.envelopes("heartbeat")) == 2 and kept.envelopes("heartbeat"), what="the restart's heartbeat"
    )
    assert kept.store.state_id == state_id
    assert restarted["stateId"] == state_id
    kept.stop()
    last_sequence = max(e["sequence"] for e in kept.envelopes())

    for item in (kept.root / "state").iterdir():  # the state is wiped: a new forwarder, as far as anyone can tell
        item.unlink()
    fresh = harness(imds.url_for("web_0"), name="vm")
    assert fresh.store.state_id != state_id

    def of_the_new_state() -> list[dict[str, Any]]:
        return [e for e in fresh.envelopes() if e["stateId"] == fresh.store.state_id]

    # Its start-up heartbeat, then the document it finds (incarnation 2, the event is still there).
    new = wait_for(
        lambda: len(of_the_new_state()) >= 2 and of_the_new_state(),
        what="the new state's first two envelopes (its start-up heartbeat and incarnation 2)",
    )
    assert [(e["kind"], e["sequence"]) for e in new][:2] == [("heartbeat", 0), ("incarnation", 1)], (
        "a new state starts its sequence over"
    )
    assert new[1]["document"]["DocumentIncarnation"] == 2
    assert last_sequence >= 2


def test_a_document_nested_20000_deep_is_counted_and_the_poll_goes_on(
    scripted_imds: ScriptedImds, harness: MakeHarness
) -> None:
    h = harness(scripted_imds.url, heartbeat_interval=0.2, attest=False)  # no attested endpoint there
    h.wait_incarnation(1)
    scripted_imds.document = b'{"DocumentIncarnation": 2, "Events": [' + b"[" * 20_000 + b"]" * 20_000 + b"]}"
    wait_for(lambda: h.store.counters().get("invalid_documents") == 1, what="the deep document set aside")
    (reason, _) = h.store.rejects()[0]
    assert reason == "scheduled-events document is invalid: nested deeper than 64 levels"
    event = {"EventId": "A", "EventType": "Reboot", "Resources": ["web_0"], "EventStatus": "Scheduled"}
    scripted_imds.serve(3, event)
    assert [e["EventId"] for e in h.wait_incarnation(3)["document"]["Events"]] == ["A"]  # still polling
    assert h.forwarder.counters["imds_errors"] >= 1


def test_an_invalid_event_is_set_aside_and_the_valid_ones_go_on(
    scripted_imds: ScriptedImds, harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="forwarder")
    # The scripted IMDS has no attested endpoint.
    h = harness(scripted_imds.url, heartbeat_interval=0.2, attest=False)
    record = h.root / "hook-calls"
    for phase in ("prepare", "recover"):
        write_hook(h.settings.hooks_dir / f"{phase}.d", "10-record", f'echo "$0 $SCHEDULED_EVENT_ID" >> {record}\n')
    good = {"EventId": "A", "EventType": "Reboot", "Resources": ["web_0"], "EventStatus": "Scheduled"}
    bad_status = {**good, "EventId": "B", "EventStatus": "Completed"}
    no_id = {"EventType": "Freeze", "Resources": ["web_0"], "EventStatus": "Scheduled"}
    scripted_imds.serve(2, good, bad_status, no_id)
    envelope = h.wait_incarnation(2)
    assert [e["EventId"] for e in envelope["document"]["Events"]] == ["A"]
    reasons = [reason for reason, _ in h.store.rejects()]
    assert len(reasons) == 2
    assert "event 'B' (Events[1]) is invalid: EventStatus" in reasons[0]
    assert "event at Events[2] (no EventId) is invalid: EventId: Field required" in reasons[1]
    assert json.loads(h.store.rejects()[0][1])["EventStatus"] == "Completed"

    # A later document in which A turns invalid too: A has not left (no recover), B is not counted twice.
    scripted_imds.serve(3, {**good, "EventStatus": "Done"}, bad_status, no_id)
    h.wait_incarnation(3)
    # A valid again: it was prepared once already.
    scripted_imds.serve(4, good)
    h.wait_incarnation(4)
    # The phase's report is spooled once its hooks have exited, so the record is complete (the file exists as soon
    # as the hook opens it, before it writes).
    wait_for(lambda: h.envelopes("hook"), what="the prepare phase's report")
    time.sleep(0.3)
    assert record.read_text().split("\n")[:-1] == [f"{h.settings.hooks_dir}/prepare.d/10-record A"]
    assert h.store.counters()["invalid_events"] == 3
    logged = [r for r in caplog.records if r.getMessage().startswith("invalid scheduled event set aside")]
    assert len(logged) == 3, "once per distinct bad content, not once per poll"
    beat = wait_for(
        lambda: [b for b in h.envelopes("heartbeat") if b["counters"]["invalid_events"] == 3], what="the counter"
    )
    assert beat[0]["counters"]["invalid_documents"] == 0


def test_an_event_renamed_as_it_starts_is_one_maintenance(
    scripted_imds: ScriptedImds, harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """Microsoft's mock server: the Started event has a new EventId. Prepare runs once before, recover once after,
    nothing in the middle."""
    caplog.set_level(logging.INFO, logger="forwarder")
    h = harness(scripted_imds.url, attest=False)  # the scripted IMDS has no attested endpoint
    record = h.root / "hook-calls"
    for phase in ("prepare", "recover"):
        write_hook(h.settings.hooks_dir / f"{phase}.d", "10-record", f'echo "$0 $SCHEDULED_EVENT_ID" >> {record}\n')
    scheduled = {
        "EventId": "old-id",
        "EventType": "Reboot",
        "Resources": ["web_0", "web_1"],
        "EventStatus": "Scheduled",
        "NotBefore": "2030-01-01T10:00:00.0000000Z",  # ISO 8601, as the mock server writes it
    }
    scripted_imds.serve(2, scheduled)
    wait_for(lambda: len(h.envelopes("hook")) == 1, what="prepare")
    started = {
        **scheduled,
        "EventId": "new-id",
        "EventStatus": "Started",
        "NotBefore": "",
        "Resources": ["web_1", "web_0"],
    }
    scripted_imds.serve(3, started)
    h.wait_incarnation(3)
    scripted_imds.serve(4)
    wait_for(lambda: len(h.envelopes("hook")) == 2, what="recover")
    time.sleep(0.2)
    reports = [(e["hook"]["phase"], e["hook"]["eventId"]) for e in h.envelopes("hook")]
    assert reports == [("prepare", "old-id"), ("recover", "new-id")]
    assert len(record.read_text().splitlines()) == 2
    (renamed,) = [r for r in caplog.records if r.getMessage().startswith("event renamed")]
    assert (renamed.fields["event_id"], renamed.fields["new_event_id"]) == ("old-id", "new-id")  # type: ignore[attr-defined]


def test_the_hook_ledger_is_pruned_at_start_and_then_periodically(
    imds: ImdsEmulator, harness: MakeHarness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "vm" / "state"
    old = Store(state / "forwarder.sqlite")
    old.enqueue("incarnation", lambda s: b"{}", hooks=[HookJob("OLD", "prepare", "{}")])
    old.enqueue("hook", lambda s: b"{}", hook_done=("OLD", "prepare"))
    old.close()
    with sqlite3.connect(state / "forwarder.sqlite") as db:
        db.execute("UPDATE hooks SET updated_at = ?", ((datetime.now(UTC) - timedelta(days=40)).isoformat(),))
    prunes: list[int] = []
    original = Store.prune_hooks

    def counting(self: Store, *, now: datetime | None = None) -> int:
        prunes.append(original(self, now=now))
        return prunes[-1]

    monkeypatch.setattr(Store, "prune_hooks", counting)
    monkeypatch.setattr(daemon, "PRUNE_INTERVAL", 0.2)
    h = harness(imds.url_for("web_0"), name="vm")
    assert h.store.hook_status("OLD", "prepare") is None
    wait_for(lambda: len(prunes) >= 3, what="periodic prunes")
    assert prunes[0] == 1


def test_a_full_disk_backs_off_reports_it_in_heartbeats_resumes_and_loses_nothing(
    scripted_imds: ScriptedImds, harness: MakeHarness
) -> None:
    """It crash-looped: the spool's write raised out of the poll loop. Now the change waits in IMDS, heartbeats go
    out from memory saying since when the disk is full, and once there is room the change is forwarded and its
    hooks run, once."""
    h = harness(scripted_imds.url, heartbeat_interval=0.2, attest=False)  # no attested endpoint there
    record = h.root / "hook-calls"
    write_hook(h.settings.hooks_dir / "prepare.d", "10-record", f'echo "$SCHEDULED_EVENT_ID" >> {record}\n')
    h.wait_incarnation(1)
    disk = fill_disk(h.store)
    event = {"EventId": "A", "EventType": "Reboot", "Resources": ["web_0"], "EventStatus": "Scheduled"}
    scripted_imds.serve(2, event)

    full = wait_for(
        lambda: [b for b in h.envelopes("heartbeat") if b["health"].get("stateFullSince")],
        what="a heartbeat from memory",
    )
    assert full[0]["health"]["stateWriteErrors"] >= 1
    assert "disk is full" in full[0]["health"]["lastStateError"]
    time.sleep(1.0)
    assert h.incarnations() == [1]  # not spooled, not lost: still in IMDS
    assert not h.forwarder.stopping

    disk.full = False
    assert [e["EventId"] for e in h.wait_incarnation(2, timeout=30)["document"]["Events"]] == ["A"]
    wait_for(lambda: record.exists() and record.read_text() == "A\n", what="the prepare hook, once")
    recovered = wait_for(
        lambda: [
            b
            for b in h.envelopes("heartbeat")[len(full) :]
            if b["health"]["stateWriteErrors"] and not b["health"].get("stateFullSince")
        ],
        what="a heartbeat after the disk has room",
    )
    assert recovered[0]["health"]["lastStateError"]
    sequences = [e["sequence"] for e in h.envelopes()]
    assert sequences == sorted(set(sequences)), "sequences keep increasing, none used twice"
