"""``python -m benchmarks``'s own rules: a run that is not what it claims fails naming why, every figure the
README shows has one meaning and a producer, and the README's figures table is the results file's."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import benchmarks.__main__ as benchmarks_main
import benchmarks.results as results_module
from benchmarks.__main__ import BenchmarkFailed, ratios, run, run_once
from benchmarks.catalog import BENCHES, RATIOS, Bench
from benchmarks.figures import FIGURES
from benchmarks.results import README, RESULTS, readme_with_table, record, table
from benchmarks.wave_budgets import BUDGETS

ROOT = Path(__file__).resolve().parents[2]


def fake(mode: str) -> Bench:
    return Bench("fake", "tests.benchmarks.fake_bench", (mode,), (mode,), 1, {"seconds": "fake_seconds"}, 60)


def test_a_valid_run_gives_its_figures() -> None:
    assert run_once(fake("valid"), quick=True)["seconds"] == 1.5
    output = run([fake("valid")], quick=True, runs=None)
    assert (output["fake_seconds"], output["errors"]) == (1.5, {})


def test_a_full_only_benchmark_runs_in_full_runs_and_not_in_quick_ones() -> None:
    placing = dataclasses.replace(fake("valid"), name="placing", full_only=True, headline={})
    assert set(run([fake("valid"), placing], quick=True, runs=None)["details"]) == {"fake"}
    assert set(run([fake("valid"), placing], quick=False, runs=1)["details"]) == {"fake", "placing"}


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("invalid", "its run is not what it measures: accepted 0 of 1000 envelopes"),
        ("silent", "exited 0: no JSON"),
        ("crash", "the fake benchmark crashed as asked"),
        ("no-verdict", "says nothing of its run's validity"),
    ],
)
def test_a_run_that_is_not_what_it_claims_fails_naming_why(mode: str, says: str) -> None:
    with pytest.raises(BenchmarkFailed, match=says):
        run_once(fake(mode), quick=True)
    output = run([fake(mode)], quick=True, runs=None)
    assert says in output["errors"]["fake"]
    assert "fake_seconds" not in output


def test_a_benchmark_whose_later_round_fails_records_nothing(tmp_path: Path) -> None:
    """Its valid first round is not its figure: the benchmark failed, and a median of fewer rounds than asked would
    be recorded as if whole."""
    bench = Bench("fake", "tests.benchmarks.fake_bench", (f"valid-then-invalid:{tmp_path / 'seen'}",), ("valid",), 2,
                  {"seconds": "fake_seconds"}, 60)  # fmt: skip
    output = run([bench], quick=False, runs=None)
    assert "fake" in output["errors"]
    assert "fake" not in output["details"]
    assert "fake_seconds" not in output


def test_an_invalid_run_keeps_its_output_and_files_and_a_valid_one_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(benchmarks_main, "KEPT", ROOT / ".local" / "test-kept" / tmp_path.name)
    kept = benchmarks_main.KEPT
    try:
        run_once(fake("valid"), quick=True)
        assert not kept.exists() or not any(kept.iterdir())
        with pytest.raises(BenchmarkFailed, match=r"its output and files: \.local/test-kept/") as failed:
            run_once(fake("invalid"), quick=True)
        folder = ROOT / str(failed.value).rsplit("its output and files: ", 1)[1].rstrip(")")
        assert "runs invalid" in (folder / "stderr").read_text()
        assert '"problems"' in (folder / "stdout").read_text()
        assert (folder / "work" / "stack.log").read_text() == "the fake benchmark's invalid run"
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_every_figure_has_one_producer_and_every_ratio_names_benchmarks_that_exist() -> None:
    names = {b.name for b in BENCHES}
    produced = {template.format(vms="10k") for b in BENCHES for template in b.headline.values()}
    produced |= {template.format(vms="100k") for b in BENCHES for template in b.headline.values()}
    produced |= {r.key for r in RATIOS}
    keys = [f.key for f in FIGURES]
    assert len(keys) == len(set(keys))
    assert set(keys) <= produced, set(keys) - produced
    for ratio in RATIOS:
        paired = [figure for under in ratio.paired for figure in under]
        assert {name for name, _ in (ratio.numerator, *ratio.denominator, *ratio.worst_of, *paired)} <= names, ratio.key
        assert not ratio.paired or len(ratio.paired) == 1 + len(ratio.worst_of), ratio.key
        assert ratio.meaning


def test_a_ratio_is_the_median_of_its_rounds_and_says_whether_it_met_its_target() -> None:
    runs: dict[str, list[dict[str, Any]]] = {
        "wave": [{"wave_seconds": 10.0}, {"wave_seconds": 10.0}, {"wave_seconds": 10.0}],
        "wave_cold": [{"wave_seconds": 12.0}, {"wave_seconds": 20.0}, {"wave_seconds": 14.0}],
    }
    cold = ratios(runs)["wave_10k_cold_over_warm"]
    assert (cold["value"], cold["rounds"], cold["met"]) == (1.4, [1.2, 2.0, 1.4], False)


BUDGET_WAVES = [f"wave_{kind.replace('-', '_')}" for kind in BUDGETS]


def test_the_adjacent_budget_ratio_takes_each_kind_over_the_default_waves_just_before_and_after_it() -> None:
    # One round in which the machine slowed down: the default wave took 10 s before the first kind and 14 s by the
    # last; each kind took 1.1x the default waves beside it, except zone (1.3x the 11 s and 13 s beside it).
    runs: dict[str, list[dict[str, Any]]] = {"wave": [{"wave_seconds": 10.0}]}
    for index, name in enumerate(BUDGET_WAVES):
        before = runs["wave" if index == 0 else f"wave_after_{BUDGET_WAVES[index - 1].removeprefix('wave_')}"]
        after = 10.0 + 0.5 * (index + 1)
        runs[name] = [{"wave_seconds": 1.1 * (before[0]["wave_seconds"] + after) / 2}]
        runs[f"wave_after_{name.removeprefix('wave_')}"] = [{"wave_seconds": after}]
    runs["wave_after_budget_percent"] = [{"wave_seconds": 11.0}]
    runs["wave_budget_zone"] = [{"wave_seconds": 1.3 * 12.0}]
    runs["wave_after_budget_zone"] = [{"wave_seconds": 13.0}]
    adjacent = ratios(runs)["wave_10k_budget_over_adjacent_default"]
    assert (adjacent["value"], adjacent["met"]) == (1.3, False)
    # The same round against the one default wave before the kinds: the drift lands on the later kinds.
    assert ratios(runs)["wave_10k_budget_over_default"]["value"] == round(
        max(runs[n][0]["wave_seconds"] for n in BUDGET_WAVES) / 10.0, 3
    )
    # A default wave missing beside one kind: no quotient for the round.
    del runs["wave_after_budget_rate"]
    assert "wave_10k_budget_over_adjacent_default" not in ratios(runs)


def test_a_record_keeps_each_figure_with_its_target_and_where_it_was_measured(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n" + table({}) + "\n\nafter\n", encoding="utf-8")
    results = tmp_path / "results.json"
    output = {
        "wave_10k_seconds": 12.5,
        "approval_ms_p99": 4.0,
        "ratios": {"wave_10k_cold_over_warm": {"value": 1.1, "target": 1.3, "met": True, "rounds": [1.1]}},
        "wave_10k_cold_over_warm": 1.1,
        "details": {"wave": {"wave_seconds": 12.5}},
        "errors": {},
        "seconds": 3.0,
    }
    record(output, argv=["--only", "wave"], path=results, readme=readme)
    written = json.loads(results.read_text(encoding="utf-8"))
    wave = written["figures"]["wave_10k_seconds"]
    assert (wave["value"], wave["target"], wave["met"]) == (12.5, "< 10", False)
    assert wave["commit"] == written["commit"] != "unknown"
    assert written["figures"]["approval_ms_p99"]["met"] is True
    assert written["figures"]["wave_10k_cold_over_warm"]["rounds"] == [1.1]
    text = readme.read_text(encoding="utf-8")
    assert "| 12.5 s | < 10 s | **missed** |" in text
    assert text.endswith("\n\nafter\n")
    # A later run of other benchmarks keeps these figures, each with where it was measured.
    record({"spool_replay_per_s": 5000.0, "details": {}, "errors": {}}, argv=[], path=results, readme=readme)
    again = json.loads(results.read_text(encoding="utf-8"))
    assert again["figures"]["wave_10k_seconds"] == wave
    assert len(again["runs"]) == 2


def test_a_readme_without_the_table_s_place_is_refused_saying_where_it_goes() -> None:
    with pytest.raises(ValueError, match="figures table"):
        readme_with_table("# no table here\n", {})


def test_the_readme_s_figures_are_the_results_file_s_and_name_a_commit_of_this_history() -> None:
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    assert readme_with_table(README.read_text(encoding="utf-8"), results) == README.read_text(encoding="utf-8"), (
        "README.md's figures table is not benchmarks/results.json's: run .venv/bin/python -m benchmarks.results"
    )
    commits = {entry["commit"] for entry in results["figures"].values()}
    assert results["figures"], "benchmarks/results.json records no figure"
    if (ROOT / ".git").exists():
        for commit in commits:
            known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, check=False)
            assert known.returncode == 0, f"benchmarks/results.json names commit {commit}, not in this history"


def test_a_record_is_dirty_only_for_changes_it_did_not_write_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README and the results file are what a record writes: a second record in the same tree is still clean."""
    (tmp_path / "benchmarks").mkdir()
    for name in ("README.md", "benchmarks/results.json", "code.py"):
        (tmp_path / name).write_text("a\n", encoding="utf-8")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], cwd=tmp_path, check=True)
    monkeypatch.setattr(results_module, "ROOT", tmp_path)
    (tmp_path / "README.md").write_text("b\n", encoding="utf-8")
    (tmp_path / "benchmarks/results.json").write_text("b\n", encoding="utf-8")
    assert results_module.where_measured([])["dirty"] is False
    (tmp_path / "code.py").write_text("b\n", encoding="utf-8")
    assert results_module.where_measured([])["dirty"] is True
