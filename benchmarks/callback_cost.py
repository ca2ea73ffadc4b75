"""The approval callback's Relay cost per VM per month, from the cost model's default assumed rates.

    .venv/bin/python -m benchmarks.callback_cost

Runs ``python -m ops.cost`` (its documented defaults: 4 events per VM per month, 15 minutes Scheduled each,
60 s grace, $0.0134 per listener-hour) and prints one JSON line: callback_cost_usd_per_vm_month (on-demand
listener), callback_cost_usd_per_vm_month_always_on, and the same with every connection billed as whole hours
(``_whole_hours``: partial-hour billing is not documented). A model, not a measurement: the figures move with
the assumptions, which docs/relay.md states.

``problems`` (exit 1 when not empty): ops.cost failing or giving no figure, a figure not a positive number, the model
contradicting itself (on demand dearer than always-on, whole hours cheaper than exact ones).
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from benchmarks.checks import finish
from ops.cost import main as cost


def report(*argv: str) -> tuple[dict[str, dict[str, float]], str]:
    """ops.cost's JSON, or why there is none."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cost(list(argv))
        except SystemExit as stop:  # its argument parser refused the arguments
            code = stop.code if isinstance(stop.code, int) else 2
    if code != 0:
        return {}, f"ops.cost {' '.join(argv)} exited {code}"
    try:
        result: dict[str, dict[str, float]] = json.loads(out.getvalue())
    except ValueError as error:
        return {}, f"ops.cost {' '.join(argv)} printed no JSON: {error}"
    return result, ""


def figure(model: dict[str, dict[str, float]], listener: str, key: str, problems: list[str]) -> float | None:
    value = model.get(listener, {}).get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        problems.append(f"ops.cost gave no positive {listener}.{key}: {value!r}")
        return None
    return float(value)


def run(*argv: str) -> dict[str, Any]:
    """``argv``: ops.cost's arguments beside the defaults (tests)."""
    problems: list[str] = []
    exact, why = report(*argv)
    whole, why_whole = report(*argv, "--round-up-hours")
    problems += [reason for reason in (why, why_whole) if reason]
    result: dict[str, Any] = {
        "callback_cost_usd_per_vm_month": figure(exact, "on_demand", "usd_per_vm_month", problems),
        "callback_cost_usd_per_vm_month_always_on": figure(exact, "always_on", "usd_per_vm_month", problems),
        "callback_cost_usd_per_vm_month_whole_hours": figure(whole, "on_demand", "usd_per_vm_month", problems),
        "listener_hours_per_vm_month": figure(exact, "on_demand", "listener_hours_per_vm_month", problems),
    }
    on_demand, always_on = result["callback_cost_usd_per_vm_month"], result["callback_cost_usd_per_vm_month_always_on"]
    whole_hours = result["callback_cost_usd_per_vm_month_whole_hours"]
    if on_demand is not None and always_on is not None and on_demand > always_on:
        problems.append(f"the on-demand listener costs more than an always-on one ({on_demand} > {always_on})")
    if on_demand is not None and whole_hours is not None and whole_hours < on_demand:
        problems.append(f"billing whole hours costs less than exact ones ({whole_hours} < {on_demand})")
    return result | {"problems": problems}


def main(argv: list[str] | None = None) -> int:
    return finish(lambda: run(*(argv or [])))


if __name__ == "__main__":
    raise SystemExit(main())
