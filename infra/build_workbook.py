"""Build infra/workbook.json (Azure Monitor workbook, deployed by modules/workbook.bicep) from infra/queries/*.kql (the
history) and infra/queries/metrics/*.kql (the coordinator's metrics in Application Insights' AppMetrics).

The .kql files are the one definition of the queries; this script copies them into the workbook so that the two
cannot drift (tests/infra checks that workbook.json equals what this script builds). Run after editing a query:

    .venv/bin/python infra/build_workbook.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INFRA = Path(__file__).resolve().parent
QUERIES = INFRA / "queries"
WORKBOOK = INFRA / "workbook.json"
RESOURCE_TYPE = "microsoft.operationalinsights/workspaces"
WORKSPACE_PLACEHOLDER = "__WORKSPACE_RESOURCE_ID__"

# (query file, panel title) in the order the workbook shows them; alert-*.kql feed alert rules, not panels.
PANELS: tuple[tuple[str, str], ...] = (
    ("events-by-type-and-scaleset.kql", "Events in the last 7 days by type and scale set"),
    ("expired-unapproved.kql", "Events that expired unapproved (7 days)"),
    ("notice-vs-time-to-approve.kql", "Mean notice vs mean time to approve, per type (30 days)"),
    ("hooks-failing.kql", "VMs with failing hooks (7 days)"),
    ("silent-forwarders.kql", "Silent forwarders"),
    ("announced-vs-measured.kql", "Impact: announced vs measured, per event and VM (30 days)"),
    ("shadow-report.kql", "Shadow policy: would have approved vs what happened (30 days)"),
    ("escalations.kql", "Escalation steps taken (7 days)"),
    ("repairs.kql", "Automatic repairs suspended and resumed (7 days)"),
    ("return-to-service.kql", "Return to service after an event completed, per event and VM (30 days)"),
    ("event-timeline.kql", "Timeline of one EventId (set the EventId parameter)"),
)
# The coordinator's metrics (coordinator/adapters/telemetry.py) from Application Insights, whose workspace holds them in
# AppMetrics: (file under queries/metrics/, panel title, visualization), shown after the history panels.
METRIC_QUERIES = QUERIES / "metrics"
METRIC_PANELS: tuple[tuple[str, str, str], ...] = (
    ("fleet-census.kql", "Metrics: VMs by condition (latest timer run)", "table"),
    ("forwarder-health.kql", "Metrics: forwarder health, worst first (last hour)", "table"),
    ("decisions-by-rule.kql", "Metrics: decisions by rule and verdict (7 days)", "table"),
    ("approval-latency.kql", "Metrics: detection to approval, and notice left at approval (7 days)", "table"),
    ("pipeline-problems.kql", "Metrics: refused, expired, dead letters, failed cards, age (hourly)", "timechart"),
)
# The timeline query's placeholder line, and what the workbook puts there: its EventId parameter.
EVENT_ID_LINE = 'let eventId = "";'
EVENT_ID_PARAMETER_LINE = 'let eventId = "{EventId}";'


def build() -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {
            "type": 1,
            "name": "intro",
            "content": {
                "json": "## Scheduled events fleet\nHistory written by the coordinator to `ScheduledEventsHistory_CL`,"
                " then the coordinator's metrics (Application Insights, `AppMetrics`). Queries are the files in"
                " `infra/queries/`."
            },
        },
        {
            "type": 9,
            "name": "parameters",
            "content": {
                "version": "KqlParameterItem/1.0",
                "style": "pills",
                "queryType": 0,
                "resourceType": RESOURCE_TYPE,
                "parameters": [
                    {
                        "id": "4d1d6f3a-5a52-4f0e-9a55-2f6c1c0b7e01",
                        "version": "KqlParameterItem/1.0",
                        "name": "EventId",
                        "label": "EventId (timeline)",
                        "type": 1,
                        "isRequired": False,
                        "value": "",
                    }
                ],
            },
        },
    ]
    for file_name, title in PANELS:
        query = (QUERIES / file_name).read_text(encoding="utf-8")
        if file_name == "event-timeline.kql":
            if EVENT_ID_LINE not in query:
                raise ValueError(f"{file_name}: expected the line {EVENT_ID_LINE!r} for the EventId parameter")
            query = query.replace(EVENT_ID_LINE, EVENT_ID_PARAMETER_LINE)
        items.append(
            {
                "type": 3,
                "name": file_name.removesuffix(".kql"),
                "content": {
                    "version": "KqlItem/1.0",
                    "title": title,
                    "query": query,
                    "size": 0,
                    "queryType": 0,
                    "resourceType": RESOURCE_TYPE,
                    "visualization": "table",
                },
            }
        )
    for file_name, title, visualization in METRIC_PANELS:
        items.append(
            {
                "type": 3,
                "name": "metrics-" + file_name.removesuffix(".kql"),
                "content": {
                    "version": "KqlItem/1.0",
                    "title": title,
                    "query": (METRIC_QUERIES / file_name).read_text(encoding="utf-8"),
                    "size": 0,
                    "queryType": 0,
                    "resourceType": RESOURCE_TYPE,
                    "visualization": visualization,
                },
            }
        )
    return {
        "version": "Notebook/1.0",
        "items": items,
        # modules/workbook.bicep puts the workspace's resource id here, so the panels query it wherever the
        # workbook is opened from.
        "fallbackResourceIds": [WORKSPACE_PLACEHOLDER],
        "$schema": "https://github.com/Microsoft/Application-Insights-Workbooks/blob/master/schema/workbook.json",
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    WORKBOOK.write_text(render(), encoding="utf-8")
    print(f"wrote {WORKBOOK}")
