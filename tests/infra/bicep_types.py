"""Checks infra/**/*.bicep and *.bicepparam against Azure's published resource types: the bicep-types data the
Bicep compiler type-checks with (../shared/azure-types, beside the checkout), because the compiler itself cannot
be installed here.

The templates are read with tree-sitter-bicep, which keeps positions (pycep-parser, behind bicep_model.py, keeps
none), and what can be known before deployment is folded: literals, objects, arrays, variables, a `for` body (one
item stands for all), both branches of a ternary, both sides of `??`, and a parameter's @allowed values. Anything
else (parameters without @allowed, properties of other resources, module outputs, function calls) is an
expression: its value is skipped and counted, but the property names written around it are checked wherever a
type applies, inside variables too. Reads such as `account.properties.primaryEndpoints.blob` and
`module.outputs.x` are checked by name. A property typed `any` in the data (a Logic App definition, for one) is not
checkable; such blocks are listed with the number of names inside them.

Run `python -m tests.infra.bicep_types` for the findings and the counts; tests/infra/test_bicep_types.py runs it
in the test command and prints the counts at the end of the run (tests/infra/conftest.py)."""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tree_sitter
import tree_sitter_bicep

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
# CI checks ../shared out beside the repository; locate it from the checkout, never by an absolute path.
TYPES_DIR = ROOT.parent / "shared" / "azure-types" / "generated"

# bicep-types flags (Azure/bicep-types src/bicep-types/src/types.ts: ObjectTypePropertyFlags, ResourceScope).
REQUIRED = 1
READ_ONLY = 2
SCOPE_BITS = {"tenant": 1, "managementGroup": 2, "subscription": 4, "resourceGroup": 8}
EXTENSION_SCOPE = 16
# What a resource or module body may hold besides its type's own properties (Bicep adds these itself).
RESOURCE_KEYWORDS = frozenset({"parent", "scope", "dependsOn"})
EXISTING_KEYS = frozenset({"name", "parent", "scope", "dependsOn"})
MODULE_KEYS = frozenset({"name", "params", "scope", "dependsOn"})

