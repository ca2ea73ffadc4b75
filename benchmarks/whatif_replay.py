"""python -m benchmarks.whatif_replay [--history PATH] [--copies N] — how long the what-if replay takes.

Takes a recorded history (default: the fleet demo's, .local/history.sqlite, from `bash scripts/local.sh`) and
repeats its events N times, each copy with its own EventIds and 10 minutes later than the one before; replays the
whole through the default policy and through the short-freeze-waits example. Prints one JSON object: rows, events,
decision points, differences and seconds per policy. Not in ``python -m benchmarks``: the README quotes no figure.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

from coordinator import DEFAULT_POLICY_PATH, load_policy
from ops.policy.exports import read_history
from ops.policy.replay import replay

EXAMPLE = DEFAULT_POLICY_PATH.parent / "examples" / "short-freeze-waits.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.whatif_replay", description=__doc__)
    parser.add_argument("--history", type=Path, default=Path(".local/history.sqlite"))
    parser.add_argument("--copies", type=int, default=100)
    args = parser.parse_args()
    recorded = read_history(args.history).rows
    rows = [
        row.model_copy(
            update={
                "EventId": f"{row.EventId}-{copy}" if row.EventId else "",
                "TimeGenerated": row.TimeGenerated + timedelta(minutes=10 * copy),
            }
        )
        for copy in range(args.copies)
        for row in recorded
    ]
    figures: dict[str, object] = {"rows": len(rows), "copies": args.copies}
    for name, path in (("default", DEFAULT_POLICY_PATH), ("short_freeze_waits", EXAMPLE)):
        started = time.perf_counter()
        result = replay(load_policy(path), rows)
        figures[f"{name}_seconds"] = round(time.perf_counter() - started, 3)
        figures[f"{name}_differences"] = len(result.differences)
        figures |= {"events": result.events, "decision_points": result.compared}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
