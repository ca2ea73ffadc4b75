"""python -m ops.policy: check (errors name the line), test (cases pass and fail, exit codes, JSON),
simulate (a history recorded by the real coordinator, over Azurite and the IMDS emulator, replays with no difference
through its own policy and with the expected ones through changed policies; JSON and CSV exports read as SQLite
does; bad inputs are named, bad rows set aside and counted)."""

from __future__ import annotations

import csv
import json
import sqlite3
import subprocess
import sys
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.adapters.history import SqliteHistory
from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy, parse_policy
from coordinator.domain.rows import HistoryRow, column_types, history_schema
from ops.policy import adapters
from ops.policy.__main__ import main
from ops.policy.exports import read_history
from ops.policy.replay import replay
from tests.coordinator.helpers import DOC_NOW
from tests.coordinator.test_deletes import Harness, terminate

POLICIES = DEFAULT_POLICY_PATH.parent
EXAMPLE = POLICIES / "examples" / "short-freeze-waits.yaml"


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- check -------------------------------------------------------------------------------------------------------


def test_check_accepts_the_shipped_policies(capsys):
    for path in (DEFAULT_POLICY_PATH, EXAMPLE):
        code, out, _ = run(capsys, "check", path)
        assert code == 0
        assert "valid, 4 rules" in out


def test_check_names_the_line_of_each_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\nrules:\n  - name: a\n    action: approve-now\n    match:\n      eventTyp: [Freeze]\n"
        "  - name: b\n    action: approve-sometimes\n"
    )
    code, out, err = run(capsys, "check", bad)
    assert code == 2
    assert out == ""
    assert f"{bad}:6: rules.0.match.eventTyp: Extra inputs are not permitted" in err
    assert f"{bad}:8: rules.1.action" in err
    bad.write_text("rules:\n  - name: a\n    action: approve-now\n    name: b\n")
    code, _, err = run(capsys, "check", bad)
    assert code == 2
    assert f"{bad}:4: duplicate key 'name' (first on line 2)" in err


def test_check_of_a_missing_file_says_so(tmp_path, capsys):
    code, _, err = run(capsys, "check", tmp_path / "nope.yaml")
    assert code == 2
    assert "cannot read policy file" in err
    assert "nope.yaml" in err


