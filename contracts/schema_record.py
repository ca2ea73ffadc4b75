"""Records read through validators compiled from the pydantic models' JSON schemas: the runtime of the contracts the
on-VM forwarder reads and writes without pydantic (pydantic with the models costs a forwarder about 13 MiB of
resident memory, more than the whole rest of it: docs/forwarder.md, *Footprint*).

``python -m contracts.generate`` writes ``contracts/wire_validators.py`` (each model's JSON schema compiled to plain
Python by fastjsonschema) and ``contracts/wire_records.py`` (one frozen dataclass per model, its fields as the
schema says, each a ``SchemaRecord``). A record is read in four steps: what pydantic's lax mode reads besides the
schema read as it reads it (``3.0`` or ``"3"`` for an int: contracts/lax.py), numbers must be finite (``Infinity``
and ``NaN``, which Python's JSON parser reads, are not JSON), the compiled schema, then each field made typed (times
parsed, nested records built) with the rules no JSON schema states (contracts/wire_rules.py). A refusal is an
``Invalid`` naming the field and the reason in pydantic's words ("EventStatus: Input should be 'Scheduled' or
'Started'"), as the coordinator's models would; the compiled schema stops at the first thing wrong, so a refusal
names one field where pydantic would list each.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar, Self

from contracts import lax
from contracts.checks import Invalid, Record

# What each record's field holds, as the generator writes it: "str", "int", "float", "bool", "moment" (a time),
# "map" (an object of strings), "any", a record's name, "list:<shape>" or "maybe:<shape>" (or null).
_RECORDS: dict[str, tuple[type[SchemaRecord], Callable[[Any], Any]]] = {}
_STEP = re.compile(r"\[(\d+)\]")


def register(records: dict[str, tuple[type[SchemaRecord], Callable[[Any], Any]]]) -> None:
    """The generated records and their compiled validators (contracts/wire_records.py calls this once)."""
    _RECORDS.update(records)


def wire_field(key: str, shape: str, default: Any = dataclasses.MISSING, *, factory: Any = None) -> Any:
    """A record's field: its JSON name, its shape, its default (none and no factory: required)."""
    metadata = {"key": key, "shape": shape}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _shown(values: list[Any]) -> str:
    shown = [f"'{v}'" for v in values]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


_TYPES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}


def _reason(rule: str, bound: Any, value: Any) -> str:
    """fastjsonschema's refusal in pydantic's words (the rule broken, its bound, the value)."""
    if rule == "type":
        kind = bound[0] if isinstance(bound, list) else bound
        if kind == "integer" and isinstance(value, float) and not value.is_integer():
            return "Input should be a valid integer, got a number with a fractional part"
        named = {"array": "list", "object": "dictionary"}.get(kind, _TYPES.get(kind, kind))
        return f"Input should be a valid {named}"
    messages: dict[str, Callable[[], str]] = {
        "minLength": lambda: f"String should have at least {_plural(bound, 'character')}",
        "maxLength": lambda: f"String should have at most {_plural(bound, 'character')}",
        "pattern": lambda: f"String should match pattern '{bound}'",
        "enum": lambda: f"Input should be {_shown(bound)}",
        "const": lambda: f"Input should be {_shown([bound])}",
        "minimum": lambda: f"Input should be greater than or equal to {bound}",
        "exclusiveMinimum": lambda: f"Input should be greater than {bound}",
        "maximum": lambda: f"Input should be less than or equal to {bound}",
        "maxItems": lambda: f"List should have at most {_plural(bound, 'item')} after validation, not {len(value)}",
        "maxProperties": lambda: (
            f"Dictionary should have at most {_plural(bound, 'item')} after validation, not {len(value)}"
        ),
        "additionalProperties": lambda: "Extra inputs are not permitted",
    }
    return messages[rule]() if rule in messages else f"Input is not valid ({rule})"


def _problems(error: Any) -> list[tuple[str, str]]:
    """A compiled validator's exception as (location, message): ``data.Events[1].Resources`` is
    ``Events.1.Resources``."""
    loc = _STEP.sub(r".\1", error.name or "data").removeprefix("data").lstrip(".")
    bound: Any = (error.definition or {}).get(error.rule)
    if error.rule == "required" and isinstance(error.value, dict) and isinstance(bound, list):
        return [(f"{loc}.{key}" if loc else key, "Field required") for key in bound if key not in error.value]
    if error.rule == "propertyNames" and isinstance(error.value, dict):
        # The first name out of bounds, where pydantic puts it (a VM's tags: "tags.<name>.[key]").
        low, high = bound.get("minLength", 0), bound.get("maxLength", math.inf)
        key = next(k for k in error.value if not low <= len(k) <= high)
        rule, limit = ("minLength", low) if len(key) < low else ("maxLength", high)
        return [(f"{loc}.{key}.[key]", _reason(rule, limit, key))]
    return [(loc, _reason(error.rule, bound, error.value))]


