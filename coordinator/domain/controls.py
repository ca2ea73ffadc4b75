"""The policy's fleet controls, pure: recurring windows (cron + duration in an IANA time zone), blackouts, budget
domains (where a VM sits: scale set, zone, fault/update domain, placement group) and health-gate results.

Takes a time, the VMs' facts and gate results; gives whether a window is open and until when, a VM's domain keys,
and the limit a budget sets on a domain of a given size. No I/O: gates are evaluated in adapters/gates.py and
fed in; the VMs' facts come from the coordinator's records (coordinator/pipeline/decide.py).
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A gate read for one VM names it so (domain/returns.py); what may replace it (Azure's VM names).
VM_PLACEHOLDER = "{vm}"
_VM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")
DomainKind = Literal["scaleSet", "zone", "faultDomain", "updateDomain", "placementGroup"]
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?$")
# A window or blackout longer than a week is a policy mistake rather than a schedule (a whole week is "always").
MAX_DURATION = timedelta(days=7)
# Where a schedule is checked to come at all. The Gregorian calendar repeats every 400 years and a date that exists
# (29 February included) comes at least every 8; croniter looks 50 years each way.
_SOME_DAY = datetime(2000, 1, 1, tzinfo=UTC)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_duration(value: str) -> timedelta:
    """'90m', '2h', '1h30m', '1d': a window's length (minutes are the cron's resolution)."""
    match = _DURATION.match(value.strip())
    if not value.strip() or match is None:
        raise ValueError(f"duration {value!r} must look like '2h', '90m', '1h30m' or '1d'")
    days, hours, minutes = (int(group or 0) for group in match.groups())
    length = timedelta(days=days, hours=hours, minutes=minutes)
    if not timedelta(0) < length <= MAX_DURATION:
        raise ValueError(f"duration {value!r} must be more than 0 and at most 7 days")
    return length


class Schedule(_Strict):
    """A recurring period: it opens at each time the 5-field cron expression names, in ``timeZone`` (IANA; wall
    clock, so '0 2 * * *' is 02:00 local in winter and in summer), and lasts ``duration``. A start the clock skips
    (DST spring-forward) opens at the first minute after the gap (croniter's behaviour); a start the clock repeats
    (autumn) opens once, at the first of the two (tested in tests/coordinator/test_controls.py)."""

    schedule: str = Field(min_length=9, max_length=128, description="5-field cron: minute hour day month weekday")
    duration: str
    timeZone: str = "UTC"

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(f"schedule {value!r} is not a 5-field cron expression (minute hour day month weekday)")
        # Valid syntax can still name no date ('0 2 30 2 *', 30 February): refused here, where the file names the
        # line, rather than raised by every decision that asks the window when it opens.
        try:
            croniter(value, _SOME_DAY).get_next(datetime)
            croniter(value, _SOME_DAY).get_prev(datetime)
        except CroniterBadDateError:
            raise ValueError(
                f"schedule {value!r} never comes: no date has that day of the month in those months (e.g. 30 February)"
            ) from None
        return value

    @field_validator("duration")
    @classmethod
    def _duration(cls, value: str) -> str:
        parse_duration(value)
        return value

    @field_validator("timeZone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timeZone {value!r} is not an IANA time zone (e.g. 'Europe/Oslo', 'UTC')") from None
        return value

    def open_until(self, now: datetime) -> datetime | None:
        """The end of the period that contains ``now`` (UTC), or None when none does."""
        # A start at exactly ``now`` counts: look back from one second later.
        starts = croniter(self.schedule, (now + timedelta(seconds=1)).astimezone(ZoneInfo(self.timeZone)))
        start = _first_of_twins(starts, starts.get_prev(datetime), forward=False)
        end = start.astimezone(UTC) + parse_duration(self.duration)
        return end if end > now else None

    def next_open(self, now: datetime) -> datetime:
        """When the next period opens (UTC)."""
        starts = croniter(self.schedule, now.astimezone(ZoneInfo(self.timeZone)))
        return _first_of_twins(starts, starts.get_next(datetime), forward=True).astimezone(UTC)


def _repeated(start: datetime) -> bool:
    """Whether this start is the second of a wall-clock time the clock shows twice (the autumn hour)."""
    return start.fold == 1 and start.replace(fold=0).utcoffset() != start.utcoffset()


def _first_of_twins(starts: croniter, start: datetime, *, forward: bool) -> datetime:
    """croniter yields a start in the repeated autumn hour twice (02:30 CEST, then 02:30 CET): a schedule means
    that wall-clock time once, so the second is skipped."""
    while _repeated(start):
        start = starts.get_next(datetime) if forward else starts.get_prev(datetime)
    return start


class Blackout(Schedule):
    """A period when no rule approves anything (people still can, through the approval route)."""

    name: str = Field(min_length=1, max_length=128)


class Window(Schedule):
    """When a rule may approve. Outside it the rule's event waits for the next opening; ``onNotBefore`` says what
    happens if NotBefore comes first."""


class HttpGate(_Strict):
    """An HTTP GET the coordinator makes; the gate passes when the answer's status is one of ``expectStatus``."""

    url: str = Field(pattern=r"^https?://", max_length=2048)
    expectStatus: list[int] = Field(default_factory=lambda: [200], min_length=1)
    # Bounded: a gate is read once per batch/tick, and a batch must not wait on a slow health page.
    timeoutSeconds: float = Field(default=5.0, gt=0, le=30)


class AlertGate(_Strict):
    """An Azure Monitor alert rule: the gate passes while no alert of that rule is Fired (read with the
    coordinator's identity, which needs Monitoring Reader on the rule's scope)."""

    alertRuleId: str = Field(pattern=r"^/subscriptions/[^/]+/", max_length=1024)


class LogQueryGate(_Strict):
    """A Log Analytics query: the gate passes when it returns no rows (``passWhen: empty``) or some rows
    (``passWhen: rows``). Read with the coordinator's identity (Log Analytics Reader on the workspace)."""

    workspaceId: str = Field(pattern=r"^[0-9a-fA-F-]{36}$")
    query: str = Field(min_length=1, max_length=10_000)
    timespan: str = Field(default="PT15M", pattern=r"^P")
    passWhen: Literal["empty", "rows"] = "empty"


class Gate(_Strict):
    """A named health check; exactly one of http, alert, logQuery."""

    http: HttpGate | None = None
    alert: AlertGate | None = None
    logQuery: LogQueryGate | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Gate:
        given = [kind for kind in ("http", "alert", "logQuery") if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"a gate is exactly one of http, alert, logQuery; got {given or 'none'}")
        return self

    @property
    def per_vm(self) -> bool:
        """Whether the gate is read for one VM: its URL or query names ``{vm}`` (a return to service's readiness)."""
        return VM_PLACEHOLDER in (self.http.url if self.http else self.logQuery.query if self.logQuery else "")

    def for_vm(self, name: str) -> Gate:
        """This gate as read for the VM ``name``: ``{vm}`` in its URL (percent-encoded) or query (a KQL string's
        content). Names are Azure's (a census' or attested name: letters, digits, '-', '_', '.'); any other is
        refused, so that no name can change what the query or URL asks."""
        if not _VM_NAME.fullmatch(name):
            raise ValueError(f"VM name {name[:80]!r} cannot be put in a gate (only letters, digits, '-', '_', '.')")
        if self.http is not None:
            url = self.http.url.replace(VM_PLACEHOLDER, urllib.parse.quote(name, safe=""))
            return self.model_copy(update={"http": self.http.model_copy(update={"url": url})})
        if self.logQuery is not None:
            query = self.logQuery.query.replace(VM_PLACEHOLDER, name)
            return self.model_copy(update={"logQuery": self.logQuery.model_copy(update={"query": query})})
        return self


GateState = Literal["passing", "failing", "error"]


@dataclass(frozen=True)
class GateResult:
    """A gate's state as read for this batch/tick: passing, failing (the check said no) or erroring (it could not
    be read: counts as failing, an unreadable health signal approves nothing)."""

    state: GateState
    detail: str = ""


@dataclass(frozen=True)
class VmFacts:
    """Where a VM sits and its tags, as its forwarder last reported them (instance metadata)."""

    scaleSet: str = ""
    zone: str = ""
    location: str = ""
    faultDomain: str = ""
    updateDomain: str = ""
    placementGroup: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)

    def domain(self, kind: DomainKind) -> str:
        """The budget domain this VM is in, as a key; "" when the VM has none of that kind (not counted).

        Zones are numbered per region, fault and update domains per scale set (or availability set, i.e.
        placement group): the keys say so, so that fault domain 0 of two scale sets are two domains."""
        if kind == "scaleSet":
            return self.scaleSet
        if kind == "placementGroup":
            return self.placementGroup
        if kind == "zone":
            return f"{self.location}/{self.zone}" if self.zone else ""
        number = self.faultDomain if kind == "faultDomain" else self.updateDomain
        owner = self.scaleSet or self.placementGroup
        return f"{owner}/{number}" if owner and number else ""


