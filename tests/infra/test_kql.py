"""The KQL in infra/queries parses and names only columns of the history table (or its own), the column check
catches a misspelt column, and the workbook and alert rules use these files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infra import build_workbook
from tests.infra import bicep_model as bm
from tests.infra.kql_columns import KqlSyntaxError, Schema, parse, unknown_names

QUERIES = sorted((bm.INFRA / "queries").glob("*.kql"))
REQUIRED = {
    "events-by-type-and-scaleset.kql",
    "expired-unapproved.kql",
    "notice-vs-time-to-approve.kql",
    "hooks-failing.kql",
    "event-timeline.kql",
    "silent-forwarders.kql",
}


@pytest.fixture(scope="module")
def schema() -> Schema:
    return Schema.load()


def test_the_required_queries_exist() -> None:
    assert {path.name for path in QUERIES} >= REQUIRED


@pytest.mark.parametrize("path", QUERIES, ids=lambda p: p.name)
def test_query_parses_and_names_only_known_columns(path: Path, schema: Schema) -> None:
    text = path.read_text(encoding="utf-8")
    assert unknown_names(text, schema) == [], f"{path.name}: names no column of {schema.table} defines"
    assert schema.table in text


def test_column_check_catches_a_misspelt_column(schema: Schema) -> None:
    good = (bm.INFRA / "queries" / "hooks-failing.kql").read_text(encoding="utf-8")
    assert unknown_names(good, schema) == []
    misspelt = good.replace("HookPhase", "HookPhaze")
    assert unknown_names(misspelt, schema) == ["HookPhaze"]


def test_column_check_knows_names_a_query_introduces(schema: Schema) -> None:
    query = (
        f"let cutoff = 1h; {schema.table} | where TimeGenerated > ago(cutoff)"
        " | extend Lead = NotBefore - ObservedAt | summarize MeanLead = avg(Lead) by EventType"
        " | mv-expand R = pack_array(MeanLead) | project-rename Type = EventType | where isnotnull(R) and Type != ''"
    )
    assert unknown_names(query, schema) == []
    assert unknown_names(query.replace("MeanLead)", "MeanLaed)"), schema) == ["MeanLaed"]


def test_syntax_errors_are_reported_with_position() -> None:
    with pytest.raises(KqlSyntaxError, match=r"^1:\d+ "):
        parse("ScheduledEventsHistory_CL | where RecordType == 'Hook' and | count")


def test_schema_is_history_columns_json(schema: Schema) -> None:
    data = json.loads((bm.ROOT / "coordinator" / "history_columns.json").read_text(encoding="utf-8"))
    assert schema.table == data["table"] == "ScheduledEventsHistory_CL"
    assert "EventId" in schema.columns
    assert "Resources" in schema.columns


def test_workbook_json_is_built_from_the_query_files() -> None:
    on_disk = json.loads((bm.INFRA / "workbook.json").read_text(encoding="utf-8"))
    assert on_disk == build_workbook.build(), (
        "infra/workbook.json is stale: run .venv/bin/python infra/build_workbook.py"
    )
    queries = [item["content"]["query"] for item in on_disk["items"] if item["type"] == 3]
    assert len(queries) == len(build_workbook.PANELS) == len(REQUIRED)
    timeline = next(q for q in queries if build_workbook.EVENT_ID_PARAMETER_LINE in q)
    assert 'let eventId = "";' not in timeline
    parse(timeline)  # still KQL after the parameter is filled in


def test_workbook_and_alerts_are_deployed_from_these_files() -> None:
    workbook = bm.resource_body(bm.parse(bm.INFRA / "modules" / "workbook.bicep")["resources"]["workbook"])
    fill = workbook["properties"]["serializedData"]["function"]
    assert fill["type"] == "replace"
    assert bm.load_path(fill["parameters"]["original_string"]) == "../workbook.json"
    assert fill["parameters"]["old_string"] == build_workbook.WORKSPACE_PLACEHOLDER
    assert fill["parameters"]["new_string"] == "workspaceId"
    assert build_workbook.build()["fallbackResourceIds"] == [build_workbook.WORKSPACE_PLACEHOLDER]
    alerts = bm.parse(bm.INFRA / "modules" / "alerts.bicep")
    loaded = []
    for resource in alerts["resources"].values():
        if resource["type"] == "Microsoft.Insights/scheduledQueryRules":
            (criterion,) = bm.resource_body(resource)["properties"]["criteria"]["allOf"]
            loaded.append(str(bm.load_path(criterion["query"])))
    assert sorted(loaded) == [
        "../queries/alert-approval-failed.kql",
        "../queries/alert-expired-unapproved.kql",
        "../queries/silent-forwarders.kql",
    ]
    # The heartbeat alert splits by VmName, so the query must output it.
    silent = (bm.INFRA / "queries" / "silent-forwarders.kql").read_text(encoding="utf-8")
    assert re.search(r"summarize .* by VmName", silent)


_COMPARISON = re.compile(r'\b(\w+)\s*(?:==|in)\s*(\([^)]*\)|"[^"]*")')


def _documented_values(description: str) -> set[str]:
    """The values a column's description lists ('...: A | B | C (or D).'), as loose words."""
    return set(re.findall(r"[\w-]+", description.rsplit(":", 1)[-1]))


def test_queries_compare_columns_only_with_documented_values() -> None:
    columns = json.loads((bm.ROOT / "coordinator" / "history_columns.json").read_text(encoding="utf-8"))["columns"]
    enumerated = {
        column["name"]: _documented_values(column["description"])
        for column in columns
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
