"""benchmarks.spool_replay: a real forwarder emptying its spool, and a replay that does not happen reported."""

from __future__ import annotations

from benchmarks import spool_replay


def test_a_small_spool_is_replayed_in_order() -> None:
    result = spool_replay.run(200)

    assert result["problems"] == []
    assert result["replayed"] == 200
    assert result["in_order"] is True
    assert result["spool_replay_per_s"] > 0


def test_envelopes_that_never_reach_event_hubs_are_problems() -> None:
    # The forwarder sends to a hub the emulator does not have: nothing is replayed, all of it stays spooled.
    result = spool_replay.run(50, extra_args=("--eventhub-name", "no-such-hub"), timeout=4)

    problems = result["problems"]
    assert any("50 of 50 spooled envelopes not replayed within 4 s" in problem for problem in problems), problems
    assert any("left in the spool" in problem for problem in problems), problems
