"""python -m benchmarks [--quick] [--only NAME ...] — every figure the README quotes, as ONE JSON object.

Runs each benchmark module in its own process (one after another: the machine is small and shared), several times,
and reports the median of each figure over the runs. ``--quick`` makes every run short and runs it once: a smoke
check of the numbers, not the numbers themselves.

Headline keys: detect_to_approve_ms_p50/p99 and pipeline_added_ms_p99 (pipeline_latency), wave_10k_seconds
(wave; wave_<N>_seconds when --quick uses fewer VMs), forwarder_rss_mib and forwarder_cpu_s_per_hour
(forwarder_footprint: tracing off, listener idle, sending through the Event Hubs emulator's REST API),
spool_replay_per_s (spool_replay), approval_ms_p50/p99 (approval_latency), forwarder_rss_ratio_to_bare_poller and
forwarder_cpu_ratio_to_bare_poller (forwarder_footprint, beside a bare `requests` poller in the same run: the worst of
tracing off and on, listener idle and connected), cold_listener_approval_ms_p50/p99 (an
approval sent as the forwarder sees the event, its on-demand listener not yet connected: cold_listener),
dead_listeners_approval_ms_p50/p99 and dead_listeners_missed (the whole pipeline with one VM in ten whose listener
never answers: the other VMs' approvals, dead_listeners), callback_cost_usd_per_vm_month and
callback_cost_usd_per_vm_month_always_on (the cost model's default rates:
callback_cost). ``details`` holds every figure of every benchmark; ``errors`` names any
benchmark that failed (the exit code is then 1).

Ratios (issue 23), each the median over rounds of the ratio within one round, with its target in ``ratios``:
wave_10k_over_raw_replay (the wave ÷ the same Table writes replayed raw), wave_10k_census_over_default (the wave
under a census policy ÷ the default policy), wave_terminate_20k_over_2x10k (a Terminate wave of 20k ÷ twice 10k),
coordinator_hop_over_conditional_write (a batch's arrival to its approval leaving ÷ one If-Match write, p50: hop),
pipeline_added_p99_over_bare_hops_p99 (pipeline_latency's pipeline_added p99 ÷ the sum of the p99s of its hops run
bare: eventhub_hop, hop, cold_listener: the pipeline's listeners connect on demand), wave_50k_per_envelope_over_10k
and wave_100k_per_envelope_over_10k (time per envelope at 50k and 100k VMs ÷ at 10k: flat within 20% when linear;
the same in the coordinator's own CPU: wave_100k_cpu_per_envelope_over_10k, wave_terminate_20k_over_2x10k_cpu).
The 100k wave also gives the
timer's tick at 100k VMs (tick_100k_seconds: the warm tick, what changed since the last one; tick_100k_first_seconds:
the first tick of an instance, which loads every VM once) and the busiest Table partition's rate.
Benchmarks of one group run in turns (one run of each, then the next round), so that a ratio between them is taken
under the same load of this shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    runs: int
    headline: dict[str, str]  # the benchmark's key -> the aggregated key
    timeout: float
    group: str = ""


@dataclass(frozen=True)
class Ratio:
    """``numerator``'s figure ÷ (``factor`` × the sum of the ``denominator`` figures; none: 1), per round, then the
    median; met when ≤ target. Each figure is (benchmark, key)."""

    key: str
    numerator: tuple[str, str]
    denominator: tuple[tuple[str, str], ...]
    target: float
    factor: float = 1.0


BENCHES = (
    Bench(
        "pipeline_latency",
        "benchmarks.pipeline_latency",
        ("--events", "300", "--vms", "10", "--spacing", "0.2", "0.4"),
        ("--events", "10"),
        3,
        {
            "detect_to_approve_ms_p50": "detect_to_approve_ms_p50",
            "detect_to_approve_ms_p99": "detect_to_approve_ms_p99",
            "pipeline_added_ms_p99": "pipeline_added_ms_p99",
        },
        600,
        group="pipeline",
    ),
    Bench(
        "eventhub_hop",
        "benchmarks.eventhub_hop",
        ("--events", "300"),
        ("--events", "50"),
        3,
        {"eventhub_hop_ms_p99": "eventhub_hop_ms_p99"},
        300,
        group="pipeline",
    ),
    Bench(
        "wave",
        "benchmarks.wave",
        ("--replay",),
        ("--vms", "1000", "--replay"),
        3,
        {"wave_seconds": "wave_{vms}_seconds", "busiest_partition_ops_per_s": "wave_{vms}_busiest_partition_ops_per_s"},
        600,
        group="wave",
    ),
    Bench(
        "wave_census",
        "benchmarks.wave",
        ("--policy", "census"),
        ("--vms", "1000", "--policy", "census"),
        3,
        {"wave_seconds": "wave_{vms}_census_seconds"},
        600,
        group="wave",
    ),
    Bench(
        "wave_terminate",
        "benchmarks.wave",
        ("--event-type", "Terminate"),
        ("--vms", "1000", "--event-type", "Terminate"),
        3,
        {"wave_seconds": "wave_{vms}_terminate_seconds"},
        600,
        group="terminate",
    ),
    Bench(
        "wave_terminate_2x",
        "benchmarks.wave",
        ("--event-type", "Terminate", "--vms", "20000"),
        ("--vms", "2000", "--event-type", "Terminate"),
        3,
        {"wave_seconds": "wave_{vms}_terminate_seconds"},
        900,
        group="terminate",
    ),
    # Time per envelope at 10k, 50k and 100k VMs, run in turns once each: flat when the coordinator is linear.
    Bench(
        "wave_scale_10k",
        "benchmarks.wave",
        (),
        ("--vms", "1000"),
        1,
        {"seconds_per_1k_envelopes": "wave_10k_seconds_per_1k_envelopes"},
        900,
        group="scale",
    ),
    Bench(
        "wave_50k",
        "benchmarks.wave",
        ("--vms", "50000"),
        ("--vms", "2000"),
        1,
        {"wave_seconds": "wave_{vms}_seconds", "busiest_partition_ops_per_s": "wave_{vms}_busiest_partition_ops_per_s"},
        1800,
        group="scale",
    ),
    Bench(
        "wave_100k",
        "benchmarks.wave",
        ("--vms", "100000"),
        ("--vms", "4000"),
        1,
        {
            "wave_seconds": "wave_{vms}_seconds",
            "busiest_partition_ops_per_s": "wave_{vms}_busiest_partition_ops_per_s",
            "tick_seconds": "tick_{vms}_first_seconds",
            "tick_again_seconds": "tick_{vms}_seconds",
        },
        3600,
        group="scale",
    ),
    Bench(
        "hop",
        "benchmarks.hop",
        ("--n", "500"),
        ("--n", "100"),
        3,
        {"hop_ms_p50": "coordinator_hop_ms_p50", "hop_ms_p99": "coordinator_hop_ms_p99"},
        300,
        group="pipeline",
    ),
    Bench(
        "forwarder_footprint",
        "benchmarks.forwarder_footprint",
        ("--seconds", "120", "--warmup", "10", "--sink", "eventhub"),
        ("--seconds", "15", "--warmup", "5", "--sink", "eventhub"),
        1,
        {
            "forwarder_rss_mib": "forwarder_rss_mib",
            "forwarder_cpu_s_per_hour": "forwarder_cpu_s_per_hour",
            "forwarder_rss_ratio_to_bare_poller": "forwarder_rss_ratio_to_bare_poller",
            "forwarder_cpu_ratio_to_bare_poller": "forwarder_cpu_ratio_to_bare_poller",
        },
        400,
    ),
    Bench(
        "spool_replay",
        "benchmarks.spool_replay",
        ("--envelopes", "5000"),
        ("--envelopes", "1000"),
        3,
        {"spool_replay_per_s": "spool_replay_per_s"},
        300,
    ),
    Bench(
        "approval_latency",
        "benchmarks.approval_latency",
        ("--n", "1000"),
        ("--n", "100"),
        3,
        {"approval_ms_p50": "approval_ms_p50", "approval_ms_p99": "approval_ms_p99"},
        300,
        group="pipeline",
    ),
    Bench(
        "cold_listener",
        "benchmarks.cold_listener",
        ("--n", "20"),
        ("--n", "5"),
        1,
        {
            "cold_listener_approval_ms_p50": "cold_listener_approval_ms_p50",
            "cold_listener_approval_ms_p99": "cold_listener_approval_ms_p99",
        },
        600,
        group="pipeline",
    ),
    Bench(
        "dead_listeners",
        "benchmarks.dead_listeners",
        ("--events", "40"),
        ("--events", "12"),
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
        {
            "callback_cost_usd_per_vm_month": "callback_cost_usd_per_vm_month",
            "callback_cost_usd_per_vm_month_always_on": "callback_cost_usd_per_vm_month_always_on",
        },
        60,
    ),
)


RATIOS = (
    Ratio("wave_10k_over_raw_replay", ("wave", "wave_over_replay"), (), 3.0),
    Ratio("coordinator_hop_over_conditional_write", ("hop", "hop_over_conditional_write"), (), 2.5),
    Ratio("wave_10k_census_over_default", ("wave_census", "wave_seconds"), (("wave", "wave_seconds"),), 1.2),
    Ratio(
        "wave_terminate_20k_over_2x10k",
        ("wave_terminate_2x", "wave_seconds"),
        (("wave_terminate", "wave_seconds"),),
        1.1,
        factor=2.0,
    ),
    Ratio(
        "wave_50k_per_envelope_over_10k",
        ("wave_50k", "seconds_per_1k_envelopes"),
        (("wave_scale_10k", "seconds_per_1k_envelopes"),),
        1.2,
    ),
    Ratio(
        "wave_100k_per_envelope_over_10k",
        ("wave_100k", "seconds_per_1k_envelopes"),
        (("wave_scale_10k", "seconds_per_1k_envelopes"),),
        1.2,
    ),
    # The same in the coordinator's own CPU time, apart from Azurite, whose operations cost more as its table grows
    # (a 14-key query 3.4 ms at 1,000 entities, 15 ms at 20,000; a transaction of 20, 18 ms and 47 ms).
    Ratio(
        "wave_terminate_20k_over_2x10k_cpu",
        ("wave_terminate_2x", "coordinator_cpu_seconds"),
        (("wave_terminate", "coordinator_cpu_seconds"),),
        1.1,
        factor=2.0,
    ),
    Ratio(
        "wave_100k_cpu_per_envelope_over_10k",
        ("wave_100k", "coordinator_cpu_seconds_per_1k_envelopes"),
        (("wave_scale_10k", "coordinator_cpu_seconds_per_1k_envelopes"),),
        1.2,
    ),
    # The pipeline's added p99 against its hops' p99 measured bare: Event Hubs, the coordinator, the Relay approval to
    # a listener connected on demand, as the pipeline's are (cold_listener; approval_latency's listener is always on).
    Ratio(
        "pipeline_added_p99_over_bare_hops_p99",
        ("pipeline_latency", "pipeline_added_ms_p99"),
        (
            ("eventhub_hop", "eventhub_hop_ms_p99"),
            ("hop", "hop_ms_p99"),
            ("cold_listener", "cold_listener_approval_ms_p99"),
        ),
        1.5,
    ),
)


def ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each ratio whose benchmarks ran: per round (the i-th run of each), then the median."""
    out: dict[str, dict[str, Any]] = {}
    for ratio in RATIOS:
        rounds = min([len(runs.get(name, [])) for name, _ in (ratio.numerator, *ratio.denominator)])
        values = []
        for i in range(rounds):
            value = runs[ratio.numerator[0]][i].get(ratio.numerator[1])
            parts = [runs[name][i].get(key) for name, key in ratio.denominator]
            numbers = [float(p) for p in parts if isinstance(p, int | float)]
            if not isinstance(value, int | float) or len(numbers) < len(parts):
                continue
            base = sum(numbers) if numbers else 1.0
            if base:
                values.append(value / (ratio.factor * base))
        if values:
            median = round(statistics.median(values), 3)
            out[ratio.key] = {"value": median, "target": ratio.target, "met": median <= ratio.target, "rounds": values}
    return out


