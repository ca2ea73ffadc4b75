"""Records validated with the standard library only: the forwarder's settings (forwarder/config.py) and the Relay
control messages (forwarder/relay_protocol.py), read without pydantic on the VM (docs/forwarder.md, *Footprint*).
The contracts' records (contracts/schema_record.py) build on ``Record`` and ``Invalid`` but take their checks from
the pydantic models' JSON schemas, not from here.

A check reads a JSON value (or an already typed one, so that a record built in code is validated the same way) and
returns the typed value, or raises ``Invalid`` with pydantic's message and location ("EventStatus: Input should be
'Scheduled' or 'Started'"). Lax checks (``lax=True``) also read the strings of flags and environment variables.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, ClassVar, Self, TypeVar

R = TypeVar("R", bound="Record")


class Invalid(ValueError):
    """What is wrong, as (location, message) pairs: ``Events.1.EventStatus``, "Input should be …"."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{loc or 'document'}: {msg}" for loc, msg in problems[:5]))
        self.problems = problems


def _inside(key: str | int, error: Invalid) -> list[tuple[str, str]]:
    return [(f"{key}.{loc}" if loc else str(key), msg) for loc, msg in error.problems]


class Check:
    """Reads one field's value."""

    def read(self, value: Any) -> Any:
        raise NotImplementedError

    def dump(self, value: Any, *, exclude_none: bool) -> Any:
        return value

    def bad(self, message: str) -> Invalid:
        return Invalid([("", message)])


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


