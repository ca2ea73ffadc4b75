"""``python -m forwarder run --help`` as an operator reads it: every flag says what it sets, its allowed values or
bounds, its default and its environment variable; docs/forwarder.md's table names every setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.checks import Choice
from forwarder.config import ENV_PREFIX, FIELDS, ForwarderSettings

ROOT = Path(__file__).resolve().parents[2]


def help_of(command: str) -> dict[str, str]:
    """Each flag's help text from ``python -m forwarder COMMAND --help``, on a terminal wide enough not to wrap."""
    done = subprocess.run(
        [sys.executable, "-m", "forwarder", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "1000"},
    )
    options = done.stdout.split("options:", 1)[1]
    found = {}
    for block in re.split(r"\n  (?=--)", options)[1:]:
        flags, _, text = block.partition("  ")
        found[flags.split()[0].rstrip(",")] = " ".join(text.split())
    return found


@pytest.mark.parametrize("name", FIELDS)
def test_every_run_flag_says_what_it_sets_its_values_its_default_and_its_variable(name: str) -> None:
    text = help_of("run")["--" + name.replace("_", "-")]
    info = next(f for f in ForwarderSettings.specs() if f.name == name)
    description = info.metadata["description"]
    assert description
    assert " ".join(description.split()) in text
    assert f"${ENV_PREFIX}{name.upper()}" in text
    assert ("no default" if info.default is None else f"default {info.default}") in text
    check = info.metadata["check"]
    if isinstance(check, Choice):
        assert "one of " + ", ".join(check.values) in text


def test_once_flags_have_help_too() -> None:
    text = help_of("once")
    assert "IMDS root" in text["--imds-url"]
    assert "first Scheduled Events call" in text["--imds-first-call-timeout"]


def test_the_docs_table_names_every_setting() -> None:
    table = (ROOT / "docs" / "forwarder.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `(\w+)`(?:[ /,]+`(\w+)`)?", table, flags=re.MULTILINE))
    assert {name for pair in named for name in pair if name} == set(FIELDS)
