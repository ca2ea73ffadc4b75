"""The tail every run ends with, whether a batch, the timer or a person started it, in one place:

0. ``decide``   the events a batch wrote undecided while their gates were read (``decide.decide_awaiting``);
1. ``deliver``  the approvals the run's committed writes decided go out, and their outcomes are committed;
   then those it decided while ARM's census was not usable, once a read under way lands (``after_census``), and
   the approvals that makes;
2. ``cards``    the cards those writes recorded are posted (a batch or a person logs what it sent; the timer
                clears what the logs say was sent);
3. ``budgets``  the budget slots of events that concluded are freed (``release.release_budgets``);
4. ``history``  the run's history rows, each already in the state's outbox, are written, last, and their entries
                deleted (a failure never stops the pipeline: the timer writes them);
then what the run committed goes into the instance's fleet cache for its next runs (pipeline/fleet.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from coordinator.adapters import census
from coordinator.pipeline import act, decide, outbox, record, release
from coordinator.pipeline.run import Run

__all__ = ["Settled", "after_census", "finish"]


@dataclass(frozen=True)
class Settled:
    """What the batches' logs say was sent, which the timer's tail clears from the outboxes."""

    events: dict[str, list[str]]
    vms: outbox.VmCards


def finish(run: Run, *, last_seen: dict[str, datetime] | None = None, settled: Settled | None = None) -> None:
    """Ends a run: awaited decisions, approvals, cards, budgets, history, in that order. ``last_seen`` (the timer's
    fresh read of every VM's last envelope) widens who may execute an approval; ``settled`` is the timer's."""
    # A batch's events written undecided while their gates were read: decided (their gates waited for) while the
    # batch's own sends are answered, then delivered with them.
    decide.decide_awaiting(run)
    act.deliver(run, last_seen=last_seen)
    # Once the run's own approvals are out: only what rested on the census waits for its read under way.
    if after_census(run):
        act.deliver(run, last_seen=last_seen, again=True)
    if settled is None:
        outbox.post_and_log(run)
    else:
        outbox.post_and_settle(run, settled.events, settled.vms)
    release.release_budgets(run)
    record.history(run)
    run.fleet.absorb(run.work.uncached())


def after_census(run: Run) -> bool:
    """The events the run held because ARM's census was not usable (its first read outlasted the batch's wait:
    coordinator/adapters/census.py), decided again from when the read under way lands, ``FIRST_READ_WAIT`` at most
    more: off the partition when the tail runs after the batch, so a large fleet's first read costs its census
    rules' approvals seconds, not the timer's next tick. True when it decided them again."""
    held, run.work.awaiting_census = run.work.awaiting_census, []  # redecide_each decides each once
    if not held or not run.fleet.census_landed(census.FIRST_READ_WAIT):
        return False
    run.now = run.parts.clock()
    decide.redecide_each(run, held)
    return True
