"""One local run: start the stack, follow the history into a live timeline until the scenario is over (or the
time limit), then gather the facts and judge them. ``python -m local`` and the end-to-end tests both use it."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from coordinator import PolicyError, TableStateStore, load_policy
from local.expectations import Expected, expect_all, with_declared
from local.observe import HistoryTail, collect
from local.scenario import pages_without_gate
from local.stack import HUB, LocalStack
from local.stack_options import StackOptions
from local.summary import RunFacts, Summary, summarize
from local.timeline import TERMINAL, InTimeOrder, Timeline, moment
from ops.history import LocalRun, local_run_path

Printer = Callable[[str], None]
# How long the live timeline holds a line back to print it in time order: longer than the pipeline takes to log a
# row in all but an outage (detect-to-approve p99 about 1 s, docs/local-mode.md).
TIMELINE_HOLD = timedelta(seconds=2)
IMDS_TERMINAL = frozenset({"Completed", "Canceled"})


def policy_problem(options: StackOptions) -> str | None:
    """Why the run's policy cannot be used, in one line naming the file (None when it can): it must exist and
    load, and each health page of the scenario must be one a gate of it probes."""
    path = options.policy
    named = f" (named by scenario {options.scenario.name!r})" if options.policy_path is None else ""
    if not path.is_file():
        return f"policy file {path}{named} does not exist"
    try:
        policy = load_policy(path)
    except PolicyError as error:
        return f"policy {path}{named}: {_one_line(str(error))}"
    unprobed = pages_without_gate(options.scenario, policy)
    if unprobed:
        return f"scenario {options.scenario.name!r}: no HTTP gate of policy {path} probes health pages {unprobed}"
    return None


def _one_line(text: str) -> str:
    """A several-line message (a heading and one problem per line; YAML's pointer lines) as one line."""
    parts = [line.strip() for line in text.splitlines() if line.strip() not in ("", "^")]
    joined = parts[0] if parts else ""
    for part in parts[1:]:
        joined += (" " if joined.endswith(":") else "; ") + part
    return joined


def history_command(stack: LocalStack) -> str:
    db = stack.history_path
    if db.is_relative_to(Path.cwd()):
        db = db.relative_to(Path.cwd())  # as a user types it from where they ran the command
    return f".venv/bin/python -m ops.history --db {db} events --since 1h   # or: timeline EVENT (e.g. its ref)"


class Follower:
    """Pumps new history rows into the timeline and prints its lines; knows when the scenario is over."""

    def __init__(self, stack: LocalStack, *, printer: Printer | None) -> None:
        self.stack = stack
        self.timeline = Timeline()
        self.tail = HistoryTail(stack.history_path)
        self._printer = printer
        self._in_order = InTimeOrder(TIMELINE_HOLD)
        self._refs: dict[str, str] = {}
        self._record(self._refs)
        scenario = stack.options.scenario
        last_step = max((step.at for step in scenario.steps), default=0.0)
        self.creates = sum(1 for step in scenario.steps if step.create is not None)
        self.scenario_ends = time.monotonic() + stack.options.lead_in + last_step / stack.options.time_scale
        # What the last look at ``over`` still waited for: what a run that timed out names.
        self.waits: list[str] = ["a first look"]

    def _record(self, refs: dict[str, str]) -> None:
        """What the history cannot say about this run, beside it (``ops.history``, ``ops.cost`` read it)."""
        options = self.stack.options
        run = LocalRun(scenario=options.scenario.name, timeScale=options.time_scale, refs=refs)
        local_run_path(self.stack.history_path).write_text(run.model_dump_json(indent=2) + "\n", encoding="utf-8")

    def pump(self) -> None:
        rows = self.tail.new_rows()
        if rows:
            assert self.stack.imds is not None
            events = self.stack.imds.events()
            self.timeline.labels.update({str(e["EventId"]): str(e.get("ref") or e["EventId"][:8]) for e in events})
            refs = {str(e["ref"]): str(e["EventId"]) for e in events if e.get("ref")}
            if refs != self._refs:
                self._refs = refs
                self._record(refs)
        now = datetime.now(UTC)
        for row in rows:
            self._in_order.add(moment(row) or now, self.timeline.add(row))
        self._print(self._in_order.due(now))

    def flush(self) -> None:
        """Prints what is held back: the run is over, no earlier row can come."""
        self._print(self._in_order.flush())

    def _print(self, lines: list[str]) -> None:
        if self._printer is not None:
            for line in lines:
                self._printer(line)

    def over(self) -> bool:
        """Every step played, every event over in IMDS, the coordinator has concluded each of them and retired
        every VM a delete removed (a removed VM's events conclude with its retirement)."""
        self.waits = self.waiting_for()
        return not self.waits

    def waiting_for(self) -> list[str]:
        """What keeps the run from being over, named (empty when it is): a run that times out says why."""
        assert self.stack.imds is not None
        if time.monotonic() < self.scenario_ends:
            return ["the scenario's last step"]
        events = self.stack.imds.events()
        waits: list[str] = []
        if len(events) < self.creates:
            waits.append(f"{self.creates - len(events)} events the scenario creates")
        label = self.timeline.labels
        waits += [
            f"IMDS to end {label.get(str(e['EventId']), e['EventId'])} ({e.get('state')})"
            for e in events
            if e.get("state") not in IMDS_TERMINAL
        ]
        unretired = set(self.stack.imds.removed_vms()) - self.timeline.retired
        waits += [f"the retirement of {vm}" for vm in sorted(unretired)]
        paths = self.timeline.paths
        for e in events:
            event_id = str(e["EventId"])
            name = label.get(event_id, event_id)
            if event_id not in paths:
                waits.append(f"a history row for {name}")
            elif paths[event_id].state not in TERMINAL:
                waits.append(f"the coordinator to conclude {name} ({paths[event_id].state})")
        return waits


def follow(
    stack: LocalStack,
    *,
    timeout: float,
    printer: Printer | None = None,
    interval: float = 0.2,
    until: Callable[[Follower], bool] | None = None,
) -> tuple[Follower, bool]:
    follower = Follower(stack, printer=printer)
    deadline = time.monotonic() + timeout
    done = until or Follower.over
    while time.monotonic() < deadline:
        follower.pump()
        if done(follower):
            # One more look: rows written while we checked, and those of the batches' tails still running.
            stack.drain()
            time.sleep(interval)
            follower.pump()
            return follower, True
        time.sleep(interval)
    follower.pump()
    return follower, False


def judge(
    stack: LocalStack, follower: Follower, *, expected_dead_letters: int = 0, expected: list[Expected] | None = None
) -> tuple[Summary, RunFacts]:
    assert stack.imds is not None
    assert stack.eventhubs is not None
    assert stack.storage is not None
    assert stack.host is not None
    stack.drain()  # the history rows of the batches' tails
    options = stack.options
    policy = load_policy(options.policy)
    events = stack.imds.events()
    if expected is None:
        expected = expect_all(
            events, policy, prepare_hooks=options.prepare_hooks, vms=stack.imds.vms(), time_scale=options.time_scale
        )
        if options.scenario_policy:
            declared = {ref: approval for ref, (approval, _) in options.scenario.expectations().items()}
            expected = with_declared(expected, declared)
    store = TableStateStore.from_connection_string(stack.storage.connection_string, table_name="scheduledevents")
    facts = collect(
        expected=expected,
        timeline=follower.timeline,
        imds_events=events,
        imds_approvals=stack.imds.approvals(),
        eventhubs=stack.eventhubs,
        hub=HUB,
        store=store,
        history_path=stack.history_path,
        envelopes_delivered=stack.host.stats.events,
        failed_batches=stack.host.stats.failed_batches,
        expected_dead_letters=expected_dead_letters,
        cards_folder=stack.cards_dir,
        vm_names={vm.vmId.lower(): vm.name for vm in stack.imds.vms()},
    )
    return summarize(facts), facts


def settle_forwarders(stack: LocalStack, *, timeout: float = 10.0) -> None:
    """Stops the forwarders (SIGTERM: they send what they hold) and waits until the function host has consumed
    everything the hub holds, so that 'sent' and 'applied' are compared at rest."""
    stack.stop_platform()
    for forwarder in stack.iter_forwarders():
        forwarder.stop(timeout=timeout)
    assert stack.eventhubs is not None
    assert stack.host is not None
    deadline = time.monotonic() + timeout
    total = len(stack.eventhubs.all_events(HUB))
    while stack.host.stats.events + stack.host.stats.failed_batches < total and time.monotonic() < deadline:
        time.sleep(0.1)
