"""What pydantic's lax mode reads besides what the JSON schema states, so that the VM accepts what the coordinator's
models accept and refuses what they refuse (contracts/schema_record.py applies it before the compiled schema).

A model's JSON schema says ``"type": "integer"``, but the model, reading JSON in its default (lax) mode, also takes
``3.0``, ``"3"`` or ``true`` for an int and gives ``3`` (or ``1``): the forwarder reads the same value the same way.
One function per shape of field; a value none of them reads is left as it is, for the compiled schema to refuse
with its reason. ``tests/forwarder/test_wire.py`` holds each edge to the models (``model_validate_json``).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from contracts.checks import Invalid

# pydantic-core's integer text: a sign, digits with single underscores between them, a fraction of zeros.
_INTEGER = re.compile(r"[+-]?\d+(?:_\d+)*(?:\.0+)?")
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
_LARGEST = 2**63  # a float beyond an i64 is refused as an integer ("exceeded maximum size")
_FLAGS = {
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
}
# RFC 3339 as pydantic's parser (speedate) reads it: date, then T, t, _ or a space, then hh:mm[:ss[.frac]], then Z,
# z or an offset. Python's fromisoformat takes more (20261126T070000Z, week dates), which the models refuse.
_MOMENT = re.compile(
    r"(\d{4}-\d{2}-\d{2})(?:[Tt _](\d{2}:\d{2})(?::(\d{2})(?:[.,](\d{1,6})\d*)?)?(?:([Zz])|([+-]\d{2}:?\d{2}))?)?"
)
# speedate reads a number as seconds since the epoch, or milliseconds beyond this.
_MILLISECONDS_FROM = 2e10


def integer(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        if abs(value) >= _LARGEST:
            raise Invalid([("", "Unable to parse input string as an integer, exceeded maximum size")])
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if not _INTEGER.fullmatch(text):
            raise Invalid([("", "Input should be a valid integer, unable to parse string as an integer")])
        return int(text.split(".")[0].replace("_", ""))
    return value


def number(value: Any) -> Any:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # JSON's integers have no bound; a float's range does
            raise Invalid([("", "Input should be a finite number")]) from None
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise Invalid([("", "Input should be a valid number, unable to parse string as a number")]) from None
    return value


def flag(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.lower() not in _FLAGS:
            raise Invalid([("", "Input should be a valid boolean, unable to interpret input")])
        return _FLAGS[value.lower()]
    return value


def moment(value: Any) -> Any:
    """A time as fromisoformat reads it: RFC 3339 in its canonical form, or a number of seconds (or
    milliseconds) since the epoch as UTC; anything else is refused, as the models refuse it."""
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        value = float(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = value / 1000 if abs(value) > _MILLISECONDS_FROM else value
        return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)).isoformat()
    if not isinstance(value, str):
        return value
    match = _MOMENT.fullmatch(value)
    if match is None:
        raise Invalid([("", "Input should be a valid datetime")])
    day, clock, second, fraction, utc, offset = match.groups()
    if clock is None:
        return day
    zone = "+00:00" if utc else offset or ""
    return f"{day}T{clock}:{second or '00'}{'.' + fraction.ljust(6, '0') if fraction else ''}{zone}"


READERS = {"int": integer, "float": number, "bool": flag, "moment": moment}
