"""benchmarks.pipeline_latency: detect-to-approve through the whole local stack, and a run whose listeners are not on
demand reported as a problem.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import pipeline_latency
from local.forwarders import ForwarderProcess
from local.stack import LocalStack


@pytest.mark.slow
def test_always_on_listeners_are_not_the_pipeline_s(monkeypatch: pytest.MonkeyPatch) -> None:
    forwarder = LocalStack._forwarder

    def always_on(self: LocalStack, vm: Any) -> ForwarderProcess:
        process = forwarder(self, vm)
        process._command += ["--relay-listener-mode", "always-on"]
        return process

    monkeypatch.setattr(LocalStack, "_forwarder", always_on)

    result = pipeline_latency.run(events=1, vms=2, seed=7, spacing=(0.5, 0.8))

    assert any("connected before any event (not on demand)" in p for p in result["problems"]), result["problems"]
