"""A policy cannot be ambiguous: a key given twice in one mapping is an error naming the line, never a silent
"last one wins" (plain YAML's behaviour). Nor can it cost every instance its recursion limit or minutes of CPU: a
document nested thousands deep or an alias bomb is refused at once, naming the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.domain.policy_file import (
    DEFAULT_POLICY_PATH,
    MAX_DEPTH,
    MAX_NODES,
    PolicyError,
    load_policy,
    parse_policy,
)


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


def alias_bomb(levels: int) -> str:
    """Ten times more values at each level: a few hundred bytes naming 10**levels values."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nrules: *a{levels - 1}\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Raised RecursionError (flow and block style).
        ("rules: " + "[" * 20_000 + "]" * 20_000 + "\n", f"p.yaml:1: nested deeper than {MAX_DEPTH} levels"),
        ("rules:\n" + "".join(" " * i + "- \n" for i in range(1, 1_000)), "p.yaml:33: nested deeper than"),
        # Parsed for more than 30 s.
        (alias_bomb(9), f"p.yaml:5: expands to more than {MAX_NODES} values (aliases included)"),
        # An alias adds the depth of what it names.
        (
            "a: &a " + "[" * 20 + "1" + "]" * 20 + "\nrules: " + "[" * 13 + "*a" + "]" * 13 + "\n",
            "p.yaml:2: nested deeper",
        ),
        # A node that holds itself (PyYAML builds it; nothing could walk it).
        ("rules: &r [{name: a, action: approve-now, more: *r}]\n", "p.yaml:1: alias *r names no node before it"),
        ("x" * (1 << 20) + "\n", "p.yaml: the policy is 1048577 characters (limit 1048576)"),
    ],
)
# A bound on the whole test, not a timing assertion: an expansion that is not refused early runs for hours.
@pytest.mark.timeout(60)
def test_a_policy_too_deep_or_too_large_once_expanded_is_refused_at_once(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, source="p.yaml")
    assert expected in str(caught.value)


def test_aliases_within_bounds_are_fine() -> None:
    text = (
        "gates: {health: {http: {url: 'https://health.example/ok'}}}\n"
        "rules:\n"
        "  - {name: a, action: approve-now, gates: &gated [health]}\n"
        "  - {name: b, action: wait-for-person, gates: *gated}\n"
    )
    assert [rule.gates for rule in parse_policy(text).rules] == [["health"], ["health"]]
