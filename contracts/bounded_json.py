"""JSON read with a bound on its size and its depth, wherever a document from outside is parsed as a whole (the IMDS
document on the VM, an Event Grid message in the coordinator).

Python's ``json.loads`` recurses once per level: a document nested 20,000 deep raises ``RecursionError``, which is
no ``ValueError``, so it escaped the handlers that set a bad document aside, and whatever walks a document of 900
levels after it was parsed may raise it later. Here the parse is the standard library's (no pydantic-core, which
the on-VM forwarder does not load: contracts/checks.py), its ``RecursionError`` turned into a refusal; the size is
checked before it and the depth after it, without recursion, and
every refusal is a ``JsonRefused`` (a ``ValueError``) whose message says which bound, for the caller to name the
document.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "JsonRefused", "NotJson", "depth_of", "loads"]

# The documents read here are 3 to 5 levels deep (an Event Grid array > event > data > resourceInfo > fields); 64 is
# far above any of them and far below what a recursive walk of the result could not take.
MAX_DEPTH = 64


class JsonRefused(ValueError):
    """A document that is not JSON, or is larger or deeper than the bound where it is read."""


class NotJson(JsonRefused):
    """A document that is not JSON at all (as opposed to JSON beyond a bound)."""


def depth_of(value: Any, *, limit: int) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), counted up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if depth > limit:
                break
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def loads(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``data`` parsed, or ``JsonRefused`` saying why: larger than ``max_bytes``, nested deeper than ``max_depth``,
    or not JSON (the caller names the document)."""
    if len(data) > max_bytes:
        raise JsonRefused(f"{len(data)} bytes, more than the {max_bytes} allowed")
    try:
        value = json.loads(data)
    except RecursionError:
        raise JsonRefused(f"nested deeper than {max_depth} levels") from None
    except ValueError as error:
        raise NotJson(f"Invalid JSON: {str(error)[:200]}") from None
    if depth_of(value, limit=max_depth) > max_depth:
        raise JsonRefused(f"nested deeper than {max_depth} levels")
    return value
