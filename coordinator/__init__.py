"""Fleet logic behind the Functions app: state, rules, history, callback and alerts.

The package's face: the names below are what code outside ``coordinator/`` (``function_app.py``, ``ops/``,
``local/``, ``oracle/``, ``benchmarks/``) imports, always as ``from coordinator import X``; the modules behind them
are the coordinator's own (docs/architecture.md, *The coordinator's house*). The face is lazy: each name is imported
from its module on first use, so that ``import coordinator.domain.model`` (the Functions app, the tests) loads no
more than before, and no module of the coordinator imports the face. ``tests/test_faces.py`` pins the names.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: ``import coordinator`` imports nothing

# running the coordinator: settings, wiring, its parts and options, a run's input and report, the people's routes,
# telemetry's names
__all__ = [
    "APPROVE_ROLE",
    "DELIVERY_QUEUE",
    "EVENT_ID",
    "FORM_KEY_NAME",
    "READ_ROLE",
    "SERVICE_NAME",
    "Access",
    "Coordinator",
    "CoordinatorSettings",
    "Options",
    "Parts",
    "RawMessage",
    "Report",
    "Response",
    "approve",
    "build_coordinator",
    "pending_events",
    "set_graces",
]
# policy: read, matched and evaluated (ops.policy replays it, the oracle and benchmarks judge by it)
__all__ += [
    "DEFAULT_POLICY_PATH",
    "IN_RUN_DELIVERY",
    "RETURNING_TYPES",
    "RETURN_WATCH_LIMIT",
    "UNPEERED_ALLOWANCE",
    "Decision",
    "FleetView",
    "GateResult",
    "GateState",
    "HooksOption",
    "Match",
    "Policy",
    "PolicyError",
    "RateOption",
    "Rule",
    "SequenceOption",
    "VmFacts",
    "approval_bound",
    "couple",
    "evaluate",
    "facts_of",
    "first_match",
    "holds_budget",
    "hooks_required",
    "load_policy",
    "needs_fleet",
    "parse_policy",
    "pending_delete",
    "request_bound",
    "scale_sets_of",
    "sendable",
]
# history rows and the model: what the tools read back and replay
__all__ += [
    "TERMINAL_STATES",
    "AlertKind",
    "BudgetRecord",
    "DecisionRecord",
    "EventRecord",
    "HistoryRow",
    "VmSighting",
    "column_types",
    "history_schema",
]
# state store: the protocol, the Table one, its transport, and VMs' bindings (benchmarks seed and count them)
__all__ += ["CLAIM_PARTITION", "StateStore", "TableStateStore", "TransactionTableClient", "Wanted", "remember"]
# adapters: what the coordinator talks to, for tools that talk to the same (ARM, Relay, history, cards)
__all__ += [
    "ARM_ENDPOINT",
    "DEFAULT_SQLITE_PATH",
    "ApprovalCallback",
    "ApprovalDeliveryError",
    "ArmClient",
    "ArmOptions",
    "FolderCardSink",
    "RelayApprovalSender",
    "SqliteHistory",
]

# Each name's module; the imports under TYPE_CHECKING below say the same for mypy (tests/test_faces.py holds them
# equal).
_MODULES: dict[str, tuple[str, ...]] = {
    "coordinator.adapters.arm": ("ARM_ENDPOINT", "ArmClient", "ArmOptions"),
    "coordinator.adapters.callback": ("ApprovalCallback", "ApprovalDeliveryError"),
    "coordinator.adapters.delivery_queue": ("DELIVERY_QUEUE",),
    "coordinator.adapters.history": ("DEFAULT_SQLITE_PATH", "SqliteHistory"),
    "coordinator.adapters.relay_sender": ("RelayApprovalSender",),
    "coordinator.adapters.teams": ("FolderCardSink",),
    "coordinator.adapters.telemetry": ("EVENT_ID", "SERVICE_NAME"),
    "coordinator.domain.controls": ("GateResult", "GateState", "VmFacts"),
    "coordinator.domain.deletes": ("couple", "pending_delete"),
    "coordinator.domain.evaluation": ("Decision", "evaluate", "hooks_required", "needs_fleet"),
    "coordinator.domain.event_merge": ("scale_sets_of",),
    "coordinator.domain.expiry": ("approval_bound", "request_bound", "sendable"),
    "coordinator.domain.fleet_view": ("FleetView",),
    "coordinator.domain.matching": ("first_match",),
    "coordinator.domain.claims": ("BudgetRecord",),
    "coordinator.domain.model": ("TERMINAL_STATES", "AlertKind", "DecisionRecord", "EventRecord", "VmSighting"),
    "coordinator.domain.policy": ("HooksOption", "Match", "Policy", "RateOption", "Rule", "SequenceOption"),
    "coordinator.domain.policy_file": ("DEFAULT_POLICY_PATH", "PolicyError", "load_policy", "parse_policy"),
    "coordinator.domain.returns": ("RETURN_WATCH_LIMIT", "RETURNING_TYPES"),
    "coordinator.domain.rows": ("HistoryRow", "column_types", "history_schema"),
    "coordinator.http": (
        "APPROVE_ROLE",
        "FORM_KEY_NAME",
        "READ_ROLE",
        "Access",
        "Response",
        "approve",
        "pending_events",
    ),
    "coordinator.pipeline.bindings": ("Wanted", "remember"),
    "coordinator.pipeline.fleet_cache": ("facts_of", "holds_budget"),
    "coordinator.pipeline.ingest": ("RawMessage",),
    "coordinator.pipeline.plan": ("UNPEERED_ALLOWANCE",),
    "coordinator.pipeline.run": ("IN_RUN_DELIVERY", "Options", "Parts", "Report"),
    "coordinator.service": ("Coordinator", "set_graces"),
    "coordinator.settings": ("CoordinatorSettings",),
    "coordinator.state.entities": ("CLAIM_PARTITION",),
    "coordinator.state.store": ("StateStore",),
    "coordinator.state.table_batch": ("TransactionTableClient",),
    "coordinator.state.tables": ("TableStateStore",),
    "coordinator.wiring": ("build_coordinator",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

if TYPE_CHECKING:
    from coordinator.adapters.arm import ARM_ENDPOINT, ArmClient, ArmOptions
    from coordinator.adapters.callback import ApprovalCallback, ApprovalDeliveryError
    from coordinator.adapters.delivery_queue import DELIVERY_QUEUE
    from coordinator.adapters.history import DEFAULT_SQLITE_PATH, SqliteHistory
    from coordinator.adapters.relay_sender import RelayApprovalSender
    from coordinator.adapters.teams import FolderCardSink
    from coordinator.adapters.telemetry import EVENT_ID, SERVICE_NAME
    from coordinator.domain.claims import BudgetRecord
    from coordinator.domain.controls import GateResult, GateState, VmFacts
    from coordinator.domain.deletes import couple, pending_delete
    from coordinator.domain.evaluation import Decision, evaluate, hooks_required, needs_fleet
    from coordinator.domain.event_merge import scale_sets_of
    from coordinator.domain.expiry import approval_bound, request_bound, sendable
    from coordinator.domain.fleet_view import FleetView
    from coordinator.domain.matching import first_match
    from coordinator.domain.model import TERMINAL_STATES, AlertKind, DecisionRecord, EventRecord, VmSighting
    from coordinator.domain.policy import HooksOption, Match, Policy, RateOption, Rule, SequenceOption
    from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, PolicyError, load_policy, parse_policy
    from coordinator.domain.returns import RETURN_WATCH_LIMIT, RETURNING_TYPES
    from coordinator.domain.rows import HistoryRow, column_types, history_schema
    from coordinator.http import APPROVE_ROLE, FORM_KEY_NAME, READ_ROLE, Access, Response, approve, pending_events
    from coordinator.pipeline.bindings import Wanted, remember
    from coordinator.pipeline.fleet_cache import facts_of, holds_budget
    from coordinator.pipeline.ingest import RawMessage
    from coordinator.pipeline.plan import UNPEERED_ALLOWANCE
    from coordinator.pipeline.run import IN_RUN_DELIVERY, Options, Parts, Report
    from coordinator.service import Coordinator, set_graces
    from coordinator.settings import CoordinatorSettings
    from coordinator.state.entities import CLAIM_PARTITION
    from coordinator.state.store import StateStore
    from coordinator.state.table_batch import TransactionTableClient
    from coordinator.state.tables import TableStateStore
    from coordinator.wiring import build_coordinator
else:

    def __getattr__(name: str) -> object:
        """A name of the face, imported from its module on first use and kept here. Any other name is no attribute,
        so that ``from coordinator import pages`` (inside the coordinator) still imports the submodule."""
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib  # noqa: PLC0415 -- on first use only: the face itself imports nothing

        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
