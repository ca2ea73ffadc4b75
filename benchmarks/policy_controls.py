"""python -m benchmarks.policy_controls — what the fleet controls cost one decision, pure (no I/O): a policy with a
blackout, a tag rule, a window and a percent budget per scale set, zone and update domain, evaluated for 200 events
against a census of 100, 1,000 and 5,000 VMs (5 % impacted). Prints one JSON object: milliseconds per decision by
census size. A percent budget counts each domain's known VMs, so the cost grows with the census."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

from coordinator import EventRecord, FleetView, VmFacts, evaluate, parse_policy

NOW = datetime(2026, 11, 18, 10, tzinfo=UTC)  # inside the window (11:00 in Oslo), outside the blackout
POLICY = parse_policy(
    """
blackouts: [{name: new-year, schedule: "0 0 1 1 *", duration: 1h, timeZone: Europe/Oslo}]
rules:
  - {name: manual, match: {tags: {scheduled-events: manual}}, action: wait-for-person}
  - name: paced
    match: {eventType: [Reboot]}
    action: approve-within-budget
    budget: {maxPercent: 10, per: [scaleSet, zone, updateDomain]}
    window: {schedule: "0 8 * * *", duration: 10h, timeZone: Europe/Oslo}
"""
)


def per_decision_ms(vms: int, events: int = 200) -> float:
    census = {
        f"web_{i}": VmFacts(
            scaleSet=f"ss{i % 10}", zone=str(i % 3 + 1), location="westeurope", updateDomain=str(i % 5), tags={"t": "x"}
        )
        for i in range(vms)
    }
    fleet = FleetView(vms=census, impactedVms=frozenset(list(census)[: vms // 20]))
    records = [
        EventRecord(
            eventId=f"E{i}",
            eventType="Reboot",
            resources=[f"web_{i}"],
            notBefore=NOW + timedelta(minutes=15),
            stateSince=NOW,
            createdAt=NOW,
        )
        for i in range(events)
    ]
    started = time.perf_counter()
    for record in records:
        evaluate(POLICY, record, fleet, NOW)
    return (time.perf_counter() - started) / events * 1000


def main() -> None:
    print(json.dumps({f"decision_ms_census_{n}": round(per_decision_ms(n), 2) for n in (100, 1000, 5000)}))


if __name__ == "__main__":
    main()
