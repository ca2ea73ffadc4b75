"""Fault injection for the IMDS emulator: which request gets delayed, hung, failed, garbled or throttled.

Pure bookkeeping: given (VM, endpoint, now) it decides what to do with one request; the HTTP layer carries it
out (sleeps, writes the status). Counted faults are consumed in order, one response each.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from emulators.imds.models import FaultSpec

Endpoint = Literal["scheduledevents", "instance", "identity", "attested"]

# IMDS's documented limit: about 5 requests per second per VM; above it, 429.
DEFAULT_THROTTLE_RPS = 5.0
_WINDOW = timedelta(seconds=1)


@dataclass
class FaultDecision:
    throttled: bool = False
    delay_seconds: float = 0.0  # first-call delay, real seconds (already scaled)
    hang_seconds: float = 0.0
    error_status: int | None = None
    malformed: bool = False

    @property
    def any(self) -> bool:
        return self.throttled or self.delay_seconds > 0 or self.hang_seconds > 0 or self.error_status is not None


@dataclass
class _Counted:
    spec: FaultSpec
    remaining: int
    # For a first-call delay aimed at every VM: the VMs whose next call has already been delayed.
    delayed_vms: set[str] = field(default_factory=set)


class FaultPlan:
    def __init__(self, *, throttle_rps: float = DEFAULT_THROTTLE_RPS, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.throttle_rps = throttle_rps
        self._time_scale = time_scale
        self._faults: list[_Counted] = []
        self._recent: dict[str, deque[datetime]] = {}
        self.throttled_count = 0

    def add(self, spec: FaultSpec) -> None:
        if spec.kind == "throttle":
            self.throttle_rps = spec.requestsPerSecond
            return
        if spec.kind == "incarnation-reset":
            raise ValueError("incarnation-reset acts on the documents, not on requests; apply it to the state")
        self._faults.append(_Counted(spec=spec, remaining=spec.count))

    def clear(self) -> None:
        self._faults.clear()

    def pending(self) -> list[dict[str, object]]:
        return [
            {**fault.spec.model_dump(), "remaining": fault.remaining} for fault in self._faults if fault.remaining > 0
        ]

    def decide(self, *, vm: str, endpoint: Endpoint, now: datetime, all_vms: list[str]) -> FaultDecision:
        decision = FaultDecision()
        if self._throttle(vm, now):
            decision.throttled = True
            self.throttled_count += 1
            return decision
        for fault in self._faults:
            spec = fault.spec
            if fault.remaining <= 0 or (spec.vm is not None and spec.vm != vm):
                continue
            if spec.endpoint not in ("all", endpoint):
                continue
            if spec.kind == "first-call-delay":
                if decision.delay_seconds or vm in fault.delayed_vms:
                    continue
                decision.delay_seconds = spec.seconds / self._time_scale
                fault.delayed_vms.add(vm)
                targets = [spec.vm] if spec.vm is not None else all_vms
                if all(target in fault.delayed_vms for target in targets):
                    fault.remaining = 0
            elif spec.kind == "hang" and not decision.hang_seconds:
                decision.hang_seconds = spec.seconds
                fault.remaining -= 1
            elif spec.kind == "error-burst" and decision.error_status is None and not decision.hang_seconds:
                decision.error_status = spec.status
                fault.remaining -= 1
            elif spec.kind == "malformed-json" and not decision.malformed and decision.error_status is None:
                decision.malformed = True
                fault.remaining -= 1
        self._faults = [fault for fault in self._faults if fault.remaining > 0]
        return decision

    def _throttle(self, vm: str, now: datetime) -> bool:
        if self.throttle_rps <= 0:
            return False
        recent = self._recent.setdefault(vm, deque())
        while recent and now - recent[0] >= _WINDOW:
            recent.popleft()
        if len(recent) >= self.throttle_rps:
            return True
        recent.append(now)
        return False
