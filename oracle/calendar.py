"""When a policy's periods are open, computed by the oracle itself from the documented meaning (docs/policy.md,
*Windows and blackouts*, *Policy reference*), not with the coordinator's code: a cron schedule read in its IANA
zone opens a period of ``duration`` at each start; a rule's ``match.window`` is UTC days and hours, end exclusive,
wrapping past midnight.

Not modelled: the autumn hour a zone shows twice (croniter yields such a start twice; the coordinator opens it once,
at the first). A twin here opens a period an hour later as well, so the oracle's window is wider there; the
generator writes its schedules in UTC, where no hour repeats.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo

from croniter import croniter

from oracle.intervals import Intervals, seconds, when

__all__ = ["cron_periods", "duration_of", "utc_window_spans"]

_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?$")
_HOURS = re.compile(r"^(\d\d):(\d\d)-(\d\d):(\d\d)$")
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def duration_of(text: str) -> timedelta:
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"not a duration: {text!r}")
    days, hours, minutes = (int(group or 0) for group in match.groups())
    return timedelta(days=days, hours=hours, minutes=minutes)


@lru_cache(maxsize=256)
def cron_periods(schedule: str, duration: str, zone: str, lo: float, hi: float) -> Intervals:
    """The periods of a schedule that overlap [lo, hi): each start the cron names (wall clock in ``zone``) plus
    ``duration`` of real time."""
    length = duration_of(duration)
    tz = ZoneInfo(zone)
    # Periods that began up to one duration before lo still reach into it.
    starts = croniter(schedule, (when(lo) - length - timedelta(minutes=1)).astimezone(tz))
    periods = []
    while True:
        start = starts.get_next(datetime).astimezone(UTC)
        if seconds(start) >= hi:
            break
        periods.append((seconds(start), seconds(start + length)))
    return Intervals.of(periods)


def utc_window_spans(days: list[str], hours: str, lo: float, hi: float) -> Intervals:
    """A ``match.window`` (UTC weekdays and 'HH:MM-HH:MM', end exclusive; an end before the start wraps past
    midnight and belongs to the day it started) as spans over [lo, hi)."""
    match = _HOURS.match(hours)
    if match is None:
        raise ValueError(f"not hours: {hours!r}")
    start = timedelta(hours=int(match.group(1)), minutes=int(match.group(2)))
    end = timedelta(hours=int(match.group(3)), minutes=int(match.group(4)))
    if end < start:
        end += timedelta(days=1)
    first = when(lo).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=1)
    spans = []
    day = first
    while seconds(day) < hi:
        if _DAYS[day.weekday()] in days:
            spans.append((seconds(day + start), seconds(day + end)))
        day += timedelta(days=1)
    return Intervals.of(spans).clipped(lo, hi)
