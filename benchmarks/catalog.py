"""What ``python -m benchmarks`` runs: the benchmarks (their arguments, full and quick) and the ratios between them,
each with its one meaning and its target (the figures the README's table shows: benchmarks/figures.py).

A ratio keeps the meaning written here. Changing what a ratio divides by is a new ratio with a new key, never the
same key made to pass (docs/changelog.md keeps the history of figures).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.wave_budgets import BUDGETS

__all__ = ["BENCHES", "RATIOS", "Bench", "Ratio"]


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    runs: int
    headline: dict[str, str]  # the benchmark's key -> the aggregated key ({vms}: 10k, 1k...)
    timeout: float
    group: str = ""
    quick_timeout: float = 240.0
    # Only in full runs: a run that only places another benchmark's figure in time (a default wave between two
    # kinds of budget) adds nothing to --quick's validity check.
    full_only: bool = False


@dataclass(frozen=True)
class Ratio:
    """``numerator``'s figure (the largest of it and the ``worst_of`` figures) ÷ (``factor`` × the sum of the
    ``denominator`` figures; none: 1), per round, then the median over rounds; met when ≤ target. Each figure is
    (benchmark, key). ``meaning`` is what the ratio says. With ``paired``, each of numerator and ``worst_of`` (in
    that order) has its own denominator figures instead, and the round's value is the largest of those quotients."""

    key: str
    numerator: tuple[str, str]
    denominator: tuple[tuple[str, str], ...]
    target: float
    meaning: str
    factor: float = 1.0
    worst_of: tuple[tuple[str, str], ...] = ()
    paired: tuple[tuple[tuple[str, str], ...], ...] = ()


# --- the benchmarks -----------------------------------------------------------------------------------------------
def _as_is(*keys: str) -> dict[str, str]:
    """A headline of figures kept under the benchmark's own keys."""
    return {key: key for key in keys}


_WAVE_HEADLINE = {
    "wave_seconds": "wave_{vms}_seconds",
    "busiest_partition_ops_per_s": "wave_{vms}_busiest_partition_ops_per_s",
}
_TERMINATE_HEADLINE = {"wave_seconds": "wave_{vms}_terminate_seconds"}


def _wave(
    name: str,
    *args: str,
    headline: dict[str, str],
    group: str,
    vms: int | None = None,
    quick_vms: int = 300,
    runs: int = 3,
    timeout: float = 900,
    quick_timeout: float = 240.0,
    full_only: bool = False,
) -> Bench:
    """A run of benchmarks/wave.py with ``args``, at ``vms`` VMs (None: the wave's 10,000), quick at ``quick_vms``."""
    full = (*(() if vms is None else ("--vms", str(vms))), *args)
    quick = ("--vms", str(quick_vms), *args)
    return Bench(name, "benchmarks.wave", full, quick, runs, headline, timeout, group, quick_timeout, full_only)


# The budget waves by kind, and the default waves run just after each kind and just before it: the one after the
# kind before (the first kind: the round's default wave).
_BUDGET_OF = {kind: f"wave_{kind.replace('-', '_')}" for kind in BUDGETS}
_BUDGET_WAVES = tuple(_BUDGET_OF.values())
_AFTER = {name: f"wave_after_{name.removeprefix('wave_')}" for name in _BUDGET_WAVES}
_BEFORE = dict(zip(_BUDGET_WAVES, ("wave", *(_AFTER[name] for name in _BUDGET_WAVES[:-1])), strict=True))


