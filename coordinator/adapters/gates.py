"""Health gates, the I/O half: reads each named gate of the policy (an HTTP probe, an Azure Monitor alert rule's
state, a Log Analytics query) and gives ``GateResult``s for the pure rules (coordinator/domain/evaluation.py).

A ``GateReader`` is made per batch/tick (``pipeline/decide.py``'s ``Fleet`` holds one) and reads each gate at
most once: every event decided in that batch/tick sees the same answer. A gate that cannot be read is an error,
which holds like a failing one (an unreadable health signal approves nothing). Azure Monitor is read with the
coordinator's identity through ``AzureMonitorReader``, whose two calls are the narrowest seam a test can stand in
for (no local Azure Monitor exists).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import requests
from azure.core.credentials import TokenCredential

from coordinator.domain.controls import AlertGate, Gate, GateResult, HttpGate, LogQueryGate

log = logging.getLogger("coordinator")

LOGS_ENDPOINT = "https://api.loganalytics.io"
ARM_ENDPOINT = "https://management.azure.com"
# Alerts Management API: the version that lists alerts filtered by alert rule and monitor condition.
ALERTS_API_VERSION = "2019-05-05-preview"
MONITOR_TIMEOUT_SECONDS = 10.0
# Bytes of a probe's or query's answer read at most: a gate needs a status or a row count, never a page.
MAX_ANSWER_BYTES = 1 << 20


class MonitorReader(Protocol):
    """What a gate needs of Azure Monitor: how many alerts of a rule are Fired, how many rows a query returns."""

    def fired_alerts(self, gate: AlertGate) -> int: ...

    def query_rows(self, gate: LogQueryGate) -> int: ...


class AzureMonitorReader:
    """Azure Monitor over its REST APIs with the coordinator's managed identity (Monitoring Reader on the alert
    rule's scope; Log Analytics Reader on the workspace). Endpoints are options for sovereign clouds."""

    def __init__(
        self,
        *,
        credential: TokenCredential,
        arm_endpoint: str = ARM_ENDPOINT,
        logs_endpoint: str = LOGS_ENDPOINT,
        session: requests.Session | None = None,
    ) -> None:
        self._credential = credential
        self._arm = arm_endpoint.rstrip("/")
        self._logs = logs_endpoint.rstrip("/")
        self._session = session or requests.Session()

    def _token(self, endpoint: str) -> str:
        return self._credential.get_token(f"{endpoint}/.default").token

    def fired_alerts(self, gate: AlertGate) -> int:
        subscription = gate.alertRuleId.split("/")[2]
        response = self._session.get(
            f"{self._arm}/subscriptions/{subscription}/providers/Microsoft.AlertsManagement/alerts",
            params={
                "api-version": ALERTS_API_VERSION,
                "alertRule": gate.alertRuleId,
                "monitorCondition": "Fired",
                "timeRange": "1d",
            },
            headers={"Authorization": f"Bearer {self._token(self._arm)}"},
            timeout=MONITOR_TIMEOUT_SECONDS,
        )
        response.raise_for_status()
        body: Any = response.json()
        return len(body.get("value", [])) if isinstance(body, dict) else 0

    def query_rows(self, gate: LogQueryGate) -> int:
        response = self._session.post(
            f"{self._logs}/v1/workspaces/{gate.workspaceId}/query",
            json={"query": gate.query, "timespan": gate.timespan},
            headers={"Authorization": f"Bearer {self._token(self._logs)}"},
            timeout=MONITOR_TIMEOUT_SECONDS,
        )
        response.raise_for_status()
        body: Any = response.json()
        tables = body.get("tables", []) if isinstance(body, dict) else []
        return sum(len(table.get("rows", [])) for table in tables if isinstance(table, dict))


class GateReader:
    """Reads gates for one batch/tick, each at most once (results are kept for this reader's life)."""

    def __init__(
        self,
        gates: Mapping[str, Gate],
        *,
        monitor: MonitorReader | None = None,
        session: requests.Session | None = None,
    ) -> None:
        self._gates = gates
        self._monitor = monitor
        self._session = session or requests.Session()
        self._results: dict[str, GateResult] = {}

    def results(self, names: Iterable[str]) -> dict[str, GateResult]:
        for name in names:
            if name not in self._results:
                self._results[name] = self._read(name)
        return {name: self._results[name] for name in names}

    def _read(self, name: str) -> GateResult:
        gate = self._gates.get(name)
        if gate is None:
            return GateResult("error", "not defined in the policy")
        try:
            if gate.http is not None:
                return self._probe(gate.http)
            if self._monitor is None:
                return GateResult("error", "no Azure Monitor reader configured")
            if gate.alert is not None:
                fired = self._monitor.fired_alerts(gate.alert)
                return GateResult("failing", f"{fired} alerts fired") if fired else GateResult("passing")
            assert gate.logQuery is not None  # Gate._one_kind
            rows = self._monitor.query_rows(gate.logQuery)
            passing = (rows == 0) == (gate.logQuery.passWhen == "empty")
            return GateResult("passing" if passing else "failing", f"query returned {rows} rows")
        except Exception as error:  # any failure to read is the gate's error, held like a failure
            log.warning("gate %s could not be read: %s", name, error)
            return GateResult("error", f"{type(error).__name__}: {str(error)[:200]}")

    def _probe(self, gate: HttpGate) -> GateResult:
        with self._session.get(gate.url, timeout=gate.timeoutSeconds, stream=True, allow_redirects=False) as answer:
            answer.raw.read(MAX_ANSWER_BYTES, decode_content=True)
            if answer.status_code in gate.expectStatus:
                return GateResult("passing", f"HTTP {answer.status_code}")
            return GateResult("failing", f"HTTP {answer.status_code}, expected {gate.expectStatus}")
