"""Health gates' I/O: an HTTP probe against a local health endpoint (passing, failing, erroring, bounded by its
timeout), each gate read once per reader (batch/tick), and the Azure Monitor reader against a local stand-in of
the two REST APIs it calls (no local Azure Monitor exists; the stand-in answers as the documented APIs do)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest
from azure.core.credentials import AccessToken

from coordinator.adapters.gates import AzureMonitorReader, GateReader, GatesPending
from coordinator.domain.controls import AlertGate, Gate, HttpGate, LogQueryGate
from tests.loopback import QuietHandler

WORKSPACE = "11111111-2222-3333-4444-555555555555"
RULE = "/subscriptions/00000000-0000-0000-0000-000000000001/resourceGroups/rg/providers/microsoft.insights/" + (
    "metricAlerts/cpu"
)


class Endpoint(QuietHandler):
    """The local health page and the Azure Monitor stand-in: answers by path, records what it was asked."""

    status = 200
    delay = 0.0
    rows = 0
    fired = 0
    # When set, Azure Monitor's answer instead of the documented shape (HTTP 200).
    answer: Any = None
    seen: list[dict[str, Any]]

    def do_GET(self) -> None:
        cls = type(self)
        cls.seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
        time.sleep(cls.delay)
        if "/providers/Microsoft.AlertsManagement/alerts" in self.path:
            self._json(
                cls.answer if cls.answer is not None else {"value": [{"id": f"alert-{i}"} for i in range(cls.fired)]}
            )
            return
        self.send_response(cls.status)
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        tables = [{"name": "PrimaryResult", "columns": [], "rows": [[i] for i in range(cls.rows)]}]
        self._json(cls.answer if cls.answer is not None else {"tables": tables})

    def _json(self, data: Any) -> None:
        self.respond(200, json.dumps(data).encode())


@pytest.fixture
def endpoint() -> Iterator[tuple[str, type[Endpoint]]]:
    handler = type("Page", (Endpoint,), {"seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


class StandInCredential:
    """Stand-in for the managed identity (a token credential with a fixed token)."""

    def __init__(self) -> None:
        self.scopes: list[str] = []

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        self.scopes.extend(scopes)
        return AccessToken("stand-in-token", int(time.time()) + 3600)


def http_gate(url: str, **options: Any) -> dict[str, Gate]:
    return {"health": Gate(http=HttpGate(url=url, **options))}


def test_the_probe_passes_on_an_expected_status_and_fails_on_another(endpoint):
    url, page = endpoint
    assert GateReader(http_gate(url + "/health")).results(["health"])["health"].state == "passing"
    page.status = 503
    failing = GateReader(http_gate(url + "/health")).results(["health"])["health"]
    assert (failing.state, failing.detail) == ("failing", "HTTP 503, expected [200]")
    assert GateReader(http_gate(url + "/health", expectStatus=[503])).results(["health"])["health"].state == "passing"


def test_an_unreachable_or_slow_probe_is_an_error_within_its_timeout(endpoint):
    url, page = endpoint
    unreachable = GateReader(http_gate("http://127.0.0.1:9/health", timeoutSeconds=1)).results(["health"])["health"]
    assert unreachable.state == "error"
    page.delay = 3.0
    started = time.monotonic()
    slow = GateReader(http_gate(url + "/health", timeoutSeconds=0.5)).results(["health"])["health"]
    assert slow.state == "error"
    assert "total deadline of 0.5 s" in slow.detail
    assert time.monotonic() - started < 2.5


def test_a_reader_reads_each_gate_once(endpoint):
    url, page = endpoint
    reader = GateReader(http_gate(url + "/health"))
    for _ in range(3):
        reader.results(["health"])
    assert len(page.seen) == 1


def test_asked_without_waiting_a_reader_reads_its_gates_in_the_background_at_once_and_once(endpoint):
    url, page = endpoint
    page.delay = 0.5
    gates = {**http_gate(url + "/health"), "other": Gate(http=HttpGate(url=url + "/other"))}
    reader = GateReader(gates)
    started = time.monotonic()
    with pytest.raises(GatesPending) as pending:
        reader.results(["health", "other"], wait=False)
    assert time.monotonic() - started < 0.3  # not waited for
    assert pending.value.names == ["health", "other"]
    assert "gates health, other are still being read" in str(pending.value)
    futures.wait(pending.value.reads, timeout=5)
    assert time.monotonic() - started < 0.9  # read side by side: not one after the other
    assert {n: r.state for n, r in reader.results(["health", "other"], wait=False).items()} == {
        "health": "passing",
        "other": "passing",
    }
    assert reader.results(["health"])["health"].detail == "HTTP 200"
    assert sorted(seen["path"] for seen in page.seen) == ["/health", "/other"]  # each read once


def test_a_reader_joins_the_read_of_the_same_gate_another_run_has_under_way_and_reads_again_after_it(endpoint):
    """Batches do not wait for their gates: each of a partition's batches would otherwise start a read of a slow gate
    of its own, each lasting up to its deadline."""
    url, page = endpoint
    page.delay = 0.5
    first, second = GateReader(http_gate(url + "/health")), GateReader(http_gate(url + "/health"))
    with pytest.raises(GatesPending):
        first.results(["health"], wait=False)
    with pytest.raises(GatesPending) as joined:
        second.results(["health"], wait=False)
    futures.wait(joined.value.reads, timeout=5)
    assert first.results(["health"]) == second.results(["health"])
    assert len(page.seen) == 1  # one read for both
    page.delay = 0.0
    GateReader(http_gate(url + "/health")).results(["health"])
    assert len(page.seen) == 2  # a run that starts after the answer reads again


def test_an_azure_monitor_gate_without_a_reader_is_an_error():
    gates = {"cpu": Gate(alert=AlertGate(alertRuleId=RULE))}
    result = GateReader(gates).results(["cpu"])["cpu"]
    assert (result.state, result.detail) == ("error", "no Azure Monitor reader configured")


def test_alert_and_log_query_gates_read_azure_monitor_with_the_coordinators_identity(endpoint):
    url, page = endpoint
    credential = StandInCredential()
    monitor = AzureMonitorReader(credential=credential, arm_endpoint=url, logs_endpoint=url)
    gates = {
        "cpu": Gate(alert=AlertGate(alertRuleId=RULE)),
        "errors": Gate(logQuery=LogQueryGate(workspaceId=WORKSPACE, query="AppRequests | where Success == false")),
    }
    assert {n: r.state for n, r in GateReader(gates, monitor=monitor).results(["cpu", "errors"]).items()} == {
        "cpu": "passing",
        "errors": "passing",
    }
    page.fired, page.rows = 1, 4
    results = GateReader(gates, monitor=monitor).results(["cpu", "errors"])
    assert (results["cpu"].state, results["cpu"].detail) == ("failing", "1 alerts fired")
    assert (results["errors"].state, results["errors"].detail) == ("failing", "query returned 4 rows")
    alert_call = next(s for s in page.seen if "alerts" in s["path"])
    assert "monitorCondition=Fired" in alert_call["path"]
    assert alert_call["auth"] == "Bearer stand-in-token"
    query_call = next(s for s in page.seen if s["path"] == f"/v1/workspaces/{WORKSPACE}/query")
    assert query_call["body"] == {"query": "AppRequests | where Success == false", "timespan": "PT15M"}
    assert set(credential.scopes) == {f"{url}/.default"}


@pytest.mark.parametrize(
    ("kind", "answer", "reason"),
    [
        ("alert", {}, "the alerts answer has no 'value' list (keys: none)"),
        ("alert", {"values": []}, "no 'value' list (keys: values)"),
        ("alert", {"value": None}, "no 'value' list"),
        ("alert", [], "no 'value' list (keys: not an object but list)"),
        ("alert", {"value": [], "nextLink": "https://management.azure.com/next"}, "first page is empty"),
        ("query", {}, "the query answer has no 'tables' list (keys: none)"),
        ("query", {"tables": []}, "no 'tables' list"),
        ("query", {"Tables": [{"rows": []}]}, "no 'tables' list (keys: Tables)"),
        ("query", {"tables": [{"name": "PrimaryResult", "Rows": []}]}, "table 0 of the query answer has no 'rows'"),
        # Log Analytics' partial error: HTTP 200, the rows so far, and an error saying the result is incomplete.
        (
            "query",
            {
                "tables": [{"name": "PrimaryResult", "columns": [], "rows": []}],
                "error": {"code": "PartialError", "message": "There were some errors when processing your query."},
            },
            "answered with an error (a partial result): There were some errors",
        ),
    ],
)
def test_an_azure_monitor_answer_the_gate_cannot_read_holds_with_the_reason(endpoint, kind, answer, reason):
    url, page = endpoint
    page.answer = answer
    monitor = AzureMonitorReader(credential=StandInCredential(), arm_endpoint=url, logs_endpoint=url)
    gate = (
        Gate(alert=AlertGate(alertRuleId=RULE))
        if kind == "alert"
        else Gate(logQuery=LogQueryGate(workspaceId=WORKSPACE, query="AppRequests | where Success == false"))
    )
    result = GateReader({"g": gate}, monitor=monitor).results(["g"])["g"]
    assert result.state == "error"  # holds, as a failing gate does; an unreadable signal approves nothing
    assert reason in result.detail
