"""benchmarks.forwarder_footprint: real forwarders beside a bare poller, and a listener in another mode than its
configuration's reported as a problem.

A short valid run of the benchmark is `python -m benchmarks --quick`'s (the test command runs it, and fails on
any problem it names); here, what must make a run invalid."""

from __future__ import annotations

import argparse
import os
import threading
import time

import pytest

from benchmarks import forwarder_footprint

SHORT = argparse.Namespace(seconds=6.0, warmup=3.0, sink="eventhub", auth="imds", event_every=0.0)
IDLE_AND_CONNECTED = {suffix: forwarder_footprint.CONFIGURATIONS[suffix] for suffix in ("", "_connected")}


@pytest.mark.slow
def test_a_connected_configuration_whose_listener_is_on_demand_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarder_footprint, "LISTENER_MODES", {"idle": "on-demand", "connected": "on-demand"})

    result = forwarder_footprint.measure(SHORT, IDLE_AND_CONNECTED)

    problems = result["problems"]
    assert any("forwarder_connected: its listener was not connected" in p for p in problems), problems


def test_cpu_is_the_threads_run_time_to_the_nanosecond_with_a_thread_that_ended_counted() -> None:
    burned, release = threading.Event(), threading.Event()

    def burn() -> None:  # 30 ms of CPU, then wait to be let go (its CPU sampled meanwhile), then end
        begun = time.thread_time()
        while time.thread_time() - begun < 0.03:
            pass
        burned.set()
        release.wait(10)

    meter = forwarder_footprint.CpuMeter(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    assert burned.wait(10)
    meter.sample()
    release.set()
    worker.join()
    # join returns once Python is done with the thread; the kernel's task may linger a moment after it.
    gone = time.monotonic() + 10
    while worker.native_id in forwarder_footprint.thread_cpu_ns(os.getpid()) and time.monotonic() < gone:
        time.sleep(0.001)
    meter.sample()

    assert meter.ended == 1
    assert 0.03 <= meter.seconds() < 5


def test_a_thread_s_cpu_time_is_finer_than_a_clock_tick() -> None:
    me = threading.get_native_id()
    before = forwarder_footprint.thread_cpu_ns(os.getpid())[me]
    begun = time.thread_time()
    while time.thread_time() - begun < 0.002:  # 2 ms, a fifth of a tick
        pass
    spent = forwarder_footprint.thread_cpu_ns(os.getpid())[me] - before

    assert 1_500_000 <= spent < 9_000_000
