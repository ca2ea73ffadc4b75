"""benchmarks.eventhub_hop: a forwarder's send to the trigger's call, and events that never arrive reported.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

import json
from typing import Any

import azure.functions as func
import pytest

from benchmarks import eventhub_hop
from local.runner import FunctionHost


@pytest.mark.slow
def test_an_event_the_function_never_gets_is_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    class Dropping(FunctionHost):
        """A host whose function never sees event 2."""

        def __init__(self, *, ingest: Any, **options: Any) -> None:
            def dropping(batch: list[func.EventHubEvent]) -> None:
                ingest([event for event in batch if json.loads(event.get_body()).get("n") != 2])

            super().__init__(ingest=dropping, **options)

    monkeypatch.setattr(eventhub_hop, "FunctionHost", Dropping)
    monkeypatch.setattr(eventhub_hop, "ARRIVAL_WAIT", 2.0)  # it will not come

    result = eventhub_hop.run(4, 2, 7)

    problems = result["problems"]
    assert any("1 events sent never reached the function: 2" in p for p in problems), problems
    assert result["missed"] == 1
