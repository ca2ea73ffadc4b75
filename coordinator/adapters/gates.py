"""Health gates, the I/O half: reads each named gate of the policy (an HTTP probe, an Azure Monitor alert rule's
state, a Log Analytics query) and gives ``GateResult``s for the pure rules (coordinator/domain/evaluation.py).

A ``GateReader`` is made per batch/tick (``pipeline/decide.py``'s ``Fleet`` holds one) and reads each gate at
most once, or joins the read of it another run of the process has under way: every event decided in that batch/tick
sees the same answer. A batch asks without waiting
(``results(wait=False)``): the gates are then read in threads of their own, each within its deadline, and
``GatesPending`` says which are not read yet, so that the events that do not need them are decided (and their
approvals sent) meanwhile. A gate that cannot be read is an error,
which holds like a failing one (an unreadable health signal approves nothing); so is an answer that is not what the
gate reads (``{}``, a renamed field, Log Analytics' partial error with HTTP 200), with the reason. Azure Monitor is
read with the coordinator's identity through ``AzureMonitorReader``, whose two calls are the narrowest seam a test
can stand in for (no local Azure Monitor exists).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from azure.core.credentials import TokenCredential

from coordinator.adapters import deadline
from coordinator.domain.controls import AlertGate, Gate, GateResult, HttpGate, LogQueryGate

log = logging.getLogger("coordinator")

LOGS_ENDPOINT = "https://api.loganalytics.io"
ARM_ENDPOINT = "https://management.azure.com"
# Alerts Management API: the version that lists alerts filtered by alert rule and monitor condition.
ALERTS_API_VERSION = "2019-05-05-preview"
# The total deadline of one Azure Monitor read (the token, the request, every byte of the answer): a gate is read
# once per batch or tick, which waits for it.
MONITOR_DEADLINE_SECONDS = 10.0
# Gates read for one VM each (a return to service's readiness) at once: each has its own deadline.
VM_GATE_WORKERS = 8
# Bytes of a probe's or query's answer read at most: a gate needs a status or a row count, never a page.
MAX_ANSWER_BYTES = 1 << 20


class GateUnreadable(ValueError):
    """Azure Monitor answered, but not with what the gate reads (an empty object, a renamed field, a partial error):
    the gate's state is unknown, so it holds like a failure, with this reason."""


def fired_count(body: Any) -> int:
    """Fired alerts in an Alerts Management list answer (``{"value": [...], "nextLink": ...}``). An answer without
    the ``value`` list is unreadable: counting it as no alert would pass a gate that no one has read."""
    if not isinstance(body, dict) or not isinstance(body.get("value"), list):
        raise GateUnreadable(f"the alerts answer has no 'value' list (keys: {_keys(body)})")
    fired = len(body["value"])
    if not fired and body.get("nextLink"):
        raise GateUnreadable("the alerts answer's first page is empty but names a next page")
    return fired


def query_row_count(body: Any) -> int:
    """Rows of a Log Analytics query answer (``{"tables": [{"name", "columns", "rows"}]}``). An answer with an
    ``error`` is unreadable even with HTTP 200 (a partial result: the rows may be missing); so is one without
    tables, or a table without its ``rows`` list."""
    if not isinstance(body, dict):
        raise GateUnreadable(f"the query answer is not an object ({type(body).__name__})")
    if body.get("error"):
        error = body["error"]
        what = (error.get("message") or error.get("code")) if isinstance(error, dict) else error
        raise GateUnreadable(f"the query answered with an error (a partial result): {str(what)[:200]}")
    tables = body.get("tables")
    if not isinstance(tables, list) or not tables:
        raise GateUnreadable(f"the query answer has no 'tables' list (keys: {_keys(body)})")
    rows = 0
    for index, table in enumerate(tables):
        if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
            raise GateUnreadable(f"table {index} of the query answer has no 'rows' list")
        rows += len(table["rows"])
    return rows


def _keys(body: Any) -> str:
    if not isinstance(body, dict):
        return f"not an object but {type(body).__name__}"
    return ", ".join(sorted(str(key)[:40] for key in body)[:10]) or "none"


class GatesPending(Exception):
    """Gates asked for without waiting (``GateReader.results(wait=False)``) that are still being read."""

    def __init__(self, names: Sequence[str], reads: Sequence[Future[GateResult]]) -> None:
        super().__init__(f"gates {', '.join(names)} are still being read")
        self.names = list(names)
        self.reads = list(reads)  # done once every one of them is read


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
        deadline_seconds: float = MONITOR_DEADLINE_SECONDS,
    ) -> None:
        self._credential = credential
        self._arm = arm_endpoint.rstrip("/")
        self._logs = logs_endpoint.rstrip("/")
        self._deadline = deadline_seconds
        self._session = deadline.session()

    def _token(self, endpoint: str) -> str:
        return self._credential.get_token(f"{endpoint}/.default").token

    def fired_alerts(self, gate: AlertGate) -> int:
        subscription = gate.alertRuleId.split("/")[2]
        with deadline.deadline(self._deadline, f"alerts of {gate.alertRuleId[-200:]}"):
            response = self._session.get(
                f"{self._arm}/subscriptions/{subscription}/providers/Microsoft.AlertsManagement/alerts",
                params={
                    "api-version": ALERTS_API_VERSION,
                    "alertRule": gate.alertRuleId,
                    "monitorCondition": "Fired",
                    "timeRange": "1d",
                },
                headers={"Authorization": f"Bearer {self._token(self._arm)}"},
                timeout=self._deadline,
            )
            response.raise_for_status()
            return fired_count(response.json())

    def query_rows(self, gate: LogQueryGate) -> int:
        with deadline.deadline(self._deadline, f"query of workspace {gate.workspaceId}"):
            response = self._session.post(
                f"{self._logs}/v1/workspaces/{gate.workspaceId}/query",
                json={"query": gate.query, "timespan": gate.timespan},
                headers={"Authorization": f"Bearer {self._token(self._logs)}"},
                timeout=self._deadline,
            )
            response.raise_for_status()
            return query_row_count(response.json())


