"""Offline checks for the KQL files in infra/queries: syntax (kusto-query-language-parser, ANTLR) and column names.

The parser knows no schema, so the column check is ours: every name a query *references* must be a column of the
history table (coordinator/history_columns.json), a table, or a name the query itself *introduces* (let,
`Name = ...` in extend/summarize/project/project-rename/mv-expand, `as`, function parameters). Function names and
property paths (`x.y`) are not references. Scoping is per query, not per pipe stage: a reasonable check, which
catches misspelt columns without re-implementing Kusto's binder.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from antlr4 import CommonTokenStream, InputStream
from antlr4.error.ErrorListener import ErrorListener
from kusto_query_language_parser.parse_tools.KqlLexer import KqlLexer
from kusto_query_language_parser.parse_tools.KqlParser import KqlParser

ROOT = Path(__file__).resolve().parents[2]
HISTORY_COLUMNS = ROOT / "coordinator" / "history_columns.json"
# Join sides are addressed as $left.Column / $right.Column.
_BUILTIN_NAMES = frozenset({"$left", "$right"})


class KqlSyntaxError(ValueError):
    """The query does not parse; the message lists line:column and the parser's reason for each error."""


@dataclass(frozen=True)
class Schema:
    table: str
    columns: frozenset[str]

    @classmethod
    def load(cls, path: Path = HISTORY_COLUMNS) -> Schema:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(table=data["table"], columns=frozenset(c["name"] for c in data["columns"]))


class _CollectErrors(ErrorListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.errors: list[str] = []

    def syntaxError(  # noqa: PLR0917 - ANTLR calls it positionally
        self, recognizer: Any, offendingSymbol: Any, line: int, column: int, msg: str, e: Any
    ) -> None:
        self.errors.append(f"{line}:{column} {msg}")


def parse(text: str) -> Any:
    """Parse one query; raise KqlSyntaxError naming every syntax error."""
    lexer = KqlLexer(InputStream(text))
    parser = KqlParser(CommonTokenStream(lexer))
    listener = _CollectErrors()
    for recognizer in (lexer, parser):
        recognizer.removeErrorListeners()
        recognizer.addErrorListener(listener)
    with redirect_stderr(io.StringIO()):
        tree = parser.top()
    if listener.errors:
        raise KqlSyntaxError("; ".join(listener.errors))
    return tree


def _walk(node: Any) -> Iterator[Any]:
    yield node
    for i in range(node.getChildCount()):
        child = node.getChild(i)
        if hasattr(child, "getRuleIndex"):
            yield from _walk(child)


def _declared(node: Any) -> list[str]:
    if isinstance(node, KqlParser.NamedExpressionNameClauseContext):
        if node.Name is not None:
            return [node.Name.getText()]
        return [name.getText() for name in node.NameList.Names]
    if isinstance(
        node,
        KqlParser.LetVariableDeclarationContext
        | KqlParser.LetFunctionDeclarationContext
        | KqlParser.LetViewDeclarationContext
        | KqlParser.LetMaterializeDeclarationContext
        | KqlParser.AsOperatorContext
        | KqlParser.ScalarParameterContext
        | KqlParser.TabularParameterContext,
    ):
        return [node.Name.getText()]
    return []


def references(tree: Any) -> tuple[set[str], set[str]]:
    """(names the query references, names the query introduces)."""
    used: set[str] = set()
    declared: set[str] = set()
    for node in _walk(tree):
        if isinstance(node, KqlParser.NameReferenceWithDataScopeContext):
            used.add(node.Name.getText())
        elif isinstance(node, KqlParser.SimpleOrWildcardedNameReferenceContext) and "*" not in node.getText():
            used.add(node.getText())
        declared.update(_declared(node))
    return used, declared


def unknown_names(text: str, schema: Schema) -> list[str]:
    """Names the query references that neither the history table nor the query itself defines (sorted)."""
    used, declared = references(parse(text))
    known = schema.columns | declared | _BUILTIN_NAMES | {schema.table}
    return sorted(used - known)