# What kind of value a function returns, where that is fixed; the rest are "any" (take, first, json, union...).
_CALL_KINDS = {
    **dict.fromkeys(
        [
            *("base64", "base64ToString", "concat", "dataUri", "format", "guid", "join", "loadTextContent"),
            *("newGuid", "padLeft", "readEnvironmentVariable", "replace", "resourceId", "string", "substring"),
            *("subscriptionResourceId", "tenantResourceId", "extensionResourceId", "toLower", "toUpper", "trim"),
            *("uniqueString", "uri", "uriComponent", "utcNow"),
        ],
        "string",
    ),
    **dict.fromkeys(["int", "length", "indexOf", "lastIndexOf"], "int"),
    **dict.fromkeys(["bool", "contains", "empty", "endsWith", "startsWith"], "bool"),
    **dict.fromkeys(["array", "range", "split", "items"], "array"),
}
_BOOL_OPERATORS = frozenset({"==", "!=", "=~", "!~", "<", "<=", ">", ">=", "&&", "||"})
_INT_OPERATORS = frozenset({"+", "-", "*", "/", "%"})
_PRIMITIVES = {"string": "string", "int": "int", "bool": "bool", "object": "object", "array": "array"}
_TYPE_KINDS = {
    "StringType": "string",
    "StringLiteralType": "string",
    "UnionType": "string",
    "IntegerType": "int",
    "BooleanType": "bool",
    "ObjectType": "object",
    "DiscriminatedObjectType": "object",
    "ArrayType": "array",
}
_LIMITS = frozenset({"minValue", "maxValue", "minLength", "maxLength"})
_ESCAPES = {"\\'": "'", "\\\\": "\\", "\\n": "\n", "\\r": "\r", "\\t": "\t", "\\$": "$"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# --- values as far as they are known before deployment ----------------------------------------------------------


@dataclass(frozen=True)
class Lit:
    """A literal: string, integer, bool or null (null leaves the property out)."""

    value: str | int | bool | None
    line: int
    origin: str = ""  # where a literal not written at the use comes from, e.g. "@allowed of param x"


@dataclass(frozen=True)
class Prop:
    key: str | None  # None: a computed name ('${expression}')
    line: int
    value: Value


@dataclass(frozen=True)
class Obj:
    props: tuple[Prop, ...]
    line: int

    def get(self, key: str) -> Prop | None:
        return next((p for p in self.props if p.key == key), None)


@dataclass(frozen=True)
class Arr:
    items: tuple[Value, ...]
    line: int
    loop: bool = False  # a `for` expression: its one item stands for all


@dataclass(frozen=True)
class Expr:
    """A value known only at deployment; kind is what it surely is (string/int/bool/object/array) or 'any'."""

    kind: str
    line: int
    text: str


@dataclass(frozen=True)
class OneOf:
    """Each option may be the value (ternary branches, a parameter's @allowed values)."""

    options: tuple[Value, ...]
    line: int


Value = Lit | Obj | Arr | Expr | OneOf


# --- declarations ---------------------------------------------------------------------------------------------


@dataclass
class Param:
    name: str
    line: int
    kind: str  # string/int/bool/object/array, or any (user-defined and literal types)
    required: bool  # no default value and not nullable
    allowed: tuple[str | int | bool | None, ...] | None
    limits: dict[str, int]  # minValue, maxValue, minLength, maxLength


@dataclass
class Declaration:
    """A resource or a module."""

    symbol: str
    line: int
    type_text: str  # 'Microsoft.X/y@version' as written (relative for nested resources), or the module path
    existing: bool
    loop: bool
    condition: bool
    body: Obj
    enclosing: Declaration | None  # the resource a nested resource is declared in


@dataclass
class BicepFile:
    path: Path
    rel: str
    target_scope: str = "resourceGroup"
    params: dict[str, Param] = field(default_factory=dict)
    variables: dict[str, Value] = field(default_factory=dict)
    resources: list[Declaration] = field(default_factory=list)
    modules: list[Declaration] = field(default_factory=list)
    syntax_errors: list[int] = field(default_factory=list)
    using: tuple[str, int] | None = None  # .bicepparam: the template path and its line
    outputs: set[str] = field(default_factory=set)
    reads: list[Read] = field(default_factory=list)


@dataclass(frozen=True)
class Read:
    """`symbol.a.b` somewhere in the file: a property of a resource or an output of a module, read by name."""

    symbol: str
    names: tuple[str, ...]
    line: int


_LANGUAGE = tree_sitter.Language(tree_sitter_bicep.language())


def _line(node: tree_sitter.Node) -> int:
    return node.start_point[0] + 1


def _named(node: tree_sitter.Node) -> list[tree_sitter.Node]:
    return [child for child in node.named_children if child.type != "comment"]


class _Reader:
    """One file's declarations, with every value folded as far as it is known."""

    def __init__(self, path: Path, rel: str, source: bytes) -> None:
        self.source = source
        self.file = BicepFile(path=path, rel=rel)
        self._variable_nodes: dict[str, tree_sitter.Node] = {}
        self._symbols: set[str] = set()
        self._evaluating: set[str] = set()

    def text(self, node: tree_sitter.Node) -> str:
        return self.source[node.start_byte : node.end_byte].decode("utf-8")

    def read(self) -> BicepFile:
        root = tree_sitter.Parser(_LANGUAGE).parse(self.source).root_node
        stack = [root]
        while stack:
            node = stack.pop()
            if node.type == "ERROR" or node.is_missing:
                self.file.syntax_errors.append(_line(node))
            stack.extend(node.children)
        declarations = []
        for node in _named(root):
            named = _named(node)
            if node.type == "target_scope_assignment":
                self.file.target_scope = self.string(named[-1]) or "resourceGroup"
            elif node.type == "parameter_declaration":
                self._param(node)
            elif node.type == "variable_declaration":
                self._variable_nodes[self.text(named[0])] = named[-1]
            elif node.type == "output_declaration":
                self.file.outputs.add(self.text(named[0]))
            elif node.type in {"resource_declaration", "module_declaration"}:
                self._symbols.add(self.text(named[0]))
                declarations.append(node)
        for name in self._variable_nodes:
            self.file.variables[name] = self._variable(name, _line(self._variable_nodes[name]))
        for node in declarations:
            self._declaration(node, None, frozenset())
        self._reads(root)
        self.file.reads.sort(key=lambda read: read.line)
        return self.file

    def _reads(self, root: tree_sitter.Node) -> None:
        """Every outermost `symbol.a.b` (also `symbol[i].a`) on a resource or module symbol; a trailing method call
        (`.listKeys()`) is left out, and so is anything after an index into a property."""
        stack = [root]
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            parent = node.parent
            if node.type != "member_expression" or parent is None:
                continue
            if parent.type == "member_expression" and parent.child_by_field_name("object") == node:
                continue  # not the outermost
            names: list[str] = []
            if parent.type == "call_expression" and parent.child_by_field_name("function") == node:
                node = node.child_by_field_name("object") or node  # a method: read what it is called on
            while node.type == "member_expression":
                names.append(self.text(node.child_by_field_name("property") or node))
                node = node.child_by_field_name("object") or node
            if node.type == "subscript_expression":
                node = node.child_by_field_name("object") or node  # one instance of a resource loop
            if node.type == "identifier" and self.text(node) in self._symbols and names:
                self.file.reads.append(Read(self.text(node), tuple(reversed(names)), _line(node)))

    # declarations

    def _param(self, node: tree_sitter.Node) -> None:
        named = _named(node)
        name = self.text(named[0])
        type_text = self.text(named[1]) if len(named) > 1 else ""
        has_default = any(child.type == "=" for child in node.children)
        allowed: tuple[str | int | bool | None, ...] | None = None
        limits: dict[str, int] = {}
        for decorator, argument in self._decorators(node):
            if decorator == "allowed" and isinstance(argument, Arr):
                allowed = tuple(item.value for item in argument.items if isinstance(item, Lit))
            elif decorator in _LIMITS and isinstance(argument, Lit) and _kind_of(argument.value) == "int":
                limits[decorator] = int(argument.value or 0)
        self.file.params[name] = Param(
            name=name,
            line=_line(node),
            kind=_PRIMITIVES.get(type_text, "any"),
            required=not has_default and not type_text.endswith("?"),
            allowed=allowed,
            limits=limits,
        )

    def _decorators(self, node: tree_sitter.Node) -> Iterator[tuple[str, Value | None]]:
        previous = node.prev_named_sibling
        while previous is not None and previous.type == "comment":
            previous = previous.prev_named_sibling
        if previous is None or previous.type != "decorators":
            return
        for decorator in _named(previous):
            call = _named(decorator)[0]
            if call.type != "call_expression":
                continue
            function = call.child_by_field_name("function")
            arguments = call.child_by_field_name("arguments")
            values = _named(arguments) if arguments is not None else []
            name = self.text(function).removeprefix("sys.") if function is not None else ""
            yield name, (self.value(values[0], frozenset()) if values else None)

    def _declaration(self, node: tree_sitter.Node, enclosing: Declaration | None, local: frozenset[str]) -> None:
        named = _named(node)
        body_node = named[-1]
        loop = condition = False
        if body_node.type == "for_statement":
            loop = True
            local = local | self._loop_names(body_node)
            body_node = body_node.child_by_field_name("body") or _named(body_node)[-1]
        if body_node.type == "if_statement":
            condition = True
            body_node = _named(body_node)[-1]
        declaration = Declaration(
            symbol=self.text(named[0]),
            line=_line(node),
            type_text=self.string(named[1]) or "",
            existing=any(child.type == "existing" for child in node.children),
            loop=loop,
            condition=condition,
            body=self._object(body_node, local) if body_node.type == "object" else Obj((), _line(body_node)),
            enclosing=enclosing,
        )
        if node.type == "module_declaration":
            self.file.modules.append(declaration)
            return
        self.file.resources.append(declaration)
        if body_node.type == "object":
            for prop in _named(body_node):
                inner = _named(prop)
                if prop.type == "object_property" and inner and inner[0].type == "resource_declaration":
                    self._declaration(inner[0], declaration, local)

    def _loop_names(self, node: tree_sitter.Node) -> frozenset[str]:
        names = set()
        initializer = node.child_by_field_name("initializer")
        if initializer is not None:
            names.add(self.text(initializer))
        for child in _named(node):
            if child.type == "for_loop_parameters":
                names.update(self.text(part) for part in _named(child))
        return frozenset(names)

    # values

    def string(self, node: tree_sitter.Node) -> str | None:
        """A string literal's value; None for an interpolated string or a non-string node."""
        if node.type != "string":
            return None
        parts = []
        for child in node.named_children:
            if child.type == "interpolation":
                return None
            text = self.text(child)
            if child.type == "escape_sequence":
                text = _ESCAPES.get(text) or chr(int(text[3:-1], 16))
            parts.append(text)
        return "".join(parts)

    def value(self, node: tree_sitter.Node, local: frozenset[str]) -> Value:
        line, kind = _line(node), node.type
        if kind in {"string", "number", "boolean", "null"}:
            return self._literal(node)
        if kind in {"object", "array", "for_statement"}:
            return self._collection(node, local)
        if kind == "parenthesized_expression":
            return self.value(_named(node)[0], local)
        if kind == "identifier":
            return self._reference(self.text(node), line, local)
        alternatives = self._alternatives(node)
        if alternatives:
            return OneOf(tuple(self.value(branch, local) for branch in alternatives), line)
        return Expr(self._expression_kind(node), line, " ".join(self.text(node).split())[:80])

    def _literal(self, node: tree_sitter.Node) -> Value:
        line, kind = _line(node), node.type
        if kind == "string":
            text = self.string(node)
            return Lit(text, line) if text is not None else Expr("string", line, self.text(node))
        if kind == "number":
            return Lit(int(self.text(node)), line)
        return Lit(self.text(node) == "true" if kind == "boolean" else None, line)

    def _collection(self, node: tree_sitter.Node, local: frozenset[str]) -> Value:
        if node.type == "object":
            return self._object(node, local)
        if node.type == "array":
            return Arr(tuple(self.value(item, local) for item in _named(node)), _line(node))
        body = node.child_by_field_name("body") or _named(node)[-1]
        return Arr((self.value(body, local | self._loop_names(node)),), _line(node), loop=True)

    def _alternatives(self, node: tree_sitter.Node) -> list[tree_sitter.Node]:
        """The branches of `c ? a : b` and the sides of `a ?? b`: each may be the value."""
        if node.type == "ternary_expression":
            branches = [node.child_by_field_name("consequence"), node.child_by_field_name("alternative")]
        elif node.type == "binary_expression" and self._operator(node) == "??":
            branches = [node.child_by_field_name("left"), node.child_by_field_name("right")]
        else:
            return []
        return [branch for branch in branches if branch is not None]

    def _operator(self, node: tree_sitter.Node) -> str:
        operator = node.child_by_field_name("operator")
        return self.text(operator) if operator is not None else ""

    def _expression_kind(self, node: tree_sitter.Node) -> str:
        if node.type == "call_expression":
            function = node.child_by_field_name("function")
            if function is not None and function.type == "identifier":
                return _CALL_KINDS.get(self.text(function), "any")
        elif node.type == "binary_expression":
            operator = self._operator(node)
            if operator in _BOOL_OPERATORS:
                return "bool"
            if operator in _INT_OPERATORS:
                return "int"
        elif node.type == "unary_expression":
            return "bool" if self._operator(node) == "!" else "int"
        return "any"

    def _object(self, node: tree_sitter.Node, local: frozenset[str]) -> Obj:
        props = []
        for prop in _named(node):
            inner = _named(prop)
            if prop.type != "object_property" or len(inner) < 2:
                continue  # nested resources are read as declarations of their own
            key_node, value_node = inner[0], inner[-1]
            key = self.text(key_node) if key_node.type == "identifier" else self.string(key_node)
            props.append(Prop(key, _line(key_node), self.value(value_node, local)))
        return Obj(tuple(props), _line(node))

    def _reference(self, name: str, line: int, local: frozenset[str]) -> Value:
        if name in local:
            return Expr("any", line, name)
        if name in self._variable_nodes:
            return self._variable(name, line)
        param = self.file.params.get(name)
        if param is not None:
            if param.allowed is not None and param.kind in {"string", "int", "bool"}:
                origin = f"@allowed of param {name}"
                return OneOf(tuple(Lit(value, line, origin) for value in param.allowed), line)
            return Expr(param.kind, line, name)
        return Expr("object" if name in self._symbols else "any", line, name)

    def _variable(self, name: str, line: int) -> Value:
        if name in self.file.variables:
            return self.file.variables[name]
        if name in self._evaluating:  # a cycle: Bicep rejects it; stay safe
            return Expr("any", line, name)
        self._evaluating.add(name)
        value = self.value(self._variable_nodes[name], frozenset())
        self._evaluating.discard(name)
        self.file.variables[name] = value
        return value


def read_bicep(path: Path, rel: str) -> BicepFile:
    return _Reader(path, rel, path.read_bytes()).read()


def read_bicepparam(path: Path, rel: str) -> BicepFile:
    """tree-sitter-bicep has no .bicepparam grammar, so `param x = v` is read as `var x = v` (same lines, so the
    values parse as expressions) and `using` is taken apart by hand."""
    text = path.read_text(encoding="utf-8")
    using = None
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = re.match(r"\s*using\s+'([^']*)'", line)
        if match:
            using = (match.group(1), number)
        lines.append("// " + line if match else re.sub(r"^(\s*)param(\s)", r"\1var\2", line))
    file = _Reader(path, rel, "\n".join(lines).encode("utf-8")).read()
    file.using = using
    return file


# --- the types data -------------------------------------------------------------------------------------------


class TypeFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.types: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
        self.resources = {entry["name"].lower(): entry for entry in self.types if entry["$type"] == "ResourceType"}

    def get(self, ref: dict[str, Any]) -> dict[str, Any]:
        pointer: str = ref["$ref"]
        if not pointer.startswith("#/"):
            raise ValueError(f"{self.path}: {pointer} points into another file; this reader follows only '#/n'")
        return self.types[int(pointer[2:])]


class TypeLibrary:
    """generated/<provider>/<namespace>/<api-version>/types.json, loaded when first needed."""

    def __init__(self, generated: Path) -> None:
        if not generated.is_dir():
            raise FileNotFoundError(
                f"Azure resource types not found at {generated}: the check needs ../shared/azure-types beside the "
                "repository (see its SOURCE.md)"
            )
        self.root = generated
        self._files: dict[tuple[str, str], list[Path]] = {}
        for path in sorted(generated.glob("*/*/*/types.json")):
            self._files.setdefault((path.parent.parent.name.lower(), path.parent.name), []).append(path)
        self._loaded: dict[Path, TypeFile] = {}

    def versions(self, namespace: str) -> list[str]:
        return sorted(version for ns, version in self._files if ns == namespace.lower())

    def _load(self, path: Path) -> TypeFile:
        if path not in self._loaded:
            self._loaded[path] = TypeFile(path)
        return self._loaded[path]

    @property
    def loaded(self) -> list[Path]:
        return sorted(self._loaded)

    def resource(self, full_type: str, version: str) -> tuple[TypeFile, dict[str, Any]] | str:
        """The type file and ResourceType entry, or why the data does not hold it."""
        namespace = full_type.split("/", 1)[0]
        paths = self._files.get((namespace.lower(), version))
        if not paths:
            held = self.versions(namespace)
            where = f"held api-versions of {namespace}: {', '.join(held)}" if held else f"no {namespace} types at all"
            return (
                f"api-version {version} of {namespace} is not held in ../shared/azure-types ({where}); not evidence "
                "of an error: pick a held api-version or add its types.json"
            )
        key = f"{full_type}@{version}".lower()
        for path in paths:
            type_file = self._load(path)
            if key in type_file.resources:
                return type_file, type_file.resources[key]
        other = [v for v in self.versions(namespace) if v != version and self._has(full_type, v)]
        names = sorted({n.split("@")[0] for p in paths for n in self._load(p).resources})
        close = difflib.get_close_matches(full_type.lower(), names, n=1)
        hint = f"; did you mean {self._spelling(close[0], paths)}?" if close else ""
        also = f"; held at api-versions {', '.join(other)}" if other else ""
        return f"resource type {full_type} is not in the data for api-version {version}{hint}{also}"

    def _has(self, full_type: str, version: str) -> bool:
        paths = self._files.get((full_type.split("/", 1)[0].lower(), version), [])
        return any(f"{full_type}@{version}".lower() in self._load(p).resources for p in paths)

    def _spelling(self, lowered: str, paths: list[Path]) -> str:
        for path in paths:
            for entry in self._load(path).resources.values():
                if entry["name"].split("@")[0].lower() == lowered:
                    return str(entry["name"].split("@")[0])
        return lowered


# --- the check ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    subject: str  # the resource, module or parameter file it is about
    path: str  # property path inside it
    kind: str
    message: str

    def __str__(self) -> str:
        path = f" {self.path}" if self.path else ""
        return f"{self.file}:{self.line}: {self.subject}{path}: {self.message} [{self.kind}]"


@dataclass(frozen=True)
class AnyBlock:
    file: str
    line: int
    subject: str
    path: str
    names: int  # property names inside that nothing checks


@dataclass
class Stats:
    bicep_files: int = 0
    bicepparam_files: int = 0
    resources: int = 0
    resolved: int = 0
    existing: int = 0
    in_loops: int = 0
    conditional: int = 0
    nested: int = 0
    with_parent: int = 0
    modules: int = 0
    property_names: int = 0
    literal_values: int = 0
    enum_values: int = 0
    open_enum_values: int = 0
    required: int = 0
    module_params: int = 0
    bicepparam_params: int = 0
    property_reads: int = 0
    expressions: int = 0
    any_values: int = 0
    any_blocks: list[AnyBlock] = field(default_factory=list)
    type_files: list[str] = field(default_factory=list)


@dataclass
class Report:
    findings: list[Finding]
    stats: Stats

    def summary(self) -> str:
        s = self.stats
        lines = [
            f"Bicep against Azure's resource types: {s.bicep_files} .bicep + {s.bicepparam_files} .bicepparam files, "
            f"{len(s.type_files)} types.json files (../shared/azure-types)",
            f"  declarations: {s.resources} resources, {s.resolved} resolved to a type ({s.existing} existing, "
            f"{s.in_loops} in loops, {s.conditional} conditional, {s.nested} nested, {s.with_parent} with parent); "
            f"{s.modules} modules",
            f"  checked: {s.property_names} property names, {s.required} required properties, "
            f"{s.property_reads} property reads (resource properties, module outputs)",
            f"           {s.literal_values} literal values ({s.enum_values} against closed enums; "
            f"{s.open_enum_values} went to open enums, which take any string)",
            f"           {s.module_params} module parameters, {s.bicepparam_params} .bicepparam parameters",
            f"  skipped: {s.expressions} values known only at deployment (expressions: names checked, values not), "
            f"{s.any_values} values of properties typed `any`",
        ]
        unchecked = sum(block.names for block in s.any_blocks)
        lines.append(f"  not checkable: {len(s.any_blocks)} untyped (`any`) blocks, {unchecked} property names inside:")
        lines.extend(
            f"    {b.file}:{b.line} {b.subject} {b.path} ({b.names} property names unchecked)" for b in s.any_blocks
        )
        lines.append(f"  findings: {len(self.findings)}")
        lines.extend(f"    {finding}" for finding in self.findings)
        return "\n".join(lines)


def _join(path: str, key: str) -> str:
    segment = key if _IDENTIFIER.fullmatch(key) else f"[{json.dumps(key)}]"
    return f"{path}.{segment}" if path and not segment.startswith("[") else f"{path}{segment}"


def _show(value: object) -> str:
    return json.dumps(value) if not isinstance(value, str) else f"'{value}'"


def _kind_of(value: str | int | bool | None) -> str:
    if value is None:
        return "null"
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "string"


def _value_kind(value: Value) -> str:
    if isinstance(value, Lit):
        return _kind_of(value.value)
    if isinstance(value, Expr):
        return value.kind
    return "object" if isinstance(value, Obj) else "array" if isinstance(value, Arr) else "any"


def _suggest(key: str, names: Iterable[str]) -> str:
    names = sorted(names)
    same = [name for name in names if name.lower() == key.lower()]
    close = same or difflib.get_close_matches(key, names, n=1, cutoff=0.7)
    return f"; did you mean '{close[0]}'?" if close else ""


def _count_names(value: Value) -> int:
    if isinstance(value, Obj):
        return sum(1 + _count_names(p.value) for p in value.props)
    if isinstance(value, Arr | OneOf):
        items = value.items if isinstance(value, Arr) else value.options
        return sum(_count_names(item) for item in items)
    return 0


def _outside(size: int, low: int | None, high: int | None) -> bool:
    return (low is not None and size < low) or (high is not None and size > high)


@dataclass(frozen=True)
class _At:
    """Where findings go (file, and the resource, module or parameter file) and the types.json to read types from."""

    file: str
    subject: str
    types: TypeFile | None = None

    @property
    def data(self) -> TypeFile:
        assert self.types is not None, "a value is checked against a type only inside a resolved resource"
        return self.types


@dataclass(frozen=True)
class _Shape:
    """An object type's properties, as one ObjectType or a discriminated element merged with its base."""

    name: str
    properties: dict[str, Any]
    additional: dict[str, Any] | None


class Checker:
    def __init__(self, library: TypeLibrary, infra: Path) -> None:
        self.library = library
        self.infra = infra
        self.findings: list[Finding] = []
        self.stats = Stats()
        self._files: dict[Path, BicepFile] = {}
        self._resolved: dict[int, tuple[TypeFile, dict[str, Any]]] = {}  # by id() of a resource declaration

    def _rel(self, path: Path) -> str:
        return path.resolve().relative_to(self.infra.parent.resolve()).as_posix()

    def bicep(self, path: Path) -> BicepFile:
        key = path.resolve()
        if key not in self._files:
            self._files[key] = read_bicep(path, self._rel(path))
        return self._files[key]

    def find(self, at: _At, line: int, path: str, kind: str, message: str) -> None:
        finding = Finding(at.file, line, at.subject, path, kind, message)
        if finding not in self.findings:  # a variable used twice would report the same place twice
            self.findings.append(finding)

    def run(self) -> Report:
        for path in sorted(self.infra.rglob("*.bicep")):
            self.stats.bicep_files += 1
            self.check_file(self.bicep(path))
        for path in sorted(self.infra.rglob("*.bicepparam")):
            self.stats.bicepparam_files += 1
            self.check_bicepparam(path)
        self.stats.type_files = [p.relative_to(self.library.root).parent.as_posix() for p in self.library.loaded]
        return Report(self.findings, self.stats)

    def check_file(self, file: BicepFile) -> None:
        for line in file.syntax_errors:
            self.find(_At(file.rel, "syntax"), line, "", "syntax", "tree-sitter-bicep cannot parse this")
        symbols = {d.symbol: d for d in file.resources if d.enclosing is None}
        for declaration in file.resources:
            self.check_resource(file, declaration, symbols)
        for module in file.modules:
            self.check_module(file, module)
        modules = {m.symbol: m for m in file.modules}
        for read in file.reads:
            if read.symbol in modules:
                self.check_output_read(file, modules[read.symbol], read)
            elif read.symbol in symbols:
                self.check_property_read(file, symbols[read.symbol], read)

    # resources

    def full_type(self, declaration: Declaration) -> tuple[str, str]:
        name, _, version = declaration.type_text.partition("@")
        if declaration.enclosing is not None and "/" not in name:
            name = f"{self.full_type(declaration.enclosing)[0]}/{name}"
        return name, version

    def check_resource(self, file: BicepFile, declaration: Declaration, symbols: dict[str, Declaration]) -> None:
        s = self.stats
        s.resources += 1
        s.existing += declaration.existing
        s.in_loops += declaration.loop
        s.conditional += declaration.condition
        s.nested += declaration.enclosing is not None
        full_type, version = self.full_type(declaration)
        at = _At(file.rel, f"{declaration.symbol} ({full_type}@{version})")
        parent_type = self._parent_type(declaration, symbols, at)
        if parent_type is not None and full_type.lower().rsplit("/", 1)[0] != parent_type.lower():
            message = f"its parent is a {parent_type}, but a {full_type} is a child of {full_type.rsplit('/', 1)[0]}"
            self.find(at, declaration.line, "", "parent", message)
        if not version or "/" not in full_type:
            self.find(at, declaration.line, "", "type", f"'{declaration.type_text}' is not a type@api-version")
            return
        found = self.library.resource(full_type, version)
        if isinstance(found, str):
            kind = "api-version-not-held" if found.startswith("api-version") else "type-not-held"
            self.find(at, declaration.line, "", kind, found)
            return
        s.resolved += 1
        at = _At(at.file, at.subject, found[0])
        body_type = at.data.get(found[1]["body"])
        self._resolved[id(declaration)] = (found[0], body_type)
        if declaration.existing:
            self._check_existing(declaration.body, body_type, at)
        else:
            self._check_scope(file, declaration, found[1], at)
            self.check_object_type(declaration.body, body_type, "", at, RESOURCE_KEYWORDS)

    def _check_existing(self, body: Obj, body_type: dict[str, Any], at: _At) -> None:
        for prop in body.props:
            if prop.key not in EXISTING_KEYS:
                message = "an `existing` reference takes only name, parent and scope"
                self.find(at, prop.line, prop.key or "", "existing", message)
        name = body.get("name")
        self.stats.required += 1
        if name is None:
            self.find(at, body.line, "name", "required", "required property 'name' is missing")
            return
        self.stats.property_names += 1
        if body_type["$type"] == "ObjectType":
            self.check_value(name.value, body_type["properties"]["name"]["type"], "name", at)

    def _parent_type(self, declaration: Declaration, symbols: dict[str, Declaration], at: _At) -> str | None:
        if declaration.enclosing is not None:
            return self.full_type(declaration.enclosing)[0]
        prop = declaration.body.get("parent")
        if prop is None:
            return None
        self.stats.with_parent += 1
        symbol = prop.value.text.split("[")[0] if isinstance(prop.value, Expr) else ""
        if symbol not in symbols:
            self.find(at, prop.line, "parent", "parent", "parent must name a resource declared in this file")
            return None
        return self.full_type(symbols[symbol])[0]

    def _check_scope(self, file: BicepFile, declaration: Declaration, resource: dict[str, Any], at: _At) -> None:
        writable = int(resource.get("writableScopes", resource.get("scopeType", 0)))
        scope = declaration.body.get("scope")
        if writable == 0:
            message = "the data says this type can only be read, not deployed: declare it `existing`"
            self.find(at, declaration.line, "", "read-only", message)
        elif scope is None:
            if not writable & SCOPE_BITS.get(file.target_scope, 0):
                message = f"this type cannot be deployed at targetScope {file.target_scope}"
                self.find(at, declaration.line, "", "scope", message)
        elif isinstance(scope.value, Expr) and scope.value.kind == "object" and not writable & EXTENSION_SCOPE:
            message = "this type is not an extension resource: it cannot take a resource as scope"
            self.find(at, scope.line, "scope", "scope", message)

    # reads of resource properties and module outputs

    def check_property_read(self, file: BicepFile, declaration: Declaration, read: Read) -> None:
        """`res.properties.x.y` must name properties the type has (read-only ones included: they are read)."""
        resolved = self._resolved.get(id(declaration))
        if resolved is None:
            return  # its type is not in the data: reported at the declaration
        type_file, declared = resolved
        at = _At(file.rel, f"{declaration.symbol} ({'@'.join(self.full_type(declaration))})", type_file)
        self.stats.property_reads += 1
        path = ""
        for name in read.names:
            if declared["$type"] == "DiscriminatedObjectType":
                declared = self._read_shape(declaration, declared, at)
            if declared["$type"] != "ObjectType":
                return  # any, or a value whose members are not typed here
            spec = declared["properties"].get(name)
            if spec is None and "additionalProperties" in declared:
                declared, path = at.data.get(declared["additionalProperties"]), _join(path, name)
                continue
            if spec is None:
                message = (
                    f"reads '{name}', which is not a property of {declared.get('name', 'object')}"
                    f"{_suggest(name, declared['properties'])}"
                )
                self.find(at, read.line, _join(path, name), "unknown-read", message)
                return
            declared, path = at.data.get(spec["type"]), _join(path, name)

    def _read_shape(self, declaration: Declaration, declared: dict[str, Any], at: _At) -> dict[str, Any]:
        """The element a read goes through: the declared one when its discriminator is a literal, else all merged."""
        prop = declaration.body.get(declared["discriminator"])
        elements = declared["elements"]
        if prop is not None and isinstance(prop.value, Lit) and prop.value.value in elements:
            element: dict[str, Any] = at.data.get(elements[prop.value.value])
            return {**element, "properties": {**declared["baseProperties"], **element["properties"]}}
        merged = dict(declared["baseProperties"])
        for ref in elements.values():
            merged.update(at.data.get(ref)["properties"])
        return {"$type": "ObjectType", "name": declared["name"], "properties": merged}

    def check_output_read(self, file: BicepFile, module: Declaration, read: Read) -> None:
        target = file.path.parent / module.type_text
        if read.names[0] != "outputs" or len(read.names) < 2 or not target.is_file():
            return  # `module.name`, or a missing module: reported at the declaration
        self.stats.property_reads += 1
        outputs = self.bicep(target).outputs
        if read.names[1] not in outputs:
            at = _At(file.rel, f"module {module.symbol} ('{module.type_text}')")
            message = f"{module.type_text} has no output '{read.names[1]}'{_suggest(read.names[1], outputs)}"
            self.find(at, read.line, f"outputs.{read.names[1]}", "unknown-output", message)

    # values against types

    def check_value(self, value: Value, ref: dict[str, Any], path: str, at: _At) -> None:
        declared = at.data.get(ref)
        kind = declared["$type"]
        expected = _TYPE_KINDS.get(kind, "any")
        if isinstance(value, OneOf):
            for option in value.options:
                self.check_value(option, ref, path, at)
        elif kind == "AnyType":
            if isinstance(value, Obj | Arr):
                self.stats.any_blocks.append(AnyBlock(at.file, value.line, at.subject, path, _count_names(value)))
            else:
                self.stats.any_values += 1
        elif isinstance(value, Lit):
            if value.value is not None:  # null leaves the property out
                self._check_literal(value, declared, path, at)
        elif _value_kind(value) not in {"any", expected}:
            shown = f"`{value.text}`" if isinstance(value, Expr) else "this"
            self.find(at, value.line, path, "type", f"{shown} is {_value_kind(value)}, the type expects {expected}")
        elif isinstance(value, Expr):
            self.stats.expressions += 1
        elif isinstance(value, Arr):
            for index, item in enumerate(value.items):
                self.check_value(item, declared["itemType"], f"{path}[{'*' if value.loop else index}]", at)
        else:
            self.check_object_type(value, declared, path, at)

    def _check_literal(self, value: Lit, declared: dict[str, Any], path: str, at: _At) -> None:
        literal = value.value
        kind = declared["$type"]
        self.stats.literal_values += 1
        shown = _show(literal) + (f" ({value.origin})" if value.origin else "")
        expected = _TYPE_KINDS.get(kind, "any")
        if _kind_of(literal) != expected:
            self.find(at, value.line, path, "type", f"{shown} is {_kind_of(literal)}, the type expects {expected}")
        elif kind == "IntegerType" and isinstance(literal, int):
            low, high = declared.get("minValue"), declared.get("maxValue")
            if _outside(literal, low, high):
                self.find(at, value.line, path, "range", f"{shown} is outside {low}..{high}")
        elif kind == "StringType" and isinstance(literal, str):
            low, high = declared.get("minLength"), declared.get("maxLength")
            if _outside(len(literal), low, high):
                self.find(at, value.line, path, "range", f"{shown} is not {low}..{high} characters long")
        elif kind in {"StringLiteralType", "UnionType"}:
            options = [at.data.get(e) for e in declared["elements"]] if kind == "UnionType" else [declared]
            if any(option["$type"] != "StringLiteralType" for option in options):
                self.stats.open_enum_values += 1  # the data marks the enum extensible: any string is accepted
                return
            self.stats.enum_values += 1
            allowed = [str(option["value"]) for option in options]
            if literal not in allowed:
                message = f"{shown} is not one of {', '.join(map(_show, allowed))}{_suggest(str(literal), allowed)}"
                self.find(at, value.line, path, "enum", message)

    def check_object_type(
        self, value: Obj, declared: dict[str, Any], path: str, at: _At, keywords: frozenset[str] = frozenset()
    ) -> None:
        if declared["$type"] == "ObjectType":
            shape = _Shape(
                str(declared.get("name", "object")), declared["properties"], declared.get("additionalProperties")
            )
            self._check_object(value, shape, path, at, keywords)
            return
        # DiscriminatedObjectType: the discriminator's value picks the element whose properties apply.
        discriminator: str = declared["discriminator"]
        elements: dict[str, dict[str, Any]] = declared["elements"]
        prop = value.get(discriminator)
        options = (prop.value.options if isinstance(prop.value, OneOf) else (prop.value,)) if prop else ()
        if prop is None:
            choices = ", ".join(map(_show, sorted(elements)))
            message = f"required property '{discriminator}' is missing (one of {choices})"
            self.find(at, value.line, _join(path, discriminator), "required", message)
        elif all(isinstance(o, Lit) and isinstance(o.value, str) for o in options):
            for option in options:
                assert isinstance(option, Lit)
                self._check_element(value, declared, option, path, at, keywords=keywords)
        else:
            self._check_any_element(value, declared, path, at, keywords)

    def _check_element(
        self, value: Obj, declared: dict[str, Any], option: Lit, path: str, at: _At, *, keywords: frozenset[str]
    ) -> None:
        chosen, line = str(option.value), option.line
        discriminator: str = declared["discriminator"]
        elements: dict[str, dict[str, Any]] = declared["elements"]
        self.stats.literal_values += 1
        self.stats.enum_values += 1
        if chosen not in elements:
            message = (
                f"{_show(chosen)} is not one of {', '.join(map(_show, sorted(elements)))}{_suggest(chosen, elements)}"
            )
            self.find(at, line, _join(path, discriminator), "enum", message)
            return
        element = at.data.get(elements[chosen])
        properties = {**declared["baseProperties"], **element["properties"]}
        shape = _Shape(str(element.get("name", declared["name"])), properties, element.get("additionalProperties"))
        self._check_object(value, shape, path, at, keywords | {discriminator})

    def _check_any_element(
        self, value: Obj, declared: dict[str, Any], path: str, at: _At, keywords: frozenset[str]
    ) -> None:
        """The discriminator is an expression: each name must belong to some element; values are not checked."""
        self.stats.expressions += 1
        names = set(declared["baseProperties"]) | {declared["discriminator"]}
        open_ended = False
        for element_ref in declared["elements"].values():
            element = at.data.get(element_ref)
            names.update(element["properties"])
            open_ended |= "additionalProperties" in element
        for item in value.props:
            if item.key is not None and item.key not in keywords:
                self.stats.property_names += 1
                if item.key not in names and not open_ended:
                    message = f"'{item.key}' is not a property of any {declared['name']}{_suggest(item.key, names)}"
                    self.find(at, item.line, _join(path, item.key), "unknown-property", message)

    def _check_object(self, value: Obj, shape: _Shape, path: str, at: _At, keywords: frozenset[str]) -> None:
        seen = set()
        for prop in value.props:
            if prop.key is None:
                if shape.additional is None:
                    message = f"a computed name, but {shape.name} has only fixed properties"
                    self.find(at, prop.line, f"{path}[<computed>]", "unknown-property", message)
                else:
                    self.check_value(prop.value, shape.additional, f"{path}[<computed>]", at)
                continue
            sub = _join(path, prop.key)
            seen.add(prop.key)
            if prop.key in keywords and prop.key not in shape.properties:
                continue  # parent/scope/dependsOn of a resource, or a discriminator: checked elsewhere
            self.stats.property_names += 1
            spec = shape.properties.get(prop.key)
            if spec is None and shape.additional is not None:
                self.check_value(prop.value, shape.additional, sub, at)
            elif spec is None:
                message = f"'{prop.key}' is not a property of {shape.name}{_suggest(prop.key, shape.properties)}"
                self.find(at, prop.line, sub, "unknown-property", message)
            elif spec["flags"] & READ_ONLY:
                self.find(at, prop.line, sub, "read-only", f"'{prop.key}' is read-only: Azure sets it")
            else:
                self.check_value(prop.value, spec["type"], sub, at)
        for name, spec in shape.properties.items():
            if spec["flags"] & REQUIRED and not spec["flags"] & READ_ONLY:
                self.stats.required += 1
                if name not in seen:
                    self.find(at, value.line, _join(path, name), "required", f"required property '{name}' is missing")

    # modules and parameter files

    def check_module(self, file: BicepFile, module: Declaration) -> None:
        self.stats.modules += 1
        self.stats.in_loops += module.loop
        self.stats.conditional += module.condition
        at = _At(file.rel, f"module {module.symbol} ('{module.type_text}')")
        target = file.path.parent / module.type_text
        if not target.is_file():
            self.find(at, module.line, "", "module", f"{module.type_text} does not exist")
            return
        for prop in module.body.props:
            if prop.key not in MODULE_KEYS:
                message = f"a module takes only {', '.join(sorted(MODULE_KEYS))}"
                self.find(at, prop.line, prop.key or "", "unknown-property", message)
        passed = module.body.get("params")
        self._check_arguments(self.bicep(target), passed.value if passed else None, module.body.line, at, "module")

    def _check_arguments(self, target: BicepFile, passed: Value | None, line: int, at: _At, kind: str) -> None:
        names: set[str] = set()
        if isinstance(passed, Obj):
            line = passed.line
            for prop in passed.props:
                if prop.key is None:
                    self.find(at, prop.line, "params[<computed>]", f"{kind}-param", "a computed parameter name")
                    continue
                names.add(prop.key)
                self.check_argument(target, prop.key, prop.value, prop.line, at, kind=kind)
        elif passed is not None:
            self.stats.expressions += 1
            return  # params given as one expression: nothing to check by name
        for param in target.params.values():
            if param.required and param.name not in names:
                message = f"required parameter '{param.name}' of {target.rel} is not given"
                self.find(at, line, f"params.{param.name}", f"{kind}-required", message)

    def check_argument(self, target: BicepFile, name: str, value: Value, line: int, at: _At, *, kind: str) -> None:
        path = f"params.{name}"
        self.stats.module_params += kind == "module"
        self.stats.bicepparam_params += kind == "bicepparam"
        param = target.params.get(name)
        if param is None:
            message = f"{target.rel} has no parameter '{name}'{_suggest(name, target.params)}"
            self.find(at, line, path, f"{kind}-param", message)
            return
        for option in value.options if isinstance(value, OneOf) else (value,):
            given = _value_kind(option)
            if given == "null":
                continue
            if "any" not in {given, param.kind} and given != param.kind:
                self.find(at, option.line, path, "type", f"{given} given, parameter '{name}' is {param.kind}")
            elif isinstance(option, Lit):
                self._check_allowed(option, param, path, at)
            else:
                self.stats.expressions += isinstance(option, Expr)

    def _check_allowed(self, option: Lit, param: Param, path: str, at: _At) -> None:
        self.stats.literal_values += 1
        literal = option.value
        shown = _show(literal) + (f" ({option.origin})" if option.origin else "")
        if param.allowed is not None and literal not in param.allowed:
            allowed = ", ".join(map(_show, param.allowed))
            self.find(at, option.line, path, "allowed", f"{shown} is not in @allowed of '{param.name}': {allowed}")
        if isinstance(literal, str):
            size, low, high = len(literal), param.limits.get("minLength"), param.limits.get("maxLength")
        elif isinstance(literal, int) and not isinstance(literal, bool):
            size, low, high = literal, param.limits.get("minValue"), param.limits.get("maxValue")
        else:
            return
        if _outside(size, low, high):
            self.find(at, option.line, path, "range", f"{shown} is outside {low}..{high} of '{param.name}'")

    def check_bicepparam(self, path: Path) -> None:
        file = read_bicepparam(path, self._rel(path))
        at = _At(file.rel, "parameters")
        for line in file.syntax_errors:
            self.find(at, line, "", "syntax", "cannot parse this parameter")
        if file.using is None:
            self.find(at, 1, "", "bicepparam", "no `using` statement")
            return
        target_path = path.parent / file.using[0]
        if not target_path.is_file():
            self.find(at, file.using[1], "", "bicepparam", f"using {file.using[0]}, which does not exist")
            return
        target = self.bicep(target_path)
        at = _At(file.rel, f"parameters of {target.rel}")
        given = Obj(tuple(Prop(name, value.line, value) for name, value in file.variables.items()), file.using[1])
        self._check_arguments(target, given, file.using[1], at, "bicepparam")


def check(infra: Path = INFRA, types_dir: Path = TYPES_DIR) -> Report:
    return Checker(TypeLibrary(types_dir), infra).run()


if __name__ == "__main__":
    report = check()
    print(report.summary())
    sys.exit(1 if report.findings else 0)
