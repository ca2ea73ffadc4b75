"""The approval callback's Relay cost per VM per month, from the cost model's default assumed rates.

    .venv/bin/python -m benchmarks.callback_cost

Runs ``python -m ops.cost`` (its documented defaults: 4 events per VM per month, 15 minutes Scheduled each,
60 s grace, $0.0134 per listener-hour) and prints one JSON line: callback_cost_usd_per_vm_month (on-demand
listener), callback_cost_usd_per_vm_month_always_on, and the same with every connection billed as whole hours
(``_whole_hours``: partial-hour billing is not documented). A model, not a measurement: the figures move with
the assumptions, which docs/relay.md states.
"""

from __future__ import annotations

import contextlib
import io
import json

from ops.cost import main as cost


def report(*argv: str) -> dict[str, dict[str, float]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if cost(list(argv)) != 0:
            raise SystemExit(f"ops.cost {' '.join(argv)} failed")
    result: dict[str, dict[str, float]] = json.loads(out.getvalue())
    return result


def main() -> None:
    exact, whole = report(), report("--round-up-hours")
    print(
        json.dumps(
            {
                "callback_cost_usd_per_vm_month": exact["on_demand"]["usd_per_vm_month"],
                "callback_cost_usd_per_vm_month_always_on": exact["always_on"]["usd_per_vm_month"],
                "callback_cost_usd_per_vm_month_whole_hours": whole["on_demand"]["usd_per_vm_month"],
                "listener_hours_per_vm_month": exact["on_demand"]["listener_hours_per_vm_month"],
            }
        )
    )


if __name__ == "__main__":
    main()
