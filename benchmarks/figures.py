"""The figures the README's table shows (``python -m benchmarks --record``, benchmarks/results.py), each with its one
meaning, its unit and its target: the headline figures, then every ratio of benchmarks/catalog.py.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.catalog import RATIOS

__all__ = ["FIGURES", "Figure", "Target"]


_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "≤": operator.le,
    "=": operator.eq,
    "≥": operator.ge,
}


@dataclass(frozen=True)
class Target:
    op: str
    value: float

    def met(self, measured: float) -> bool:
        return _COMPARE[self.op](measured, self.value)

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass(frozen=True)
class Figure:
    """One row of the README's figures: the key in the output, what it measures, its unit, its target (None: none)."""

    key: str
    what: str
    unit: str
    target: Target | None = None


FIGURES = (
    Figure(
        "detect_to_approve_ms_p99",
        "IMDS change → approval recorded by IMDS, whole local pipeline at 1 poll/s, listeners on demand (p99)",
        "ms",
        Target("<", 1200),
    ),
    Figure(
        "pipeline_added_ms_p99",
        "the same minus the poll wait: the forwarder's observedAt → approval recorded (p99)",
        "ms",
        Target("<", 150),
    ),
    Figure(
        "wave_10k_seconds",
        "10,000-VM wave (500 events), attested envelopes, ARM's census, bindings warm, batches of 200, Azurite",
        "s",
        Target("<", 10),
    ),
    Figure("wave_10k_cold_seconds", "the same wave, no VM bound before it", "s"),
    Figure("wave_10k_census_seconds", "the same wave under a census policy", "s"),
    Figure("wave_100k_seconds", "100,000-VM wave (5,000 events), as the 10k wave", "s"),
    Figure(
        "wave_100k_busiest_partition_ops_per_s",
        "the 100k wave's busiest Table partition (entity operations per second)",
        "ops/s",
        Target("<", 2000),
    ),
    Figure("dead_letters_50k_seconds", "a dead-letter storm: 50,000 VMs' envelopes, none attested, all refused", "s"),
    Figure(
        "dead_letters_50k_busiest_partition_ops_per_s",
        "the storm's busiest dead-letter partition (entity operations per second)",
        "ops/s",
        Target("<", 2000),
    ),
    Figure("tick_100k_seconds", "the timer's tick at 100,000 VMs (warm: what changed since the last)", "s"),
    Figure("tick_100k_first_seconds", "an instance's first tick at 100,000 VMs (loads every VM once)", "s"),
    Figure("coordinator_hop_ms_p50", "the coordinator's hop in the whole stack (p50)", "ms"),
    Figure("coordinator_bare_hop_ms_p99", "the coordinator's hop alone: attested batch → callback called (p99)", "ms"),
    Figure(
        "approval_ms_p99",
        "decision → approval recorded by IMDS through Relay, connected listener (p99)",
        "ms",
        Target("<", 50),
    ),
    Figure(
        "cold_listener_approval_ms_p99",
        "approval to a VM whose on-demand listener is not yet connected (p99)",
        "ms",
        Target("≤", 2000),
    ),
    Figure(
        "eventhub_hop_ms_p99", "forwarder's send through Event Hubs (REST, managed identity) to the trigger (p99)", "ms"
    ),
    Figure(
        "dead_listeners_approval_ms_p99",
        "IMDS change → approval with one VM in ten whose listener never answers: the others' events (p99)",
        "ms",
    ),
    Figure(
        "dead_listeners_missed", "events of live VMs not approved in time beside dead listeners", "", Target("=", 0)
    ),
    Figure(
        "forwarder_rss_ratio_to_bare_poller",
        "forwarder RSS ÷ a bare requests poller in the same run (worst of tracing off/on, listener idle/connected)",
        "×",
        Target("≤", 1.0),
    ),
    Figure(
        "forwarder_cpu_ratio_to_bare_poller", "forwarder CPU ÷ the bare poller's, the same way", "×", Target("≤", 0.5)
    ),
    Figure("spool_replay_per_s", "spool replay after an outage, in order", "envelopes/s"),
    Figure(
        "callback_cost_usd_per_vm_month",
        "Relay listener cost per VM-month, on demand, the cost model's default rates",
        "$",
        Target("≤", 0.10),
    ),
    *(Figure(r.key, r.meaning, "×", Target("≤", r.target)) for r in RATIOS),
)
