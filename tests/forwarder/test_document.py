"""The shared IMDS document model: NotBefore as IMDS writes it (RFC 1123) and as Microsoft's mock server does
(ISO 8601)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from contracts.document import ScheduledEvent


def not_before(value: str) -> datetime | None:
    return ScheduledEvent(EventId="E", EventType="Reboot", EventStatus="Scheduled", NotBefore=value).not_before()


@pytest.mark.parametrize(
    "value",
    [
        "Mon, 11 Apr 2022 22:26:58 GMT",  # IMDS
        "Mon, 11 Apr 2022 22:26:58 -0000",  # RFC 2822's "UTC, source zone unknown"
        "Tue, 12 Apr 2022 00:26:58 +0200",
        "2022-04-11T22:26:58Z",  # the mock server
        "2022-04-11T22:26:58.0000000Z",  # .NET's seven fractional digits
        "2022-04-12T00:26:58+02:00",
        "2022-04-11T17:26:58-05:00",
        " 2022-04-11T22:26:58Z ",
    ],
)
def test_not_before_in_either_format_is_one_utc_instant(value: str) -> None:
    parsed = not_before(value)
    assert parsed == datetime(2022, 4, 11, 22, 26, 58, tzinfo=UTC)
    assert parsed is not None
    assert parsed.tzinfo == UTC


@pytest.mark.parametrize("value", ["", "soon", "2022-04-11T22:26:58", "2022-04-11", "Mon, 11 Apr 2022"])
def test_not_before_without_an_instant_is_none(value: str) -> None:
    assert not_before(value) is None
