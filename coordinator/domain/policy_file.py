"""The policy file: YAML read into a ``Policy``, with errors that name the file, line and field.

A key given twice in one mapping is refused (plain YAML keeps the last one silently). So is a file that would cost
more to read than any policy needs: larger than ``MAX_POLICY_CHARS``, nested deeper than ``MAX_DEPTH``, or holding
more than ``MAX_NODES`` values once its aliases are expanded (an alias bomb: a few lines that expand to billions).
Those bounds are checked on PyYAML's event stream, which its parser makes without recursion, before anything is
composed (composing and validating recurse, and an expanded alias bomb takes minutes). Reads only the file it is
given; the default policy ships beside the code (``DEFAULT_POLICY_PATH``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from coordinator.domain.policy import Policy

__all__ = ["DEFAULT_POLICY_PATH", "PolicyError", "load_policy", "parse_policy"]

# A policy is a few hundred lines nested about 8 deep (rules[].match.durationSeconds.min); these leave room for any
# real one and refuse, in milliseconds, what would exhaust the recursion limit or the time of every instance.
MAX_POLICY_CHARS = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000


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


def _check_bounds(text: str, source: str) -> None:
    """Refuses, naming the line, a document nested deeper than MAX_DEPTH or expanding to more than MAX_NODES values
    (an alias counts as the whole node it names). Walks the parser's events with an explicit stack."""
    if len(text) > MAX_POLICY_CHARS:
        raise PolicyError(f"{source}: the policy is {len(text)} characters (limit {MAX_POLICY_CHARS})")
    # Per anchor closed so far: (values, depth) of the node it names. Per open collection: [anchor, values, depth].
    named: dict[str, tuple[int, int]] = {}
    open_: list[list[Any]] = []

    def add(values: int, depth: int, event: yaml.Event) -> None:
        line = event.start_mark.line + 1 if event.start_mark else 1
        if len(open_) + depth > MAX_DEPTH:
            raise PolicyError(f"{source}:{line}: nested deeper than {MAX_DEPTH} levels")
        if open_:
            open_[-1][1] += values
            open_[-1][2] = max(open_[-1][2], depth)
            if open_[-1][1] > MAX_NODES:
                raise PolicyError(f"{source}:{line}: expands to more than {MAX_NODES} values (aliases included)")

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                add(0, 1, event)  # the depth check, before the collection opens
                open_.append([event.anchor, 1, 0])
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, values, depth = open_.pop()
                if anchor is not None:
                    named[anchor] = (values, depth + 1)
                add(values, depth + 1, event)
            elif isinstance(event, yaml.ScalarEvent):
                if event.anchor is not None:
                    named[event.anchor] = (1, 0)
                add(1, 0, event)
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor not in named:
                    line = event.start_mark.line + 1 if event.start_mark else 1
                    # Undefined, or inside the node it names (a recursive structure PyYAML would build).
                    raise PolicyError(f"{source}:{line}: alias *{event.anchor} names no node before it")
                add(*named[event.anchor], event)
    except yaml.YAMLError as error:
        raise PolicyError(f"{source}: not valid YAML: {error}") from error


def parse_policy(text: str, *, source: str = "<policy>") -> Policy:
    _check_bounds(text, source)
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
