"""python -m ops.policy and escalation ladders (policy ``escalate``): check names the line of a bad ladder; a test
case may say which steps are reached (``expect.escalation``), and the output shows them; simulate replays each
event at its candidate ladder's step times too, so an approve step shows where the recorded policy waited, and reads
back the steps a recorded history took (Decision rows' Details.escalation) without a difference of its own."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy, parse_policy
from coordinator.domain.rows import HistoryRow
from ops.policy.__main__ import main
from ops.policy.exports import read_history
from ops.policy.instants import Positions
from ops.policy.replay import LIMITS, replay
from tests.coordinator.test_escalation import LADDER, NOT_BEFORE, build, tick_at
from tests.coordinator.test_policy_tool import az_json

EXAMPLE = DEFAULT_POLICY_PATH.parent / "examples" / "escalate-reboots.yaml"
WAITS = "    match: {}\n    action: wait-for-person\n"
# The default policy, except that what waits for a person climbs a ladder: told 600 s before NotBefore, approved 120 s.
CLIMBS = DEFAULT_POLICY_PATH.read_text().replace(
    WAITS,
    WAITS
    + "    escalate:\n"
    + "      - {beforeNotBeforeSeconds: 600, do: notify, owner: sre-oncall}\n"
    + "      - {beforeNotBeforeSeconds: 120, do: approve}\n",
)
T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
BEFORE = T0 + timedelta(minutes=15)  # the reboot's NotBefore; the approve step's time is 10:13:00
EVENT = "E-REBOOT"


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- check -------------------------------------------------------------------------------------------------------


def test_check_names_the_line_of_each_bad_ladder(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\n"
        "rules:\n"
        "  - name: reboots\n"  # 3
        "    match: {eventType: [Reboot]}\n"
        "    action: wait-for-person\n"
        "    escalate:\n"
        "      - {beforeNotBeforeSeconds: 600, do: notify}\n"  # 7: no one to tell
        "      - beforeNotBeforeSeconds: 30\n"  # 8: too near NotBefore
        "        do: approve\n"
        "      - {beforeNotBeforeSeconds: 90, do: shout}\n"  # 10: no such step
        "  - name: out-of-order\n"  # 11: the rule's own checks name the rule's line
        "    action: wait-for-person\n"
        "    escalate:\n"
        "      - {beforeNotBeforeSeconds: 120, do: notify, owner: a}\n"
        "      - {beforeNotBeforeSeconds: 600, do: notify, owner: b}\n"
        "  - name: never\n"  # 16
        "    action: never-approve\n"
        "    escalate: [{beforeNotBeforeSeconds: 120, do: hold}]\n"
    )
    code, out, err = run(capsys, "check", bad)
    assert (code, out) == (2, "")
    assert f"{bad}:7: rules.0.escalate.0: Value error, a 'notify' step needs 'owner' or 'ownerTag'" in err
    assert f"{bad}:8: rules.0.escalate.1.beforeNotBeforeSeconds: Input should be greater than or equal to 60" in err
    assert f"{bad}:10: rules.0.escalate.2.do: Input should be 'notify', 'approve', 'force' or 'hold'" in err
    assert f"{bad}:11: rules.1: Value error, escalate: steps must come in order of time left to NotBefore" in err
    assert f"{bad}:16: rules.2: Value error, 'never-approve' lets NotBefore run out" in err


def test_check_accepts_the_ladder_example(capsys):
    code, out, _ = run(capsys, "check", EXAMPLE)
    assert code == 0
    assert "valid, 5 rules" in out
    assert "platform-reboots-escalate" in out


# --- test --------------------------------------------------------------------------------------------------------


def test_the_ladder_example_passes_its_cases_and_shows_the_steps_reached(capsys):
    code, out, _ = run(capsys, "test", EXAMPLE)
    lines = out.splitlines()
    assert code == 0, out
    assert lines[-1] == f"{len(lines) - 1} cases: {len(lines) - 1} passed, 0 failed, 0 errors"
    assert any(
        line.endswith(
            "120 s before NotBefore it is approved anyway: approve by platform-reboots-escalate, escalation [1, 2]"
        )
        for line in lines
    )
    cases = (EXAMPLE.parent / "escalate-reboots.tests.yaml").read_text()
    for covered in ("escalation: []", "escalation: [1]", "escalation: [1, 2]", "authoritative: true", "too near"):
        assert covered in cases


def test_every_shipped_policy_with_cases_passes_them(capsys):
    root = Path(__file__).resolve().parents[2]
    shipped = [*DEFAULT_POLICY_PATH.parent.rglob("*.yaml"), *root.glob("emulators/scenarios/policies/*.yaml")]
    with_cases = [
        p for p in shipped if not p.name.endswith(".tests.yaml") and p.with_name(p.stem + ".tests.yaml").is_file()
    ]
    assert len(with_cases) >= 3
    for policy in with_cases:
        code, out, _ = run(capsys, "test", policy)
        assert code == 0, out


CASE = """cases:
  - name: the approve step
    at: 2026-01-05T10:13:00Z
    event: {{EventType: Reboot, NotBefore: 2026-01-05T10:15:00Z, Resources: [db-0]}}
    expect: {expect}
