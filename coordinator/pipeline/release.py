"""The tail's third step (``tail.finish``): the budget slots of a run's events that concluded, and of the approvals
it withdrew, freed in their claim entities (pipeline/budget_claims.py)."""

from __future__ import annotations

import logging

from coordinator.domain.budgets import budget_limit, impacted_by
from coordinator.pipeline.run import Run

__all__ = ["release_budgets"]

log = logging.getLogger("coordinator")


def release_budgets(run: Run) -> None:
    """The third step of every run's tail: frees the budget slots of the run's events that concluded, and of the
    approvals it withdrew. Best effort: a claim left behind (a crash here, or a conclusion by a path that does not
    pass here) lapses once its event no longer holds an approval."""
    run.enter("budgets")
    for event_id, key in run.work.releases:
        try:
            run.fleet.budgets.release(key, event_id)
        except Exception:  # the claim lapses by itself; the run's real work is done
            log.exception("budget of %s: releasing the claim of withdrawn %s failed", key, event_id)
    for event in run.work.records.values():
        if event.open or event.approval is None or event.returning:
            continue  # open, or VMs not back in service: their claims hold until the run that sees them back
        # Approvals from before budget domains name no keys: their claims were on their scale sets.
        keys = event.approval.budgetKeys or (
            sorted(impacted_by(event)) if budget_limit(run.policy, event.approval.rule) else []
        )
        if not keys:
            continue
        for key in keys:
            try:
                # Concluded: a sequence's gap runs from now on; a rate's approval counts until it ages out.
                done = event.returnToService.doneAt if event.returnToService is not None else None
                run.fleet.budgets.release(key, event.eventId, concluded_at=done or event.stateSince)
            except Exception:  # the claim lapses by itself; the batch's real work is done
                log.exception("budget of %s: releasing the claim of %s failed", key, event.eventId)
