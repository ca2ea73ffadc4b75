"""Every KQL query this project ships (infra/queries/*.kql, the workbook's panels, the alert rules') passes Microsoft's
Kusto language service, parse and semantic analysis, against the history table of coordinator/history_columns.json;
the service catches a misspelt column, a syntax error and a type error, naming file, line and column; and the workbook
and alert rules use these files. What the queries return is tested in test_kql_results.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from coordinator.adapters import telemetry
from infra import build_workbook
from tests.infra import bicep_model as bm
from tests.infra.kql_language import Analysis, analyze, analyze_one

QUERIES = sorted((bm.INFRA / "queries").glob("*.kql"))
METRIC_QUERIES = sorted(build_workbook.METRIC_QUERIES.glob("*.kql"))
ALERTS = bm.INFRA / "modules" / "alerts.bicep"
HISTORY = json.loads((bm.ROOT / "coordinator" / "history_columns.json").read_text(encoding="utf-8"))
# Every metric coordinator/adapters/telemetry.py records, by name.
INSTRUMENTS = set(telemetry.METRICS)
# A metric or attribute name in a query ("scheduled_events.forwarder." as a prefix is neither).
NAME = re.compile(r'"(scheduled_events\.[a-z_.]*[a-z_])"')
REQUIRED = {
    "events-by-type-and-scaleset.kql",
    "expired-unapproved.kql",
    "notice-vs-time-to-approve.kql",
    "hooks-failing.kql",
    "event-timeline.kql",
    "silent-forwarders.kql",
    "announced-vs-measured.kql",
    "shadow-report.kql",
    "escalations.kql",
    "repairs.kql",
    "return-to-service.kql",
}


def alert_rules() -> dict[str, dict[str, Any]]:
    """The scheduled query rules of alerts.bicep: {symbolic name: its one criterion}, each criterion's query being
    loadTextContent of a file (the rules hold no query text of their own)."""
    rules = {}
    for name, resource in bm.parse(ALERTS)["resources"].items():
        if resource["type"] == "Microsoft.Insights/scheduledQueryRules":
            (criterion,) = bm.resource_body(resource)["properties"]["criteria"]["allOf"]
            rules[name] = criterion
    return rules


def alert_query_file(criterion: dict[str, Any]) -> Path:
    loaded = bm.load_path(criterion["query"])
    assert loaded is not None, "an alert rule's query must be loadTextContent('../queries/…kql')"
    return (ALERTS.parent / loaded).resolve()


def workbook_queries() -> dict[str, str]:
    on_disk = json.loads((bm.INFRA / "workbook.json").read_text(encoding="utf-8"))
    return {f"workbook.json:{item['name']}": item["content"]["query"] for item in on_disk["items"] if item["type"] == 3}


@pytest.fixture(scope="module")
def shipped() -> dict[str, Analysis]:
    """One language-service run over every shipped query: the files, the workbook's panels, the alert rules'."""
    queries = {path.name: path.read_text(encoding="utf-8") for path in QUERIES}
    queries |= {f"metrics/{path.name}": path.read_text(encoding="utf-8") for path in METRIC_QUERIES}
    queries |= workbook_queries()
    for name, criterion in alert_rules().items():
        queries[f"alerts.bicep:{name}"] = alert_query_file(criterion).read_text(encoding="utf-8")
    return analyze(queries)


def test_the_required_queries_exist() -> None:
    assert {path.name for path in QUERIES} >= REQUIRED


@pytest.mark.parametrize("path", QUERIES, ids=lambda p: p.name)
def test_query_file_passes_the_kusto_language_service(path: Path, shipped: dict[str, Analysis]) -> None:
    analysis = shipped[path.name]
    assert analysis.problems() == []
    # Bound to the history table: a query that names no table (or another one) would fail above; this guards a
    # query whose result the binder cannot infer at all.
    assert analysis.columns, f"{path.name}: the language service inferred no result columns"


def test_workbook_and_alert_queries_pass_the_kusto_language_service(shipped: dict[str, Analysis]) -> None:
    embedded = [name for name in shipped if name.startswith(("workbook.json:", "alerts.bicep:"))]
    assert len(embedded) == len(build_workbook.PANELS) + len(build_workbook.METRIC_PANELS) + len(alert_rules())
    assert [problem for name in embedded for problem in shipped[name].problems()] == []


def test_the_service_catches_a_misspelt_column_naming_file_line_and_column() -> None:
    good = (bm.INFRA / "queries" / "hooks-failing.kql").read_text(encoding="utf-8")
    misspelt = good.replace("ScaleSetName, HookPhase", "ScaleSetName, HookPhaze")
    line = next(n for n, text in enumerate(misspelt.splitlines(), 1) if "HookPhaze" in text)
    column = misspelt.splitlines()[line - 1].index("HookPhaze") + 1
    assert analyze_one("hooks-failing.kql", misspelt).problems() == [
        f"hooks-failing.kql:{line}:{column}: error KS142 The name 'HookPhaze' does not refer to any known column, "
        "table, variable or function."
    ]


def test_the_service_reports_syntax_and_type_errors_with_their_line() -> None:
    syntax = analyze_one("s.kql", 'ScheduledEventsHistory_CL\n| where RecordType == "Hook" and\n| count')
    assert [(d.severity, d.line, d.message) for d in syntax.diagnostics] == [("error", 2, "Missing expression")]
    # A column of the wrong type: names and syntax are fine, only semantic analysis sees it.
    typed = analyze_one("t.kql", 'ScheduledEventsHistory_CL\n| extend L = datetime_diff("second", NotBefore, VmName)')
    assert [(d.line, d.message) for d in typed.diagnostics] == [(2, "A value of type datetime expected.")]


@pytest.mark.parametrize("path", METRIC_QUERIES, ids=lambda p: p.name)
def test_metric_query_passes_the_kusto_language_service(path: Path, shipped: dict[str, Analysis]) -> None:
    """The workbook's metric panels query Application Insights' AppMetrics by the names adapters/telemetry.py
    gives its instruments."""
    analysis = shipped[f"metrics/{path.name}"]
    assert analysis.problems() == []
    assert analysis.columns, f"{path.name}: the language service inferred no result columns"
    names = set(NAME.findall(path.read_text(encoding="utf-8")))
    assert names & INSTRUMENTS, f"{path.name} names no metric"
    unknown = names - INSTRUMENTS - telemetry.ATTRIBUTES
    assert not unknown, f"{path.name}: names coordinator/adapters/telemetry.py does not record: {unknown}"


def test_the_metric_names_are_checked_against_the_instruments() -> None:
    text = 'AppMetrics | where Name == "scheduled_events.decision" | extend R = Properties["scheduled_events.rule"]'
    assert set(NAME.findall(text)) - INSTRUMENTS - telemetry.ATTRIBUTES == {"scheduled_events.decision"}
    assert "scheduled_events.decisions" in INSTRUMENTS


def test_the_service_knows_the_table_as_history_columns_json_defines_it() -> None:
    kql_type = {"boolean": "bool"}
    expected = tuple((c["name"], kql_type.get(c["type"], c["type"])) for c in HISTORY["columns"])
    assert analyze_one("table", HISTORY["table"]).columns == expected
    assert analyze_one("other", "SomeOtherTable_CL | count").problems() == [
        "other:1:1: error KS204 The name 'SomeOtherTable_CL' does not refer to any known table, tabular variable or "
        "function."
    ]


def test_workbook_json_is_built_from_the_query_files() -> None:
    on_disk = json.loads((bm.INFRA / "workbook.json").read_text(encoding="utf-8"))
    assert on_disk == build_workbook.build(), (
        "infra/workbook.json is stale: run .venv/bin/python infra/build_workbook.py"
    )
    queries = list(workbook_queries().values())
    assert len(build_workbook.PANELS) == len(REQUIRED)
    assert len(queries) == len(build_workbook.PANELS) + len(build_workbook.METRIC_PANELS)
    timeline = next(q for q in queries if build_workbook.EVENT_ID_PARAMETER_LINE in q)
    assert 'let eventId = "";' not in timeline


def test_workbook_and_alerts_are_deployed_from_these_files(shipped: dict[str, Analysis]) -> None:
    workbook = bm.resource_body(bm.parse(bm.INFRA / "modules" / "workbook.bicep")["resources"]["workbook"])
    fill = workbook["properties"]["serializedData"]["function"]
    assert fill["type"] == "replace"
    assert bm.load_path(fill["parameters"]["original_string"]) == "../workbook.json"
    assert fill["parameters"]["old_string"] == build_workbook.WORKSPACE_PLACEHOLDER
    assert fill["parameters"]["new_string"] == "workspaceId"
    assert build_workbook.build()["fallbackResourceIds"] == [build_workbook.WORKSPACE_PLACEHOLDER]
    rules = alert_rules()
    assert rules, "alerts.bicep defines no scheduled query rule"
    for name, criterion in rules.items():
        assert alert_query_file(criterion).parent == bm.INFRA / "queries"
        # A rule that splits by a dimension needs the query to output that column.
        outputs = {column for column, _ in shipped[f"alerts.bicep:{name}"].columns}
        for dimension in criterion.get("dimensions", []):
            assert dimension["name"] in outputs, f"alert rule {name} splits by {dimension['name']}, not an output"


_COMPARISON = re.compile(r'\b(\w+)\s*(?:==|in)\s*(\([^)]*\)|"[^"]*")')


def _documented_values(description: str) -> set[str]:
    """The values a column's description lists ('...: A | B | C (or D).'), as loose words."""
    return set(re.findall(r"[\w-]+", description.rsplit(":", 1)[-1]))


def test_queries_compare_columns_only_with_documented_values() -> None:
    enumerated = {
        column["name"]: _documented_values(column["description"])
        for column in HISTORY["columns"]
        if column["name"] in {"RecordType", "State", "EventType", "EventSource", "EventStatus", "HookPhase"}
    }
    checked = 0
    for path in QUERIES:
        for column, literal in _COMPARISON.findall(path.read_text(encoding="utf-8")):
            if column in enumerated:
                for value in re.findall(r'"([^"]*)"', literal):
                    checked += 1
                    assert value in enumerated[column], f"{path.name}: {column} is never {value!r}"
    assert checked >= 10