def claim_entity(kind: DomainKind, domain: str) -> str:
    """The budget entity that holds a domain's claims: its ``claim_key``, but for the fault and update domains of one
    scale set (or placement group), one entity for them all (``faultDomains:<owner>``, ``updateDomains:<owner>``),
    each claim saying which domain each of its VMs is in (``BudgetClaim.placed``). An event that reaches VMs in five
    update domains of its scale set writes one entity, not five: benchmarks/wave_budgets.py's update-domain wave
    wrote 2,500 entities for 500 events, each a Table operation in the one ``budget`` partition."""
    if kind in ("faultDomain", "updateDomain"):
        return f"{kind}s:{domain.rpartition('/')[0]}"
    return claim_key(kind, domain)


def claim_key(kind: DomainKind, domain: str) -> str:
    """The budget entity of a domain: a scale set's keeps its name alone (claims written before domains existed
    stay valid); the others are prefixed with their kind."""
    return domain if kind == "scaleSet" else f"{kind}:{domain}"


def limit_for(*, max_impacted: int | None, max_percent: Decimal | int | None, size: int) -> int:
    """At most N, or P% of the domain's size rounded up (as a PodDisruptionBudget's maxUnavailable: 10% of 5 VMs
    is 1, so a small domain still progresses), or the smaller of both; never below 1. Exact: P is a decimal and
    the product a fraction, so no fleet size lands one VM above its limit (tests/coordinator/test_controls.py
    checks sizes 1..10,000 against a Fraction reference)."""
    limits = []
    if max_impacted is not None:
        limits.append(max_impacted)
    if max_percent is not None:
        limits.append(max(1, math.ceil(size * Fraction(max_percent) / 100)))
    return max(1, min(limits))