BENCHES = (
    Bench(
        "pipeline_latency",
        "benchmarks.pipeline_latency",
        ("--events", "300", "--vms", "10", "--spacing", "0.2", "0.4"),
        ("--events", "10"),
        3,
        _as_is("detect_to_approve_ms_p50", "detect_to_approve_ms_p99", "pipeline_added_ms_p99"),
        600,
        group="pipeline",
    ),
    Bench(
        "eventhub_hop",
        "benchmarks.eventhub_hop",
        ("--events", "300"),
        ("--events", "20"),
        3,
        _as_is("eventhub_hop_ms_p99"),
        300,
        group="pipeline",
    ),
    Bench(
        "hop",
        "benchmarks.hop",
        ("--n", "500"),
        ("--n", "20"),
        3,
        {"hop_ms_p50": "coordinator_hop_ms_p50", "hop_ms_p99": "coordinator_hop_ms_p99"},
        600,
        group="pipeline",
    ),
    Bench(
        "bare_hop",
        "benchmarks.bare_hop",
        ("--n", "300"),
        ("--n", "50"),
        3,
        {"hop_ms_p50": "coordinator_bare_hop_ms_p50", "hop_ms_p99": "coordinator_bare_hop_ms_p99"},
        300,
        group="pipeline",
    ),
    Bench(
        "approval_latency",
        "benchmarks.approval_latency",
        ("--n", "1000"),
        ("--n", "100"),
        3,
        _as_is("approval_ms_p50", "approval_ms_p99"),
        300,
        group="pipeline",
    ),
    Bench(
        "cold_listener",
        "benchmarks.cold_listener",
        ("--n", "20"),
        ("--n", "3"),
        1,
        _as_is("cold_listener_approval_ms_p50", "cold_listener_approval_ms_p99"),
        600,
    ),
    _wave("wave_census", "--policy", "census", headline={"wave_seconds": "wave_{vms}_census_seconds"}, group="wave"),
    _wave("wave_cold", "--bindings", "cold", headline={"wave_seconds": "wave_{vms}_cold_seconds"}, group="wave"),
    _wave("wave", "--replay", headline=_WAVE_HEADLINE, group="wave"),
    # The same wave under each kind of budget (benchmarks/wave_budgets.py), in turns with the default wave, and in
    # full runs the default wave again after each kind (wave_after_KIND): each kind then has a default wave just
    # before it and just after it. The kinds take six minutes of a round, and this machine's speed moves by a third
    # within minutes (the same default wave 4.9 s before the kinds and 7.7 s after them, medians of d799c7d's
    # record); against one default wave at the round's start, that drift landed on the later kinds alone.
    *(
        bench
        for kind, name in _BUDGET_OF.items()
        for bench in (
            _wave(name, "--policy", kind, headline={"wave_seconds": f"wave_{{vms}}_{kind}"}, group="wave"),
            _wave(_AFTER[name], headline={}, group="wave", full_only=True),
        )
    ),
    _wave("wave_terminate", "--event-type", "Terminate", headline=_TERMINATE_HEADLINE, group="terminate"),
    _wave(
        "wave_terminate_2x",
        "--event-type",
        "Terminate",
        vms=20000,
        quick_vms=600,
        headline=_TERMINATE_HEADLINE,
        timeout=1200,
        group="terminate",
    ),
    # Time per envelope at 10k, 50k and 100k VMs, run in turns (three rounds, as every ratio: about 22 minutes): flat
    # when the coordinator is linear.
    _wave(
        "wave_scale_10k",
        headline={"seconds_per_1k_envelopes": "wave_10k_seconds_per_1k_envelopes"},
        group="scale",
    ),
    _wave("wave_50k", vms=50000, quick_vms=500, headline=_WAVE_HEADLINE, timeout=2400, group="scale"),
    _wave(
        "wave_100k",
        vms=100000,
        quick_vms=1000,
        headline={
            **_WAVE_HEADLINE,
            "tick_seconds": "tick_{vms}_first_seconds",
            "tick_again_seconds": "tick_{vms}_seconds",
        },
        timeout=3600,
        group="scale",
        quick_timeout=400,
    ),
    # A dead-letter storm (no envelope attested) at 10k and 50k VMs, run in turns, three rounds: linear when the dead
    # letters spread over partitions (in one, Azurite scans it per write and Azure caps it at ~2,000 operations/s).
    _wave(
        "dead_letters_10k",
        "--storm",
        headline={"seconds_per_1k_envelopes": "dead_letters_10k_seconds_per_1k_envelopes"},
        group="storm",
    ),
    _wave(
        "dead_letters_50k",
        "--storm",
        vms=50000,
        quick_vms=500,
        headline={
            "wave_seconds": "dead_letters_50k_seconds",
            "dead_letter_busiest_partition_ops_per_s": "dead_letters_50k_busiest_partition_ops_per_s",
        },
        timeout=1800,
        group="storm",
    ),
    Bench(
        "forwarder_footprint",
        "benchmarks.forwarder_footprint",
        ("--seconds", "120", "--warmup", "10", "--sink", "eventhub"),
        ("--seconds", "15", "--warmup", "5", "--sink", "eventhub"),
        3,
        _as_is(
            "forwarder_rss_mib",
            "forwarder_cpu_s_per_hour",
            "forwarder_rss_ratio_to_bare_poller",
            "forwarder_cpu_ratio_to_bare_poller",
        ),
        400,
    ),
    Bench(
        "spool_replay",
        "benchmarks.spool_replay",
        ("--envelopes", "5000"),
        ("--envelopes", "1000"),
        3,
        _as_is("spool_replay_per_s"),
        300,
    ),
    Bench(
        "dead_listeners",
        "benchmarks.dead_listeners",
        ("--events", "40"),
        ("--events", "8"),
        3,
        {
            "detect_to_approve_ms_p50": "dead_listeners_approval_ms_p50",
            "detect_to_approve_ms_p99": "dead_listeners_approval_ms_p99",
            "live_missed": "dead_listeners_missed",
        },
        300,
    ),
    Bench(
        "callback_cost",
        "benchmarks.callback_cost",
        (),
        (),
        1,
        _as_is("callback_cost_usd_per_vm_month", "callback_cost_usd_per_vm_month_always_on"),
        60,
    ),
)