def _finite(value: Any, loc: str) -> None:
    """Refuses ``Infinity`` and ``NaN`` anywhere in a JSON value (not JSON for any sink a figure goes on to)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise Invalid([(loc, "Input should be a finite number")])
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        _finite(item, f"{loc}.{key}" if loc else str(key))


def _json(value: Any) -> Any:
    """A value as JSON holds it: records as objects, times as ISO 8601 (pydantic's form: UTC as "Z")."""
    if isinstance(value, SchemaRecord):
        return value.to_mapping()
    if isinstance(value, datetime):
        text = value.isoformat()
        offset = value.utcoffset()
        return text[:-6] + "Z" if offset is not None and not offset else text
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


def _loosened(value: Any, shape: str, loc: str) -> Any:
    """A JSON value with what pydantic's lax mode reads for ``shape`` read as it reads it (contracts/lax.py)."""
    if value is None:
        return value
    if shape.startswith("maybe:"):
        return _loosened(value, shape[6:], loc)
    if shape.startswith("list:") and isinstance(value, list):
        return [_loosened(v, shape[5:], f"{loc}.{i}") for i, v in enumerate(value)]
    if shape in lax.READERS:
        try:
            return lax.READERS[shape](value)
        except Invalid as error:
            raise Invalid([(loc, message) for _, message in error.problems]) from None
    if shape in _RECORDS and isinstance(value, dict):
        return _RECORDS[shape][0].loosened(value, loc)
    return value


def _typed(value: Any, shape: str, loc: str) -> Any:
    """A value the compiled schema accepted, as its field holds it."""
    if value is None or shape in ("str", "int", "bool", "map", "any"):
        return value
    if shape.startswith("maybe:"):
        return _typed(value, shape[6:], loc)
    if shape.startswith("list:"):
        return [_typed(item, shape[5:], f"{loc}.{index}") for index, item in enumerate(value)]
    if shape == "float":
        return float(value)
    if shape == "moment":
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            raise Invalid([(loc, "Input should be a valid datetime")]) from None
    record, _ = _RECORDS[shape]
    try:
        return record.build(value)
    except Invalid as error:
        raise Invalid([(f"{loc}.{inner}" if inner else loc, message) for inner, message in error.problems]) from None


@dataclasses.dataclass(frozen=True)
class SchemaRecord(Record):
    """A contract's record: built from JSON (``from_mapping``) or in code (its fields, typed or as JSON), checked
    by its compiled schema either way. ``EXTRA``: unknown JSON fields are kept ("allow") or dropped ("ignore")."""

    EXTRA: ClassVar[str] = "ignore"

    def __post_init__(self) -> None:
        built = type(self).from_mapping({f.metadata["key"]: getattr(self, f.name) for f in self.specs()})
        for field in self.specs():
            object.__setattr__(self, field.name, getattr(built, field.name))

    @classmethod
    def specs(cls) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(cls) if "shape" in f.metadata]

    def validate(self) -> None:
        """What holds across fields (a record's rules override it and raise ``Invalid``)."""

    @classmethod
    def from_mapping(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise Invalid([("", "Input should be a valid dictionary or instance of " + cls.__name__)])
        data = cls.loosened(_json(data), "")
        _finite(data, "")
        try:
            _RECORDS[cls.__name__][1](data)
        except ValueError as error:
            if not hasattr(error, "rule"):
                raise
            raise Invalid(_problems(error)) from None
        return cls.build(data)

    @classmethod
    def loosened(cls, data: dict[str, Any], loc: str) -> dict[str, Any]:
        """``data`` with each field's value as pydantic's lax mode reads it (``loc``: where ``data`` is)."""
        out = dict(data)
        for field in cls.specs():
            key = field.metadata["key"]
            if key in out:
                out[key] = _loosened(out[key], field.metadata["shape"], f"{loc}.{key}" if loc else key)
        return out

    @classmethod
    def build(cls, data: dict[str, Any]) -> Self:
        """A record of JSON its schema accepted: each field typed, the rules no schema states checked."""
        record = object.__new__(cls)
        known = set()
        problems: list[tuple[str, str]] = []
        for field in cls.specs():
            key = field.metadata["key"]
            known.add(key)
            if key in data:
                value = data[key]
            elif field.default_factory is not dataclasses.MISSING:
                value = field.default_factory()
            else:
                value = field.default
            try:
                object.__setattr__(record, field.name, _typed(value, field.metadata["shape"], key))
            except Invalid as error:
                problems.extend(error.problems)
        if problems:
            raise Invalid(problems)
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown and cls.EXTRA == "allow":
            object.__setattr__(record, "_extras", unknown)
        record.validate()
        return record

    @classmethod
    def _json_key(cls, field: dataclasses.Field[Any]) -> str:
        return str(field.metadata["key"])

    def _json_value(self, field: dataclasses.Field[Any], value: Any, exclude_none: bool) -> Any:
        if isinstance(value, SchemaRecord):
            return value.to_mapping(exclude_none=exclude_none)
        return _dump(value, exclude_none)


def _dump(value: Any, exclude_none: bool) -> Any:
    if isinstance(value, list):
        return [v.to_mapping(exclude_none=exclude_none) if isinstance(v, SchemaRecord) else _json(v) for v in value]
    return _json(value)