def test_help_documents_the_exit_codes():
    out = subprocess.run(
        [sys.executable, "-m", "ops.policy", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "exit codes: 0 ok" in out
    assert "1 a test case failed" in out
    assert "2 bad input" in out


# --- test --------------------------------------------------------------------------------------------------------


def test_the_default_policy_passes_its_shipped_cases_found_beside_it(capsys):
    code, out, _ = run(capsys, "test", DEFAULT_POLICY_PATH)
    assert code == 0
    lines = out.splitlines()
    assert all(line.startswith("PASS ") for line in lines[:-1])
    assert lines[-1] == f"{len(lines) - 1} cases: {len(lines) - 1} passed, 0 failed, 0 errors"
    rules_seen = {line.split(" by ")[-1] for line in lines[:-1]}
    assert rules_seen == {r.name for r in load_policy(DEFAULT_POLICY_PATH).rules}
    cases = (POLICIES / "default.tests.yaml").read_text()
    for covered in ("hook deadline 240 s passed", "EventSource: User", "delete of web_1 (delete-web-1)"):
        assert covered in cases


def test_a_changed_policy_fails_the_cases_it_breaks_with_expected_and_got(capsys):
    code, out, _ = run(capsys, "test", EXAMPLE, POLICIES / "default.tests.yaml")
    assert code == 1
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 2
    assert (
        "a 5 s freeze is approved at once: expected approve by short-freeze, got wait by short-freeze-waits"
        in (failed[0])
    )
    assert "default.tests.yaml:" in failed[0]
    assert out.splitlines()[-1].endswith("18 passed, 2 failed, 0 errors")


def test_json_output_has_one_object_per_case_and_a_summary(capsys):
    code, out, _ = run(capsys, "test", EXAMPLE, POLICIES / "default.tests.yaml", "--json")
    assert code == 1
    objects = [json.loads(line) for line in out.splitlines()]
    assert objects[-1] == {"summary": {"cases": 20, "pass": 18, "fail": 2, "error": 0}}
    failing = [o for o in objects[:-1] if o["status"] == "fail"]
    assert failing[0]["expected"]["rule"] == "short-freeze"
    assert failing[0]["got"]["rule"] == "short-freeze-waits"
    assert failing[0]["got"]["verdict"] == "wait"


CASE = """cases:
  - name: {name}
    at: 2026-01-05T10:00:00Z
    event: {event}
    vms: {vms}
    expect: {expect}
"""


def cases_file(
    tmp_path: Path,
    *,
    name: str = "one",
    event: str = "{EventType: Reboot, Resources: [db-0]}",
    vms: str = "[]",
    expect: str = "{verdict: wait, rule: everything-else-waits}",
) -> Path:
    path = tmp_path / "cases.yaml"
    path.write_text(CASE.format(name=name, event=event, vms=vms, expect=expect))
    return path


def test_a_reason_substring_must_match_too(tmp_path, capsys):
    path = cases_file(tmp_path, expect="{verdict: wait, rule: everything-else-waits, reason: approves at once}")
    code, out, _ = run(capsys, "test", DEFAULT_POLICY_PATH, path)
    assert code == 1
    assert "with reason containing 'approves at once'" in out


def test_a_key_the_models_do_not_support_is_passed_through_and_refused_by_name(tmp_path, capsys):
    path = cases_file(tmp_path, vms="[{name: db-0, rackColour: blue}]")
    code, out, _ = run(capsys, "test", DEFAULT_POLICY_PATH, path)
    assert code == 2
    assert "ERROR" in out
    assert "'rackColour' not supported by this coordinator (VmIdentity has no such field" in out
    path = cases_file(tmp_path, event="{EventType: Reboot, Resources: [db-0], Urgency: high}")
    code, out, _ = run(capsys, "test", DEFAULT_POLICY_PATH, path)
    assert code == 2
    assert "'Urgency' not supported by this coordinator (EventRecord" in out


def test_a_vm_field_the_model_has_is_passed_through_to_it():
    identity = adapters.vm_identity({"name": "web_0", "scaleSet": "web", "zone": "2", "platformFaultDomain": "1"})
    assert (identity.vmScaleSetName, identity.zone, identity.platformFaultDomain) == ("web", "2", "1")


def test_bad_case_files_name_the_file_and_line(tmp_path, capsys):
    path = cases_file(tmp_path, expect="{verdict: maybe, rule: x}")
    code, _, err = run(capsys, "test", DEFAULT_POLICY_PATH, path)
    assert code == 2
    assert f"{path}:2: cases.0.expect.verdict" in err
    code, _, err = run(capsys, "test", tmp_path / "p.yaml")
    assert code == 2
    assert "cannot read policy file" in err
    (tmp_path / "p.yaml").write_text(DEFAULT_POLICY_PATH.read_text())
    code, _, err = run(capsys, "test", tmp_path / "p.yaml")
    assert code == 2
    assert f"put them in {tmp_path / 'p.tests.yaml'}" in err


# --- simulate ----------------------------------------------------------------------------------------------------


@pytest.fixture
def recorded(azurite: Any, fleet_imds: Any, tmp_path: Path) -> Path:
    """A history recorded by the real coordinator (default policy), written by the real SQLite writer: a short
    freeze approved at once, a platform reboot waiting for a person, two deletes drained in one batch and approved
    together, and two deletes of scale set web coupled: web_0 drained and held by web_3's, whose hook failed, both
    approved by the timer at the 240 s deadline."""
    h = Harness(azurite, fleet_imds, tmp_path)

    def step(seconds: float) -> None:
        h.clock.now += timedelta(seconds=seconds)

    freeze = str(
        fleet_imds.create_event(EventType="Freeze", Resources=["web_0"], DurationInSeconds=5, NoticeSeconds=900)[
            "EventId"
        ]
    )
    h.coordinator.process_batch([h.document("web_0", {freeze})])
    step(1)
    reboot = str(fleet_imds.create_event(EventType="Reboot", Resources=["web_3"], NoticeSeconds=900)["EventId"])
    h.coordinator.process_batch([h.document("web_3", {reboot})])
    step(1)
    first, second = terminate(fleet_imds, "web_1"), terminate(fleet_imds, "web_2")
    h.coordinator.process_batch([h.document("web_1", {first, second}), h.document("web_2", {first, second})])
    step(1)
    # Both drained in one batch: approved together (each one's own verdict is noted before either is decided).
    h.coordinator.process_batch(
        [h.phase("web_1", first, [("10-drain", "succeeded")]), h.phase("web_2", second, [("10-drain", "succeeded")])]
    )
    step(1)
    held, failing = terminate(fleet_imds, "web_0", notice=900), terminate(fleet_imds, "web_3", notice=900)
    h.coordinator.process_batch([h.document("web_0", {held, failing}), h.document("web_3", {held, failing})])
    step(1)
    h.coordinator.process_batch([h.phase("web_0", held, [("10-drain", "succeeded")])])
    step(1)
    h.coordinator.process_batch([h.phase("web_3", failing, [("10-check", "failed")])])
    step(241)
    h.coordinator.tick()
    decisions = {(r.EventId, r.Rule, r.Outcome) for r in h.rows("Decision")}
    assert (freeze, "short-freeze", "approve") in decisions
    assert (reboot, "everything-else-waits", "wait") in decisions
    assert (first, "terminate-after-prepare-hooks", "approve") in decisions
    assert (second, "terminate-after-prepare-hooks", "approve") in decisions
    assert (held, "terminate-after-prepare-hooks", "wait") in decisions  # drained, held by web_3's delete
    assert (held, "terminate-after-prepare-hooks", "approve") in decisions  # released at web_3's deadline
    assert (failing, "terminate-after-prepare-hooks", "approve") in decisions  # at the deadline, by the timer
    path = tmp_path / "history.sqlite"
    store = SqliteHistory(path)
    store.write(h.history.rows)
    store.close()
    return path


def policy_with(old: str, new: str, tmp_path: Path, name: str) -> Path:
    text = DEFAULT_POLICY_PATH.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


def test_the_recorded_policy_replays_with_no_difference(recorded, capsys):
    code, out, _ = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", recorded)
    assert code == 0
    assert "6 events" in out
    assert ": 0 would differ" in out
    assert "not reconstructed from a history (8 limits): python -m ops.policy simulate --help" in out
    assert "health-gate results" not in out, "the limits are listed by --help, not repeated by every run"
    result = replay(load_policy(DEFAULT_POLICY_PATH), read_history(recorded).rows)
    decisions = len([r for r in read_history(recorded).rows if r.RecordType == "Decision"])
    assert result.compared >= decisions >= 7


def test_the_replay_follows_the_rows_times_not_the_order_batches_wrote_them(recorded, tmp_path, capsys):
    """Each batch stamps its rows with the time it began and writes them last: of two batches side by side, the one
    that decided first may write after the other (seen in the fleet demo's deletes). Written in the reverse order
    of their batches, the same rows replay alike."""
    rows = read_history(recorded).rows
    batches: dict[Any, list[HistoryRow]] = {}
    for row in rows:
        batches.setdefault(row.TimeGenerated, []).append(row)
    assert len(batches) > 5
    shuffled = tmp_path / "written-out-of-order.sqlite"
    store = SqliteHistory(shuffled)
    store.write([row for batch in reversed(batches.values()) for row in batch])
    store.close()
    assert [r.model_dump() for r in read_history(shuffled).rows] == [r.model_dump() for r in rows]
    code, out, _ = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", shuffled)
    assert code == 0, out
    assert ": 0 would differ" in out


def test_a_changed_policy_shows_each_decision_that_would_differ(recorded, tmp_path, capsys):
    code, out, _ = run(capsys, "simulate", "--policy", EXAMPLE, "--history", recorded, "--json")
    assert code == 1
    objects = [json.loads(line) for line in out.splitlines()]
    differences, summary = objects[:-1], objects[-1]["summary"]
    assert summary["differences"] == 1 == len(differences)
    (difference,) = differences
    assert difference["eventType"] == "Freeze"
    assert difference["resources"] == ["web_0"]
    assert (difference["recorded"]["rule"], difference["recorded"]["verdict"]) == ("short-freeze", "approve")
    assert (difference["simulated"]["rule"], difference["simulated"]["verdict"]) == ("short-freeze-waits", "wait")
    assert difference["recorded"]["at"] == difference["at"] == DOC_NOW.isoformat()
    # A longer hook deadline: the timer's approval at 240 s would have waited (until 10 minutes).
    longer = policy_with("deadlineSeconds: 240", "deadlineSeconds: 600", tmp_path, "longer.yaml")
    result = replay(load_policy(longer), read_history(recorded).rows)
    # web_0's delete, released in the same tick, is not a difference: web_3's was approved in the history, and a
    # different verdict is not played forward (replay.LIMITS).
    (difference,) = result.differences
    assert (difference.resources, difference.recorded.verdict, difference.simulated.verdict) == (
        ("web_3",),
        "approve",
        "wait",
    )
    assert difference.at == DOC_NOW + timedelta(seconds=247)
    assert "waiting for prepare hooks until" in difference.simulated.reason
    # Reboots approved at once: the reboot is the only difference (the deletes are decided first, by their rule).
    eager = policy_with(
        "    match: {}\n    action: wait-for-person", "    match: {}\n    action: approve-now", tmp_path, "eager.yaml"
    )
    result = replay(load_policy(eager), read_history(recorded).rows)
    assert [(d.eventType, d.simulated.verdict, d.simulated.rule) for d in result.differences] == [
        ("Reboot", "approve", "everything-else-waits")
    ]


def test_since_and_until_bound_the_decisions_replayed(recorded, capsys):
    start = (DOC_NOW + timedelta(seconds=1)).isoformat()
    code, out, _ = run(capsys, "simulate", "--policy", EXAMPLE, "--history", recorded, "--since", start)
    assert code == 0
    assert ": 0 would differ" in out
    code, out, _ = run(capsys, "simulate", "--policy", EXAMPLE, "--history", recorded, "--until", start)
    assert code == 1
    assert ": 1 would differ" in out
    code, _, err = run(capsys, "simulate", "--policy", EXAMPLE, "--history", recorded, "--until", "yesterday")
    assert code == 2
    assert "--until 'yesterday'" in err


def sqlite_rows(path: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        table = history_schema()["table"]
        return [dict(r) for r in db.execute(f'SELECT * FROM "{table}" ORDER BY rowid')]
    finally:
        db.close()


def az_json(rows: list[HistoryRow]) -> list[dict[str, Any]]:
    """As `az monitor log-analytics query -o json` prints them: every value a string, TableName added, shuffled
    (a query result has no write order)."""
    shaped = []
    for row in reversed(rows):
        item = {k: (json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in row.to_log().items()}
        shaped.append({**item, "TableName": "PrimaryResult", "TenantId": "t"})
    return shaped


def portal_csv(rows: list[HistoryRow], path: Path) -> None:
    """As the portal's "Export to CSV (all columns)": "[UTC]" datetime headers, "M/D/YYYY, h:mm:ss.fff AM" times."""
    types = column_types()
    names = ["TenantId", *types, "Type"]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f"{n} [UTC]" if types.get(n) == "datetime" else n for n in names])
        for row in rows:
            data = row.model_dump()
            cells = []
            for name in names:
                value = data.get(name)
                if value is None:
                    cells.append("")
                elif types.get(name) == "datetime":
                    at = value.astimezone(UTC)
                    cells.append(
                        f"{at.month}/{at.day}/{at.year}, {at.strftime('%I:%M:%S')}.{at.microsecond // 1000:03d} "
                        f"{at.strftime('%p')}"
                    )
                elif isinstance(value, (list, dict)):
                    cells.append(json.dumps(value))
                else:
                    cells.append(str(value).lower() if isinstance(value, bool) else str(value))
            writer.writerow(cells)


def outcome(path: Path, policy: Path) -> list[tuple[str, str, str, str, str]]:
    result = replay(load_policy(policy), read_history(path).rows)
    assert not result.failed
    return [
        (d.eventId, d.recorded.rule, d.recorded.verdict, d.simulated.rule, d.simulated.verdict)
        for d in result.differences
    ] + [("compared", str(result.compared), str(result.events), "", "")]


def test_json_and_csv_exports_read_as_the_sqlite_history(recorded, tmp_path):
    rows = read_history(recorded).rows
    exported = tmp_path / "export.json"
    exported.write_text(json.dumps(az_json(rows)))
    api = tmp_path / "api.json"
    names = list(column_types())
    api.write_text(
        json.dumps(
            {
                "tables": [
                    {
                        "name": "PrimaryResult",
                        "columns": [{"name": n} for n in names],
                        "rows": [[sqlite_rows(recorded)[i][n] for n in names] for i in range(len(rows))],
                    }
                ]
            }
        )
    )
    portal = tmp_path / "export.csv"
    portal_csv(rows, portal)
    longer = policy_with("deadlineSeconds: 240", "deadlineSeconds: 600", tmp_path, "longer.yaml")
    for policy in (DEFAULT_POLICY_PATH, EXAMPLE, longer):
        expected = outcome(recorded, policy)
        for path in (exported, api, portal):
            assert outcome(path, policy) == expected, (path.name, policy.name)
    assert len(outcome(recorded, EXAMPLE)) == 2  # one difference, and the counts
    for path, kind in ((exported, "json"), (api, "json"), (portal, "csv")):
        assert read_history(path).kind == kind
        assert len(read_history(path).rows) == len(rows)


def test_bad_history_inputs_are_named(tmp_path, recorded, capsys):
    code, _, err = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", tmp_path / "none.sqlite")
    assert code == 2
    assert "none.sqlite: no such file" in err
    odd = tmp_path / "odd.json"
    odd.write_text(
        json.dumps([{"TimeGenerated": DOC_NOW.isoformat(), "RecordType": "Decision", "EventId": "E", "Colour": "blue"}])
    )
    code, _, err = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", odd)
    assert code == 2
    assert "unknown columns Colour" in err
    missing = tmp_path / "missing.csv"
    missing.write_text("TimeGenerated,EventId\n2026-01-05T10:00:00Z,E\n")
    code, _, err = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", missing)
    assert code == 2
    assert "required columns missing: RecordType" in err
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    code, _, err = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", text)
    assert code == 2
    assert "not a SQLite database, JSON or CSV export" in err


def test_malformed_rows_are_set_aside_and_counted_and_the_rest_replayed(recorded, tmp_path, capsys):
    rows = az_json(read_history(recorded).rows)
    rows[3]["TimeGenerated"] = "not a time"
    rows[5]["DurationInSeconds"] = "five"
    rows[7]["Resources"] = "[unclosed"
    rows.append("a string, not a row")  # type: ignore[arg-type]
    path = tmp_path / "export.json"
    path.write_text(json.dumps(rows))
    code, out, _ = run(capsys, "simulate", "--policy", EXAMPLE, "--history", path)
    assert code == 1
    assert ": 1 would differ" in out
    aside = [line for line in out.splitlines() if line.startswith("set aside:")]
    assert len(aside) == 4
    assert "row 4: TimeGenerated: not a time: 'not a time'" in aside[0]
    assert "row 6: DurationInSeconds" in aside[1]
    assert "row 8: Resources: not JSON" in aside[2]
    assert "row " + str(len(rows)) + ": not an object" in aside[3]
    code, out, _ = run(capsys, "simulate", "--policy", EXAMPLE, "--history", path, "--json")
    assert json.loads(out.splitlines()[-1])["summary"]["setAside"] == 4


def test_a_policy_used_on_a_history_without_rows_finds_nothing(tmp_path, capsys):
    empty = tmp_path / "empty.sqlite"
    SqliteHistory(empty).close()
    code, out, _ = run(capsys, "simulate", "--policy", DEFAULT_POLICY_PATH, "--history", empty)
    assert code == 0
    assert "0 events, 0 decision points" in out


def test_parse_policy_text_used_by_the_tests_is_valid():
    assert parse_policy(EXAMPLE.read_text()).rules[2].name == "short-freeze-waits"


# --- the fleet controls in the policy tools ----------------------------------------------------------------------

GATED = """version: 1
gates:
  app-health:
    http: {url: "http://127.0.0.1:9/health"}
rules:
  - name: manual-by-tag
    match: {tags: {maintenance: manual}}
    action: wait-for-person
  - name: freeze-while-healthy
    match: {eventType: [Freeze]}
    action: approve-now
    gates: [app-health]
  - name: rest
    match: {}
    action: wait-for-person
"""


def gated_case(tmp_path: Path, *, gates: str, vms: str = "[{name: web_0}]", expect: str) -> tuple[Path, Path]:
    policy = tmp_path / "gated.yaml"
    policy.write_text(GATED)
    path = tmp_path / "gated.tests.yaml"
    path.write_text(
        "cases:\n  - name: freeze\n    at: 2026-01-05T10:00:00Z\n"
        "    event: {EventType: Freeze, DurationInSeconds: 5, Resources: [web_0]}\n"
        f"    vms: {vms}\n    gates: {gates}\n    expect: {expect}\n"
    )
    return policy, path


def test_a_case_gives_the_health_gates_state_and_a_gate_left_out_holds(tmp_path, capsys):
    policy, path = gated_case(
        tmp_path, gates="{app-health: passing}", expect="{verdict: approve, rule: freeze-while-healthy}"
    )
    assert run(capsys, "test", policy, path)[0] == 0
    policy, path = gated_case(
        tmp_path,
        gates="{app-health: failing}",
        expect="{verdict: wait, rule: freeze-while-healthy, reason: app-health}",
    )
    assert run(capsys, "test", policy, path)[0] == 0
    # Unknown (not given) holds, as a gate the coordinator could not read does.
    policy, path = gated_case(tmp_path, gates="{}", expect="{verdict: wait, rule: freeze-while-healthy}")
    assert run(capsys, "test", policy, path)[0] == 0
    policy, path = gated_case(tmp_path, gates="{no-such-gate: passing}", expect="{verdict: wait, rule: rest}")
    code, out, _ = run(capsys, "test", policy, path)
    assert code == 2
    assert "no-such-gate" in out
    assert "the policy defines no such gate" in out


def test_a_case_vms_tags_reach_the_rules(tmp_path, capsys):
    policy, path = gated_case(
        tmp_path,
        gates="{app-health: passing}",
        vms="[{name: web_0, tags: {maintenance: manual}}]",
        expect="{verdict: wait, rule: manual-by-tag}",
    )
    code, out, _ = run(capsys, "test", policy, path)
    assert code == 0, out


def test_simulate_takes_every_gate_in_the_state_given(recorded, tmp_path, capsys):
    gated = policy_with(
        "      durationSeconds: {min: 0, max: 8}\n    action: approve-now",
        "      durationSeconds: {min: 0, max: 8}\n    action: approve-now\n    gates: [app-health]",
        tmp_path,
        "gated.yaml",
    )
    gated.write_text('gates:\n  app-health:\n    http: {url: "http://127.0.0.1:9/health"}\n' + gated.read_text())
    code, out, _ = run(capsys, "simulate", "--policy", gated, "--history", recorded)
    assert code == 0, out  # gates assumed passing: the recorded approvals stand
    code, out, _ = run(capsys, "simulate", "--policy", gated, "--history", recorded, "--gates", "failing", "--json")
    assert code == 1
    (difference,) = [json.loads(line) for line in out.splitlines()][:-1]
    assert difference["eventType"] == "Freeze"
    assert (difference["simulated"]["rule"], difference["simulated"]["verdict"]) == ("short-freeze", "wait")
    assert "app-health" in difference["simulated"]["reason"]


def test_the_rate_and_sequence_cases_pass_and_a_changed_rate_fails_them(capsys, tmp_path):
    """What-if covers rate and sequence budgets: the cases give their state (``fleet.paced``)."""
    policies = Path(__file__).resolve().parents[2] / "emulators" / "scenarios" / "policies"
    code, out, _ = run(capsys, "test", policies / "rate-and-zones.yaml")
    assert (code, out.splitlines()[-1]) == (0, "5 cases: 5 passed, 0 failed, 0 errors")
    looser = tmp_path / "looser.yaml"
    looser.write_text((policies / "rate-and-zones.yaml").read_text().replace("maxApprovals: 2", "maxApprovals: 3"))
    code, out, _ = run(capsys, "test", looser, policies / "rate-and-zones.tests.yaml")
    assert code == 1
    assert "FAIL" in out
    assert "a third Freeze in the hour waits" in next(line for line in out.splitlines() if line.startswith("FAIL"))