@dataclasses.dataclass(frozen=True)
class Text(Check):
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None

    def read(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise self.bad("Input should be a valid string")
        if self.min_length is not None and len(value) < self.min_length:
            raise self.bad(f"String should have at least {_plural(self.min_length, 'character')}")
        if self.max_length is not None and len(value) > self.max_length:
            raise self.bad(f"String should have at most {_plural(self.max_length, 'character')}")
        if self.pattern is not None and not re.search(self.pattern, value):
            raise self.bad(f"String should match pattern '{self.pattern}'")
        return value


@dataclasses.dataclass(frozen=True)
class Choice(Check):
    values: tuple[str, ...]

    def read(self, value: Any) -> Any:
        if value not in self.values or not isinstance(value, str):
            shown = [f"'{v}'" for v in self.values]
            listed = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
            raise self.bad(f"Input should be {listed}")
        return value


@dataclasses.dataclass(frozen=True)
class Number(Check):
    """An int or a float (``integer=True``: an int); ``lax`` also reads a numeric string (flags, environment)."""

    integer: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lax: bool = False

    def read(self, value: Any) -> Any:
        kind = "integer" if self.integer else "number"
        if self.lax and isinstance(value, str):
            try:
                value = int(value.strip()) if self.integer else float(value.strip())
            except ValueError:
                raise self.bad(
                    f"Input should be a valid {kind}, unable to parse string as {'an' if self.integer else 'a'} {kind}"
                ) from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.bad(f"Input should be a valid {kind}")
        if isinstance(value, float) and not math.isfinite(value):
            raise self.bad("Input should be a finite number")  # Infinity and NaN are not JSON
        if self.integer and isinstance(value, float):
            if not value.is_integer():
                raise self.bad("Input should be a valid integer, got a number with a fractional part")
            value = int(value)
        if self.ge is not None and not value >= self.ge:
            raise self.bad(f"Input should be greater than or equal to {self.ge}")
        if self.gt is not None and not value > self.gt:
            raise self.bad(f"Input should be greater than {self.gt}")
        if self.le is not None and not value <= self.le:
            raise self.bad(f"Input should be less than or equal to {self.le}")
        return value if self.integer else float(value)


@dataclasses.dataclass(frozen=True)
class Flag(Check):
    lax: bool = False

    def read(self, value: Any) -> Any:
        if self.lax and isinstance(value, str):
            words = {
                "true": True,
                "1": True,
                "yes": True,
                "on": True,
                "false": False,
                "0": False,
                "no": False,
                "off": False,
            }
            if value.strip().lower() in words:
                return words[value.strip().lower()]
            raise self.bad("Input should be a valid boolean, unable to interpret input")
        if not isinstance(value, bool):
            raise self.bad("Input should be a valid boolean")
        return value


@dataclasses.dataclass(frozen=True)
class TextMap(Check):
    """An object of strings (a Relay request's headers)."""

    def read(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise self.bad("Input should be a valid dictionary")
        for name, text in value.items():
            if not isinstance(name, str) or not isinstance(text, str):
                raise Invalid([(str(name), "Input should be a valid string")])
        return dict(value)


@dataclasses.dataclass(frozen=True)
class Nested(Check):
    """Another record, from its JSON object or as it is."""

    record: type[Record]

    def read(self, value: Any) -> Any:
        if isinstance(value, self.record):
            return value
        return self.record.from_mapping(value)

    def dump(self, value: Any, *, exclude_none: bool) -> Any:
        return value.to_mapping(exclude_none=exclude_none)


@dataclasses.dataclass(frozen=True)
class Maybe(Check):
    """``inner`` or null."""

    inner: Check

    def read(self, value: Any) -> Any:
        return None if value is None else self.inner.read(value)

    def dump(self, value: Any, *, exclude_none: bool) -> Any:
        return None if value is None else self.inner.dump(value, exclude_none=exclude_none)


def spec(
    check: Check, default: Any = dataclasses.MISSING, *, alias: str = "", factory: Any = None, description: str = ""
) -> Any:
    """A record's field: its check, its default (none: required), the JSON name when it is not the field's, and
    what it means (the forwarder's settings show it in ``--help``)."""
    metadata = {"check": check, "alias": alias, "description": description}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Record:
    """A frozen dataclass whose fields are checked as it is made (``spec``). ``EXTRA``: unknown JSON fields are kept
    in ``extras`` and written back after the known ones (pydantic's ``extra="allow"``), "ignore" drops them,
    "forbid" refuses them."""

    EXTRA: ClassVar[str] = "allow"

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        for field in self.specs():
            try:
                object.__setattr__(self, field.name, field.metadata["check"].read(getattr(self, field.name)))
            except Invalid as error:
                problems.extend(_inside(field.metadata["alias"] or field.name, error))
        if problems:
            raise Invalid(problems)
        self.validate()

    def validate(self) -> None:
        """What holds across fields (a record overrides it and raises ``Invalid``)."""

    @classmethod
    def specs(cls) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(cls) if "check" in f.metadata]

    @property
    def extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = self.__dict__.get("_extras", {})
        return extras

    @classmethod
    def from_mapping(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise Invalid([("", "Input should be a valid dictionary or instance of " + cls.__name__)])
        values: dict[str, Any] = {}
        problems: list[tuple[str, str]] = []
        known = set()
        for field in cls.specs():
            key = field.metadata["alias"] or field.name
            known.add(key)
            if key in data:
                values[field.name] = data[key]
            elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                problems.append((key, "Field required"))
        unknown = {k: v for k, v in data.items() if k not in known}
        if cls.EXTRA == "forbid":
            problems.extend((k, "Extra inputs are not permitted") for k in unknown)
        if problems:
            raise Invalid(problems)
        record = cls(**values)
        if cls.EXTRA == "allow" and unknown:
            object.__setattr__(record, "_extras", unknown)
        return record

    @classmethod
    def from_json_bytes(cls, data: bytes | str) -> Self:
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError) as error:
            raise Invalid([("", f"Invalid JSON: {str(error)[:200]}")]) from None
        return cls.from_mapping(parsed)

    def to_mapping(self, *, exclude_none: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field in self.specs():
            value = getattr(self, field.name)
            if value is None and exclude_none:
                continue
            out[self._json_key(field)] = self._json_value(field, value, exclude_none)
        out.update(self.extras)
        return out

    @classmethod
    def _json_key(cls, field: dataclasses.Field[Any]) -> str:
        """A field's JSON name (contracts/schema_record.py's records name theirs otherwise)."""
        return str(field.metadata["alias"] or field.name)

    def _json_value(self, field: dataclasses.Field[Any], value: Any, exclude_none: bool) -> Any:
        return field.metadata["check"].dump(value, exclude_none=exclude_none)

    def to_json_bytes(self, *, exclude_none: bool = False) -> bytes:
        return json.dumps(
            self.to_mapping(exclude_none=exclude_none), ensure_ascii=False, separators=(",", ":")
        ).encode()

    def replace(self, **changes: Any) -> Self:
        copy = dataclasses.replace(self, **changes)
        if self.extras:
            object.__setattr__(copy, "_extras", self.extras)
        return copy