"""


def case_file(tmp_path: Path, expect: str) -> Path:
    path = tmp_path / "cases.yaml"
    path.write_text(CASE.format(expect=expect))
    return path


def test_a_case_fails_when_the_steps_reached_differ_and_says_both(tmp_path, capsys):
    path = case_file(tmp_path, "{verdict: approve, rule: platform-reboots-escalate, escalation: [1]}")
    code, out, _ = run(capsys, "test", EXAMPLE, path)
    assert code == 1
    (line,) = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert (
        "expected approve by platform-reboots-escalate, escalation [1], "
        "got approve by platform-reboots-escalate, escalation [1, 2] (" in line
    )
    # Left out, the steps are not checked: the same case passes, and shows the steps reached.
    path = case_file(tmp_path, "{verdict: approve, rule: platform-reboots-escalate}")
    code, out, _ = run(capsys, "test", EXAMPLE, path)
    assert code == 0
    assert out.splitlines()[0].endswith(": approve by platform-reboots-escalate, escalation [1, 2]")
    # None reached and none named: the line is as it always was.
    code, out, _ = run(
        capsys, "test", DEFAULT_POLICY_PATH, case_file(tmp_path, "{verdict: wait, rule: everything-else-waits}")
    )
    assert code == 0
    assert out.splitlines()[0].endswith(": wait by everything-else-waits")


def test_json_gives_each_step_reached_as_a_decision_row_lists_it(tmp_path, capsys):
    path = case_file(tmp_path, "{verdict: approve, rule: platform-reboots-escalate, escalation: [1, 2]}")
    code, out, _ = run(capsys, "test", EXAMPLE, path, "--json")
    assert code == 0
    case = json.loads(out.splitlines()[0])
    assert case["expected"]["escalation"] == [1, 2]
    assert case["got"]["escalation"] == [
        {
            "step": 1,
            "of": 2,
            "do": "notify",
            "beforeNotBeforeSeconds": 600,
            "at": "2026-01-05T10:05:00+00:00",
            "owners": ["sre-oncall"],
        },
        {
            "step": 2,
            "of": 2,
            "do": "approve",
            "beforeNotBeforeSeconds": 120,
            "at": "2026-01-05T10:13:00+00:00",
            "owners": [],
        },
    ]


@pytest.mark.parametrize("steps", ["[0]", "[first]", "2"])
def test_a_bad_expected_ladder_names_the_case_line(tmp_path, capsys, steps):
    path = case_file(tmp_path, f"{{verdict: approve, rule: platform-reboots-escalate, escalation: {steps}}}")
    code, _, err = run(capsys, "test", EXAMPLE, path)
    assert code == 2
    assert f"{path}:2: cases.0.expect.escalation" in err


# --- simulate ----------------------------------------------------------------------------------------------------

FACTS: dict[str, Any] = {
    "EventId": EVENT,
    "EventType": "Reboot",
    "EventSource": "Platform",
    "DurationInSeconds": -1,
    "NotBefore": BEFORE,
    "Resources": ["db-0"],
}


def seen(at: datetime, status: str = "Scheduled") -> HistoryRow:
    return HistoryRow(
        TimeGenerated=at, RecordType="Observation", VmName="db-0", EventStatus=status, State=status, **FACTS
    )


def waited(at: datetime) -> HistoryRow:
    return HistoryRow(
        TimeGenerated=at, RecordType="Decision", Rule="everything-else-waits", Action="wait-for-person",
        Outcome="wait", Reason="rule 'everything-else-waits' waits for a person", DecisionId="d-1",
        Actor="rule:everything-else-waits", State="Scheduled", **FACTS,
    )  # fmt: skip


def waiting_history(*later: HistoryRow) -> list[HistoryRow]:
    """A platform reboot the default policy left waiting for a person: seen and decided at 10:00, NotBefore 10:15,
    no row while it waited (the timer's re-evaluations changed nothing), then ``later``."""
    return [seen(T0), waited(T0), *later]


def test_a_candidate_ladder_approves_at_its_step_time_where_the_recorded_policy_waited(tmp_path):
    rows = waiting_history(seen(BEFORE + timedelta(seconds=5), "Started"))
    assert replay(load_policy(DEFAULT_POLICY_PATH), rows).differences == []
    result = replay(parse_policy(CLIMBS), rows)
    (difference,) = result.differences
    assert difference.at == BEFORE - timedelta(seconds=120)
    assert (difference.recorded.rule, difference.recorded.verdict, difference.recorded.at) == (
        "everything-else-waits",
        "wait",
        T0,
    )
    assert (difference.simulated.rule, difference.simulated.verdict) == ("everything-else-waits", "approve")
    assert difference.simulated.at == BEFORE - timedelta(seconds=120)
    assert difference.simulated.escalation == (1, 2)
    assert "escalation step 2 of 2 (approve, 120 s before NotBefore): approved anyway" in difference.simulated.reason
    assert result.compared == 3  # the recorded decision, and each step's time (the notify step changed no verdict)


def test_the_cli_prints_the_would_be_approval_at_the_step_time(tmp_path, capsys):
    history, policy = tmp_path / "history.json", tmp_path / "climbs.yaml"
    history.write_text(json.dumps(az_json(waiting_history())))
    policy.write_text(CLIMBS)
    code, out, _ = run(capsys, "simulate", "--policy", policy, "--history", history)
    assert code == 1
    assert out.splitlines()[:3] == [
        f"2026-01-05T10:13:00+00:00  Reboot {EVENT} (db-0)",
        "    recorded  wait by everything-else-waits at 2026-01-05T10:00:00+00:00: rule 'everything-else-waits' waits "
        "for a person",
        "    simulated approve by everything-else-waits at 2026-01-05T10:13:00+00:00: rule 'everything-else-waits' "
        "waits for a person; escalation step 2 of 2 (approve, 120 s before NotBefore): approved anyway",
    ]
    code, out, _ = run(capsys, "simulate", "--policy", EXAMPLE, "--history", history, "--json")
    differences = [json.loads(line) for line in out.splitlines()[:-1]]
    # The example's rule is not the recorded one (a difference from the first decision), and it approves at 10:13.
    assert [(d["at"], d["simulated"]["verdict"], d["simulated"]["escalation"]) for d in differences] == [
        ("2026-01-05T10:00:00+00:00", "wait", []),
        ("2026-01-05T10:13:00+00:00", "approve", [1, 2]),
    ]


def test_a_step_is_replayed_at_the_recorded_run_within_the_minute_after_its_time():
    run_at = BEFORE - timedelta(seconds=100)  # a VM's report, 20 s after the approve step's time
    (difference,) = replay(parse_policy(CLIMBS), waiting_history(seen(run_at))).differences
    assert (difference.at, difference.simulated.verdict) == (run_at, "approve")
    later = BEFORE - timedelta(seconds=50)  # a minute and more after it: the timer ticked before
    (difference,) = replay(parse_policy(CLIMBS), waiting_history(seen(later))).differences
    assert difference.at == BEFORE - timedelta(seconds=120)


def test_no_step_is_replayed_once_the_event_left_scheduled_or_outside_the_bounds():
    started = seen(BEFORE - timedelta(seconds=180), "Started")  # the platform started it before the approve step
    assert replay(parse_policy(CLIMBS), waiting_history(started)).differences == []
    completed = HistoryRow(TimeGenerated=T0 + timedelta(minutes=5), RecordType="Transition", State="Completed", **FACTS)
    assert replay(parse_policy(CLIMBS), waiting_history(completed)).differences == []
    rows = waiting_history()
    assert replay(parse_policy(CLIMBS), rows, until=BEFORE - timedelta(seconds=121)).differences == []
    # The recorded decision is before --since: still decided, so the steps its rule names after --since are replayed.
    (difference,) = replay(parse_policy(CLIMBS), rows, since=T0 + timedelta(minutes=5)).differences
    assert difference.at == BEFORE - timedelta(seconds=120)


def test_a_recorded_ladder_is_read_back_and_replays_through_its_own_policy_with_no_difference(tmp_path):
    """A history the coordinator recorded under a ladder, each step taken by a tick after its time (the approve step
    70 s after it), with a Decision row carrying Details.escalation: its own policy finds no difference, each step
    replayed at the instant the history shows it taken; a policy without the ladder finds the approval it took, with
    the steps the event had taken beside it."""
    coordinator, history, _, clock = build(LADDER, tmp_path)
    for seconds_before in (601, 590, 250, 50):
        tick_at(coordinator, clock, seconds_before)
    taken = [row.Details["escalation"] for row in history.rows if row.RecordType == "Decision" and row.Details]
    assert [[step["step"] for step in steps] for steps in taken] == [[1], [2], [3]]
    exported = tmp_path / "export.json"
    exported.write_text(json.dumps(az_json(history.rows)))
    rows = read_history(exported).rows
    own = replay(parse_policy(LADDER), rows)
    assert (own.differences, own.failed) == ([], [])
    unladdered = LADDER[: LADDER.index("    escalate:")]
    (difference,) = replay(parse_policy(unladdered), rows).differences
    assert (difference.recorded.verdict, difference.recorded.escalation) == ("approve", (1, 2, 3))
    assert (difference.simulated.verdict, difference.simulated.escalation) == ("wait", ())
    assert difference.at == NOT_BEFORE - timedelta(seconds=50)


def test_the_limits_say_what_a_ladder_replay_knows():
    assert "step times of the escalation ladder of the rule the simulated policy decides it by" in LIMITS[0]
    assert "a notify or hold step changes neither" in LIMITS[0]
    assert len(LIMITS) == 8


def test_a_step_instant_falls_after_every_row_at_or_before_it_in_any_order():
    rows = [seen(T0 + timedelta(seconds=s)) for s in (0, 10, 10, 20)]
    positions = Positions(rows)
    assert [positions.after(T0 + timedelta(seconds=s)) for s in (-1, 0, 5, 10, 30)] == [0, 1, 1, 3, 4]
    # Out of time order (a caller's own list): still after every row at or before the instant.
    assert Positions([rows[3], rows[0], rows[1]]).after(T0 + timedelta(seconds=10)) == 3