# --- the ratios ---------------------------------------------------------------------------------------------------
RATIOS = (
    Ratio(
        "wave_10k_over_raw_replay",
        ("wave", "wave_over_replay"),
        (),
        3.0,
        "the 10k wave as shipped (attested, census, bindings warm) ÷ the same Table writes replayed by "
        "benchmarks/table_ops.py's replay against the same Azurite, through the store's own $batch transport "
        "(coordinator/state/table_batch.py; not yet a raw socket client)",
    ),
    Ratio(
        "wave_10k_cold_over_warm",
        ("wave_cold", "wave_seconds"),
        (("wave", "wave_seconds"),),
        1.3,
        "the 10k wave whose VMs were never bound (each VM's first attested envelope binds it) ÷ the same wave with "
        "every VM bound and known to the instance",
    ),
    Ratio(
        "wave_10k_census_over_default",
        ("wave_census", "wave_seconds"),
        (("wave", "wave_seconds"),),
        1.2,
        "the 10k wave under a policy that reads the census (a tag rule, percent budgets per scale set, zone and "
        "update domain) ÷ the default policy; both with ARM's census configured as deployed",
    ),
    Ratio(
        "wave_10k_budget_over_default",
        (_BUDGET_WAVES[0], "wave_seconds"),
        (("wave", "wave_seconds"),),
        1.2,
        "the 10k wave under the slowest of eight kinds of budget that approve part of it (tags, percent, zone, fault "
        "and update domain, placement group, rate, sequence; the approvals delivered to stand-ins for the VMs' "
        "listeners in processes of their own: benchmarks/wave_budgets.py) ÷ the default policy's, in turns",
        worst_of=tuple((name, "wave_seconds") for name in _BUDGET_WAVES[1:]),
    ),
    Ratio(
        "wave_10k_budget_over_adjacent_default",
        (_BUDGET_WAVES[0], "wave_seconds"),
        (),
        1.2,
        "the same eight kinds of budget, each ÷ the mean of the default waves run just before it and just after it "
        "in the round; the largest of the eight quotients",
        factor=0.5,
        worst_of=tuple((name, "wave_seconds") for name in _BUDGET_WAVES[1:]),
        paired=tuple(((_BEFORE[name], "wave_seconds"), (_AFTER[name], "wave_seconds")) for name in _BUDGET_WAVES),
    ),
    Ratio(
        "wave_terminate_20k_over_2x10k",
        ("wave_terminate_2x", "wave_seconds"),
        (("wave_terminate", "wave_seconds"),),
        1.1,
        "a Terminate wave of 20k VMs ÷ twice a Terminate wave of 10k (delete coupling stays linear)",
        factor=2.0,
    ),
    Ratio(
        "wave_terminate_20k_over_2x10k_cpu",
        ("wave_terminate_2x", "coordinator_cpu_seconds"),
        (("wave_terminate", "coordinator_cpu_seconds"),),
        1.1,
        "the same in the coordinator's own CPU seconds (Azurite's operations cost more as its table grows)",
        factor=2.0,
    ),
    Ratio(
        "wave_50k_per_envelope_over_10k",
        ("wave_50k", "seconds_per_1k_envelopes"),
        (("wave_scale_10k", "seconds_per_1k_envelopes"),),
        1.2,
        "wall time per envelope of a 50k-VM wave ÷ of a 10k-VM wave, run in turns",
    ),
    Ratio(
        "wave_100k_per_envelope_over_10k",
        ("wave_100k", "seconds_per_1k_envelopes"),
        (("wave_scale_10k", "seconds_per_1k_envelopes"),),
        1.2,
        "wall time per envelope of a 100k-VM wave ÷ of a 10k-VM wave, run in turns",
    ),
    Ratio(
        "wave_100k_cpu_per_envelope_over_10k",
        ("wave_100k", "coordinator_cpu_seconds_per_1k_envelopes"),
        (("wave_scale_10k", "coordinator_cpu_seconds_per_1k_envelopes"),),
        1.2,
        "the coordinator's CPU per envelope at 100k VMs ÷ at 10k",
    ),
    Ratio(
        "dead_letters_50k_per_envelope_over_10k",
        ("dead_letters_50k", "seconds_per_1k_envelopes"),
        (("dead_letters_10k", "seconds_per_1k_envelopes"),),
        1.2,
        "wall time per envelope of a dead-letter storm of 50k VMs ÷ of 10k VMs (every envelope unattested), in turns",
    ),
    Ratio(
        "coordinator_hop_over_conditional_write",
        ("hop", "hop_over_conditional_write"),
        (),
        2.5,
        "the coordinator's hop (an envelope's batch reaching it to its approval leaving) on events going through "
        "the whole stack as shipped (attestation, tracing, the real Relay callback) ÷ one If-Match write, p50 "
        "÷ p50, in one run",
    ),
    Ratio(
        "pipeline_added_p99_over_bare_hops_p99",
        ("pipeline_latency", "pipeline_added_ms_p99"),
        (
            ("eventhub_hop", "eventhub_hop_ms_p99"),
            ("bare_hop", "hop_ms_p99"),
            ("approval_latency", "approval_ms_p99"),
        ),
        1.5,
        "the pipeline's added p99 (forwarder's observedAt → StartRequests recorded) ÷ the sum of its bare hops' p99: "
        "Event Hubs (eventhub_hop), the coordinator alone (bare_hop: attested, a stand-in callback), Relay to a "
        "CONNECTED listener (approval_latency). An "
        "on-demand listener's connect is part of what the pipeline adds, not of the bare hop",
    ),
)


# --- the README's figures -----------------------------------------------------------------------------------------
