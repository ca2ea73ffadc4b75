"""Checks of the forwarder's settings that no contract carries: a file path, and a secret that is never shown. They
read values as ``contracts/checks.py``'s checks do (a ``Record``'s ``spec``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from contracts.checks import Check


@dataclasses.dataclass(frozen=True)
class FilePath(Check):
    def read(self, value: Any) -> Any:
        if isinstance(value, Path):
            return value
        if not isinstance(value, str):
            raise self.bad("Input is not a valid path")
        return Path(value)

    def dump(self, value: Any, *, exclude_none: bool) -> Any:
        return str(value)


class Secret:
    """A value never shown: ``str()`` and ``repr()`` hide it (pydantic's SecretStr)."""

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclasses.dataclass(frozen=True)
class SecretText(Check):
    def read(self, value: Any) -> Any:
        if isinstance(value, Secret):
            return value
        if not isinstance(value, str):
            raise self.bad("Input should be a valid string")
        return Secret(value)
