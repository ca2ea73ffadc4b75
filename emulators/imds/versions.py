"""IMDS api-versions and what each Scheduled Events version shows.

Scheduled Events history (Microsoft docs): 2017-03-01 preview (resource names with a leading underscore),
2017-08-01 (underscore removed), 2017-11-01 (Preempt), 2019-01-01 (Terminate), 2019-04-01 (Description),
2019-08-01 (EventSource), 2020-07-01 (DurationInSeconds). ``{latest}`` is no longer accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULED_EVENTS_VERSIONS: tuple[str, ...] = (
    "2017-03-01",
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
)

# Instance metadata versions the real service documents (newest last).
INSTANCE_VERSIONS: tuple[str, ...] = (
    "2017-03-01",
    "2017-04-02",
    "2017-08-01",
    "2017-10-01",
    "2017-12-01",
    "2018-02-01",
    "2018-04-02",
    "2018-10-01",
    "2019-02-01",
    "2019-03-11",
    "2019-04-30",
    "2019-06-01",
    "2019-06-04",
    "2019-08-01",
    "2019-08-15",
    "2019-11-01",
    "2020-06-01",
    "2020-07-15",
    "2020-09-01",
    "2020-10-01",
    "2020-12-01",
    "2021-01-01",
    "2021-02-01",
    "2021-03-01",
    "2021-05-01",
    "2021-08-01",
    "2021-10-01",
    "2021-11-01",
    "2021-11-15",
    "2021-12-13",
    "2022-02-01",
    "2022-03-01",
    "2022-05-01",
    "2022-07-01",
    "2022-08-01",
    "2022-09-01",
    "2022-11-01",
    "2023-01-01",
    "2023-03-01",
    "2023-07-01",
)

IDENTITY_VERSIONS: tuple[str, ...] = ("2018-02-01", "2019-08-01")

# The attested category came with 2018-10-01: an instance version older than that is not one of its versions.
ATTESTED_VERSIONS: tuple[str, ...] = tuple(v for v in INSTANCE_VERSIONS if v >= "2018-10-01")


def newest(versions: tuple[str, ...], count: int = 3) -> list[str]:
    return sorted(versions, reverse=True)[:count]


@dataclass(frozen=True)
class EventView:
    """Which event types and fields one Scheduled Events api-version shows."""

    version: str
    underscore_names: bool
    preempt: bool
    terminate: bool
    description: bool
    event_source: bool
    duration: bool

    def shows_type(self, event_type: str) -> bool:
        # An older client cannot know a newer type, so such events are omitted from its document rather than
        # shown with a type it would misread (decision documented in docs/imds-emulator.md).
        if event_type == "Preempt":
            return self.preempt
        if event_type == "Terminate":
            return self.terminate
        return True


def event_view(version: str) -> EventView:
    if version not in SCHEDULED_EVENTS_VERSIONS:
        raise ValueError(f"api-version {version!r} is not a Scheduled Events version")
    return EventView(
        version=version,
        underscore_names=version == "2017-03-01",
        preempt=version >= "2017-11-01",
        terminate=version >= "2019-01-01",
        description=version >= "2019-04-01",
        event_source=version >= "2019-08-01",
        duration=version >= "2020-07-01",
    )