# The gate reads under way in this process, by gate (its definition) and Azure Monitor reader: a run that needs a gate
# another run is reading joins that read. Batches do not wait for their gates (``results(wait=False)``), so without
# this each batch of a partition would start its own read of a slow gate, each lasting up to the gate's deadline;
# with it a slow gate has one read under way per instance. The answer comes after the joining run began.
_IN_FLIGHT: dict[tuple[str, int], Future[GateResult]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


class GateReader:
    """Reads gates for one batch/tick, each at most once (results are kept for this reader's life), joining a read of
    the same gate that another run has under way."""

    def __init__(
        self,
        gates: Mapping[str, Gate],
        *,
        monitor: MonitorReader | None = None,
    ) -> None:
        self._gates = gates
        self._monitor = monitor
        self._session = deadline.session()
        self._reads: dict[str, Future[GateResult]] = {}

    def results(self, names: Iterable[str], *, wait: bool = True) -> dict[str, GateResult]:
        """The named gates' results, each read once (``start``). ``wait=False``: ``GatesPending`` names those still
        being read, if any, instead of waiting for them."""
        names = list(names)
        self.start(names)
        pending = [name for name in names if not self._reads[name].done()]
        if pending and not wait:
            raise GatesPending(pending, [self._reads[name] for name in pending])
        return {name: self._reads[name].result() for name in names}

    def wait(self) -> None:
        """Until every read this reader started has ended (each within its deadline)."""
        futures.wait(list(self._reads.values()))

    def start(self, names: Iterable[str]) -> None:
        """The named gates not read yet begin to be read, each in a thread of its own (a gate that answers slowly
        holds only the decisions that need it; several gates take the longest one's time, not the sum), or join the
        read of the same gate another run of the process has under way (``_IN_FLIGHT``)."""
        for name in names:
            if name in self._reads:
                continue
            gate = self._gates.get(name)
            key = (gate.model_dump_json() if gate is not None else f"undefined {name}", id(self._monitor))
            with _IN_FLIGHT_LOCK:
                under_way = _IN_FLIGHT.get(key)
                if under_way is None:
                    _IN_FLIGHT[key] = future = Future[GateResult]()
            if under_way is not None:
                self._reads[name] = under_way
                continue
            self._reads[name] = future
            reading = threading.Thread(target=self._settle, args=(name, future, key), name=f"gate-{name[:40]}")
            reading.daemon = True  # each read ends within its deadline; none keeps a stopping process alive
            reading.start()

    def _settle(self, name: str, future: Future[GateResult], key: tuple[str, int]) -> None:
        result = self._read(name)  # never raises: a failure is the gate's error
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.pop(key, None)  # a run that starts after this answer reads again
        future.set_result(result)

    def for_vms(self, wanted: Mapping[str, Sequence[str]]) -> dict[str, dict[str, GateResult]]:
        """Each VM's gates (``wanted``: VM name -> gate names) as read for it: a gate naming ``{vm}`` once per VM,
        any other once; every per-VM read of the call in one pool, ``VM_GATE_WORKERS`` at a time, each within its own
        deadline: dead readiness pages for 64 VMs cost a tick 8 deadlines, not 64."""
        fleet = sorted({name for names in wanted.values() for name in names if not self._per_vm(name)})
        shared = self.results(fleet) if fleet else {}
        pairs = [(name, vm) for vm, names in wanted.items() for name in names if self._per_vm(name)]
        read: dict[tuple[str, str], GateResult] = {}
        if pairs:
            with ThreadPoolExecutor(max_workers=VM_GATE_WORKERS, thread_name_prefix="gate") as pool:
                read.update(zip(pairs, pool.map(lambda pair: self._read(pair[0], vm=pair[1]), pairs), strict=True))
        return {vm: {n: shared[n] if n in shared else read[(n, vm)] for n in names} for vm, names in wanted.items()}

    def _per_vm(self, name: str) -> bool:
        gate = self._gates.get(name)
        return gate is not None and gate.per_vm

    def _read(self, name: str, *, vm: str = "") -> GateResult:
        gate = self._gates.get(name)
        if gate is None:
            return GateResult("error", "not defined in the policy")
        try:
            gate = gate.for_vm(vm) if vm else gate  # a name that cannot go into it: the gate's error
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
            log.warning("gate %s%s could not be read: %s", name, f" for {vm}" if vm else "", error)
            return GateResult("error", f"{type(error).__name__}: {str(error)[:200]}")

    def _probe(self, gate: HttpGate) -> GateResult:
        # timeoutSeconds is the probe's total deadline, answer included: a page that trickles is cut there (the
        # per-read timeout, a second longer, never speaks first).
        per_read = gate.timeoutSeconds + 1
        with (
            deadline.deadline(gate.timeoutSeconds, f"probe {gate.url[:200]}"),
            self._session.get(gate.url, timeout=per_read, stream=True, allow_redirects=False) as answer,
        ):
            answer.raw.read(MAX_ANSWER_BYTES, decode_content=True)
            if answer.status_code in gate.expectStatus:
                return GateResult("passing", f"HTTP {answer.status_code}")
            return GateResult("failing", f"HTTP {answer.status_code}, expected {gate.expectStatus}")
