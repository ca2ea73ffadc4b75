"""Parsing of the link addresses and the selector filter the Event Hubs clients send (pure functions)."""

from __future__ import annotations

import re
from enum import StrEnum
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict

SELECTOR_FILTER = "apache.org:selector-filter:string"
START_OF_STREAM = "-1"
END_OF_STREAM = "@latest"


class AddressError(ValueError):
    """A link address or filter the emulator does not understand; the message names it."""


class PublishTarget(BaseModel):
    """``amqp://host/hub`` or ``amqp://host/hub/Partitions/N`` — where a producer sends."""

    model_config = ConfigDict(frozen=True)

    hub: str
    partition: str | None = None


class ConsumeSource(BaseModel):
    """``amqp://host/hub/ConsumerGroups/cg/Partitions/N`` — where a consumer reads."""

    model_config = ConfigDict(frozen=True)

    hub: str
    consumer_group: str
    partition: str


class PositionField(StrEnum):
    OFFSET = "x-opt-offset"
    SEQUENCE_NUMBER = "x-opt-sequence-number"
    ENQUEUED_TIME = "x-opt-enqueued-time"


class Position(BaseModel):
    """A start position: events whose ``field`` is greater than (or equal to, if ``inclusive``) ``value``.

    ``value`` is an int (offset, sequence number or enqueued time in ms since the epoch); ``latest`` means only
    events that arrive after the link opens."""

    model_config = ConfigDict(frozen=True)

    field: PositionField = PositionField.OFFSET
    value: int = -1
    inclusive: bool = False
    latest: bool = False

    def admits(self, *, offset: int, sequence_number: int, enqueued_time_ms: int) -> bool:
        """Whether an event with these numbers lies after this position."""
        if self.latest:
            return True  # the start index already points past everything stored when the link opened
        key = {
            PositionField.OFFSET: offset,
            PositionField.SEQUENCE_NUMBER: sequence_number,
            PositionField.ENQUEUED_TIME: enqueued_time_ms,
        }[self.field]
        return key >= self.value if self.inclusive else key > self.value


_SELECTOR = re.compile(
    r"^\s*amqp\.annotation\.(?P<field>x-opt-offset|x-opt-sequence-number|x-opt-enqueued-time)\s*"
    r"(?P<op>>=|>|=)\s*'(?P<value>[^']*)'\s*$"
)


def _path_segments(address: str) -> list[str]:
    path = urlparse(address).path if "://" in address else address
    return [segment for segment in path.split("/") if segment]


def parse_publish_target(address: str) -> PublishTarget:
    segments = _path_segments(address)
    if len(segments) == 1:
        return PublishTarget(hub=segments[0])
    if len(segments) == 3 and segments[1].lower() == "partitions":
        return PublishTarget(hub=segments[0], partition=segments[2])
    raise AddressError(f"send link target {address!r} is neither '<hub>' nor '<hub>/Partitions/<id>'")


def parse_consume_source(address: str) -> ConsumeSource:
    segments = _path_segments(address)
    if len(segments) == 5 and segments[1].lower() == "consumergroups" and segments[3].lower() == "partitions":
        return ConsumeSource(hub=segments[0], consumer_group=segments[2], partition=segments[4])
    raise AddressError(f"receive link source {address!r} is not '<hub>/ConsumerGroups/<group>/Partitions/<id>'")


def parse_selector(selector: str | None) -> Position:
    """``amqp.annotation.x-opt-offset > '-1'`` → Position. No filter means the start of the stream."""
    if selector is None:
        return Position()
    match = _SELECTOR.match(selector)
    if match is None:
        raise AddressError(
            f'selector filter {selector!r} is not "amqp.annotation.<x-opt-offset|x-opt-sequence-number|'
            f"x-opt-enqueued-time> <>|>=|=> '<value>'\""
        )
    field, operator, raw = PositionField(match["field"]), match["op"], match["value"]
    if raw == END_OF_STREAM:
        if field is not PositionField.OFFSET:
            raise AddressError(f"selector filter {selector!r}: '@latest' only applies to x-opt-offset")
        return Position(latest=True)
    try:
        value = int(raw)
    except ValueError:
        raise AddressError(f"selector filter {selector!r}: {raw!r} is not an integer") from None
    return Position(field=field, value=value, inclusive=operator in (">=", "="))
