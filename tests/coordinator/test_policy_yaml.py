"""A policy cannot be ambiguous: a key given twice in one mapping is an error naming the line, never a silent
"last one wins" (plain YAML's behaviour)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, PolicyError, load_policy, parse_policy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The rule a reader sees first approves; YAML would silently keep the second action.
        (
            "rules:\n  - name: short\n    action: approve-now\n    match: {eventType: [Freeze]}\n"
            "    action: never-approve\n",
            "p.yaml:5: duplicate key 'action' (first on line 3)",
        ),
        (
            "dryRun: false\nrules:\n  - {name: a, action: approve-now}\ndryRun: true\n",
            "p.yaml:4: duplicate key 'dryRun' (first on line 1)",
        ),
        (
            "rules:\n  - name: a\n    action: wait-for-person\n    match:\n      eventType: [Reboot]\n"
            "      eventType: [Freeze]\n",
            "p.yaml:6: duplicate key 'eventType' (first on line 5)",
        ),
        ("rules:\n  - {name: a, action: approve-now, name: b}\n", "p.yaml:2: duplicate key 'name'"),
    ],
)
def test_a_duplicate_key_is_an_error_naming_its_line(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, source="p.yaml")
    assert expected in str(caught.value)


def test_the_same_key_in_different_mappings_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "rules:\n  - {name: a, action: approve-now, match: {eventType: [Freeze]}}\n"
        "  - {name: b, action: wait-for-person, match: {eventType: [Reboot]}}\n",
        encoding="utf-8",
    )
    assert [rule.name for rule in load_policy(path).rules] == ["a", "b"]
    assert load_policy(DEFAULT_POLICY_PATH).rules
