"""One local run: start the stack, follow the history into a live timeline until the scenario is over (or the
time limit), then gather the facts and judge them. ``python -m local`` and the end-to-end tests both use it."""

from __future__ import annotations

import time
from collections.abc import Callable

from coordinator.domain.policy_file import DEFAULT_POLICY_PATH, load_policy
from coordinator.state.tables import TableStateStore
from local.expectations import Expected, expect_all
from local.observe import HistoryTail, collect
from local.stack import HUB, LocalStack
from local.summary import RunFacts, Summary, summarize
from local.timeline import TERMINAL, Timeline

Printer = Callable[[str], None]
IMDS_TERMINAL = frozenset({"Completed", "Canceled"})


def history_command(stack: LocalStack) -> str:
    db = stack.history_path
    return f".venv/bin/python -m ops.history --db {db} events --since 1h   # or: timeline EVENT_ID | sql QUERY"


class Follower:
    """Pumps new history rows into the timeline and prints its lines; knows when the scenario is over."""

    def __init__(self, stack: LocalStack, *, printer: Printer | None) -> None:
        self.stack = stack
        self.timeline = Timeline()
        self.tail = HistoryTail(stack.history_path)
        self._printer = printer
        scenario = stack.options.scenario
        last_step = max((step.at for step in scenario.steps), default=0.0)
        self.creates = sum(1 for step in scenario.steps if step.create is not None)
        self.scenario_ends = time.monotonic() + stack.options.lead_in + last_step / stack.options.time_scale

    def pump(self) -> None:
        rows = self.tail.new_rows()
        if rows:
            assert self.stack.imds is not None
            self.timeline.labels.update(
                {str(e["EventId"]): str(e.get("ref") or e["EventId"][:8]) for e in self.stack.imds.events()}
            )
        for row in rows:
            for line in self.timeline.add(row):
                if self._printer is not None:
                    self._printer(line)

    def over(self) -> bool:
        """Every step played, every event over in IMDS, the coordinator has concluded each of them and retired
        every VM a delete removed (a removed VM's events conclude with its retirement)."""
        assert self.stack.imds is not None
        if time.monotonic() < self.scenario_ends:
            return False
        events = self.stack.imds.events()
        if len(events) < self.creates or any(e.get("state") not in IMDS_TERMINAL for e in events):
            return False
        if not set(self.stack.imds.removed_vms()) <= self.timeline.retired:
            return False
        paths = self.timeline.paths
        return all(str(e["EventId"]) in paths and paths[str(e["EventId"])].state in TERMINAL for e in events)


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
            # One more look: rows written while we checked.
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
    policy = load_policy(stack.options.policy_path or DEFAULT_POLICY_PATH)
    events = stack.imds.events()
    if expected is None:
        expected = expect_all(
            events,
            policy,
            prepare_hooks=stack.options.prepare_hooks,
            vms=stack.imds.vms(),
            time_scale=stack.options.time_scale,
        )
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