def run_once(bench: Bench, *, quick: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", bench.module, *(bench.quick if quick else bench.full)]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=bench.timeout, check=False)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(command[1:])} exited {completed.returncode}: {completed.stderr.strip()[-600:] or 'no JSON'}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers: the median over the runs; anything else: the last run's value."""
    merged: dict[str, Any] = {}
    for key in runs[-1]:
        values = [run.get(key) for run in runs]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        merged[key] = round(statistics.median(numbers), 3) if len(numbers) == len(values) else values[-1]
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, once each (a smoke check)")
    parser.add_argument("--only", action="append", choices=[b.name for b in BENCHES], help="run just these")
    parser.add_argument("--runs", type=int, default=None, help="override the number of runs per benchmark")
    args = parser.parse_args(argv)
    output: dict[str, Any] = {"quick": args.quick}
    details: dict[str, Any] = {}
    errors: dict[str, str] = {}
    started = time.monotonic()
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    runs_of: dict[str, list[dict[str, Any]]] = {b.name: [] for b in chosen}
    done: set[str] = set()
    for bench in chosen:
        if bench.name in done:
            continue
        # The benchmarks of its group, in turns: round 1 of each, then round 2...
        turn = [b for b in chosen if b.group and b.group == bench.group] or [bench]
        rounds = 1 if args.quick else (args.runs or max(b.runs for b in turn))
        for _ in range(rounds):
            for member in turn:
                if member.name in errors:
                    continue
                try:
                    runs_of[member.name].append(run_once(member, quick=args.quick))
                except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
                    errors[member.name] = str(error)
                    print(f"benchmarks: {member.name} failed: {error}", file=sys.stderr)
        done.update(b.name for b in turn)
    for bench in chosen:
        results = runs_of[bench.name]
        if not results:
            continue
        merged = median_of(results)
        merged["runs"] = len(results)
        details[bench.name] = merged
        for source, target in bench.headline.items():
            vms = merged.get("wave_envelopes", 10_000)
            name = target.format(vms=f"{vms // 1000}k" if vms % 1000 == 0 else str(vms))
            output[name] = merged.get(source)
    output["ratios"] = ratios(runs_of)
    for key, ratio in output["ratios"].items():
        output[key] = ratio["value"]
    output["details"] = details
    output["errors"] = errors
    output["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(output, sort_keys=True))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
