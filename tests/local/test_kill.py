"""The whole-stack kill test (issue 33): the coordinator's own process SIGKILLed three times at the seed's random
moments of a run whose eight events the policy approves at once, started again each time as a new instance. At
rest, the history holds every row the run must have (each sighting the forwarders sent, each approval's Decision and
intent rows, each event's transitions to the state the coordinator stored, each card's Alert row) once, and IMDS
took exactly one StartRequests per event. The 20-run figure: ``python -m local.kill --runs 20 --seed 100``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from local.kill import kill_run

# Another seed: KILL_TEST_SEED=N (each run prints its kill moments).
SEED = int(os.environ.get("KILL_TEST_SEED", "7"))


@pytest.mark.slow
def test_sigkill_of_the_coordinator_loses_no_row_doubles_none_and_approves_once(tmp_path: Path) -> None:
    verdict = kill_run(tmp_path / "run", seed=SEED, kills=3)
    assert verdict.kills == 3
    assert verdict.unsettled == [], "the run did not come to rest"
    assert verdict.lost == []
    assert verdict.doubled == []
    assert verdict.approved_twice == []
    assert verdict.never_approved == []
    assert verdict.events == 8
    # The answers the killed instances were awaiting are printed (verdict.line), not asserted: README, Not done yet.
