"""contracts/wire_validators.py and wire_records.py are generated (``python -m contracts.generate``), never edited:
regenerating them gives the committed bytes, and ``--check`` names a file that is not what it would be."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from contracts import generate


def test_regenerating_gives_the_committed_bytes() -> None:
    """A field, bound or kind changed in a model without generating again, or a generated file edited by hand,
    fails here."""
    assert generate.VALIDATORS.read_bytes() == generate.validators_source().encode("utf-8")
    assert generate.RECORDS.read_bytes() == generate.records_source().encode("utf-8")


def test_check_names_a_hand_edited_file_and_generating_restores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    copies = {name: tmp_path / getattr(generate, name).name for name in ("VALIDATORS", "RECORDS")}
    for name, copy in copies.items():
        shutil.copyfile(getattr(generate, name), copy)
        monkeypatch.setattr(generate, name, copy)
    edited = copies["VALIDATORS"]
    edited.write_bytes(edited.read_bytes().replace(b"minLength", b"minLength ", 1))

    assert generate.main(["--check"]) == 1
    assert "stale: wire_validators.py;" in capsys.readouterr().err
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0
    assert edited.read_bytes() == generate.validators_source().encode("utf-8")


def test_the_generated_validators_need_nothing_but_the_standard_library() -> None:
    """The VM installs no new package for them: fastjsonschema's exception is written into the module."""
    imports = re.findall(r"^\s*(?:import|from) (\S+)", generate.VALIDATORS.read_text(encoding="utf-8"), re.M)
    assert set(imports) == {"re"}
