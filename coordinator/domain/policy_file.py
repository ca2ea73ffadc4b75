"""The policy file: YAML read into a ``Policy``, with errors that name the file, line and field.

A key given twice in one mapping is refused (plain YAML keeps the last one silently). Reads only the file it is
given; the default policy ships beside the code (``DEFAULT_POLICY_PATH``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from coordinator.domain.policy import Policy

__all__ = ["DEFAULT_POLICY_PATH", "PolicyError", "load_policy", "parse_policy"]


class PolicyError(ValueError):
    """The policy file is not valid; the message names the file, line and field."""


def _line_index(node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            key_path = (*path, key.value)
            out[key_path] = key.start_mark.line + 1
            _line_index(value, key_path, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _line_index(item, (*path, index), out)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"{line}: duplicate key {key!r} (first on line {first_line})")
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one silently, so a
    policy could mean something else than what its reader sees first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
            except TypeError:  # an unhashable key: the base class reports it
                break
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_policy(text: str, *, source: str = "<policy>") -> Policy:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except _DuplicateKey as error:
        raise PolicyError(f"{source}:{error}") from error
    except yaml.YAMLError as error:
        raise PolicyError(f"{source}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: a policy is a mapping with 'rules:'; got {type(data).__name__}")
    lines: dict[tuple[Any, ...], int] = {}
    if root is not None:
        _line_index(root, (), lines)
    try:
        return Policy.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            loc = tuple(item["loc"])
            prefix = next((loc[:n] for n in range(len(loc), -1, -1) if loc[:n] in lines), ())
            where = ".".join(str(part) for part in loc) or "(top)"
            problems.append(f"{source}:{lines.get(prefix, 1)}: {where}: {item['msg']}")
        raise PolicyError("invalid policy:\n  " + "\n  ".join(problems)) from error


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PolicyError(f"cannot read policy file {path}: {error.strerror}") from error
    return parse_policy(text, source=str(path))


DEFAULT_POLICY_PATH = Path(__file__).parent.parent / "policies" / "default.yaml"
