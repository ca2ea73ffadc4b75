"""Reading infra/*.bicep without the Bicep compiler: pycep-parser's JSON model plus small resolvers for the shapes
it produces (references are bare names, `a.b.c` is a right-nested property_accessor, functions are
{"function": {"type": <snake_case>, "parameters": {...}}}, interpolated strings stay as text)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pycep import BicepParser

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
MAIN = INFRA / "main.bicep"
ROLES_FILE = INFRA / "roles.json"
_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")
_CHAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def bicep_files() -> list[Path]:
    return sorted(INFRA.rglob("*.bicep"))


@functools.cache
def _parser() -> BicepParser:
    return BicepParser()


@functools.cache
def parse(path: Path) -> dict[str, Any]:
    model: dict[str, Any] = dict(_parser().parse(text=path.read_text(encoding="utf-8")))
    for section in ("parameters", "variables", "resources", "modules", "outputs"):
        model.setdefault(section, {})  # pycep leaves out empty sections
    return model


def accessor_chain(value: Any) -> list[str] | None:
    """`a.b.c` -> ['a', 'b', 'c']; `a[i].b` -> ['a', 'b']; a bare name -> [name]; anything else -> None."""
    if isinstance(value, str):
        return [value] if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) else None
    if not isinstance(value, dict) or "operator" not in value:
        return None
    operator = value["operator"]
    operands = operator.get("operands", {})
    if operator.get("type") == "property_accessor":
        head = accessor_chain(operands.get("operand_1"))
        tail = accessor_chain(operands.get("operand_2"))
        return head + tail if head is not None and tail is not None else None
    if operator.get("type") == "index_accessor":
        return accessor_chain(operands.get("operand_1"))
    return None


def walk(value: Any) -> Iterator[Any]:
    """Every node of a pycep value tree, depth first."""
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def references(value: Any) -> set[tuple[str, ...]]:
    """Every dotted reference in a value tree, including those inside '${...}' interpolations."""
    found: set[tuple[str, ...]] = set()
    for node in walk(value):
        chain = accessor_chain(node) if isinstance(node, dict) else None
        if chain and len(chain) > 1:
            found.add(tuple(chain))
        if isinstance(node, str):
            for expression in _INTERPOLATION.findall(node):
                found.update(tuple(match.split(".")) for match in _CHAIN.findall(expression))
    return found


def function_calls(value: Any) -> set[str]:
    """Names of the functions a value tree calls. pycep spells most in snake case, keeps some as written
    (listCallbackUrl), wraps listKeys(...) as list_func and `res.listKeys()` as a function_accessor."""
    found: set[str] = set()
    for node in walk(value):
        if not isinstance(node, dict):
            continue
        function = node.get("function")
        if isinstance(function, dict):
            found.add(function.get("parameters", {}).get("func_name") or function["type"])
        operator = node.get("operator")
        if isinstance(operator, dict) and operator.get("type") == "function_accessor":
            found.add(operator["operands"]["func_name"])
    return found


def resource_body(resource: dict[str, Any]) -> dict[str, Any]:
    """The resource's body, unwrapping a for-loop or an `if (...)` resource."""
    config: dict[str, Any] = resource["config"]
    return config["config"] if "loop_type" in config or "condition" in config else config


def decorator(entry: dict[str, Any], kind: str) -> Any:
    return next((d.get("argument") for d in entry.get("decorators", []) if d.get("type") == kind), None)


def load_path(value: Any) -> str | None:
    """The file a loadJsonContent/loadTextContent call reads, if value is one."""
    if isinstance(value, dict) and value.get("function", {}).get("type") in {"load_json_content", "load_text_content"}:
        path: str = value["function"]["parameters"]["file_path"]
        return path
    return None


def modules_of_main() -> dict[str, tuple[Path, dict[str, Any]]]:
    """Module symbol in main.bicep -> (module file, the params main passes)."""
    result = {}
    for symbol, module in parse(MAIN)["modules"].items():
        result[symbol] = (MAIN.parent / module["detail"]["path"], module["config"]["params"])
    return result


def roles() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ROLES_FILE.read_text(encoding="utf-8"))
    return data
