"""How a requests source's ``columns`` entries read the source: a column, a dotted path, or an
expression over the source's columns.

An entry is an **expression** when its text contains whitespace, a parenthesis, a quote or one of
``+ * / % | < > = , !``; otherwise it **names** a column (CSV header, Parquet column, JSON key). A
name with dots that is not itself a column is a **path**: into nested JSON objects (JSONL), or into
the JSON text held in a CSV/Parquet cell (``metadata.user_api_key_team_id`` reads the key
``user_api_key_team_id`` of the JSON in column ``metadata``). Inside an expression a column is
written bare (``startTime``) or, for names that are not plain identifiers, in double quotes
(``"gen_ai.usage.input_tokens"``); a quoted or dotted name is resolved as a name is (the literal
column first, then the path).

Expressions are parsed by DuckDB's own parser (``json_serialize_sql``) and rendered again from the
parse tree: only column references, literals, operators, CASE, CAST and the functions in
``FUNCTIONS`` are accepted, so no text of the incident file reaches SQL except as a checked literal.
A column's value is text; it is read as a number where the expression computes with it
(arithmetic, ``abs``, ``round``, a comparison with a number, ``CAST(x AS DOUBLE)``, or beside a
number in ``coalesce`` / ``CASE``) and as a timestamp where a time function takes it (``epoch_ms``,
``epoch``); a value that does not convert quarantines its record where the expression then gives
NULL (the loader builds that check from ``Expression.uses``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import duckdb

from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS
from kvforensics.core.db import one
from kvforensics.core.errors import ConfigError

# characters that make a `columns` entry an expression rather than a column name or path
_EXPRESSION_CHARS = re.compile(r"""[\s()"'+*/%|<>=,!]""")

TEXT, NUMBER, TIMESTAMP, BOOLEAN = "text", "number", "timestamp", "boolean"


# function -> (kind each argument is read as, or None: the kind the caller asked for; the SQL it becomes)
FUNCTIONS: dict[str, tuple[tuple[str | None, ...], Callable[..., str]]] = {
    # milliseconds / seconds since 1970-01-01 UTC, fractional (microsecond resolution)
    "epoch_ms": ((TIMESTAMP,), lambda t: f"(epoch_us({t}) / 1000.0)"),
    "epoch": ((TIMESTAMP,), lambda t: f"(epoch_us({t}) / 1000000.0)"),
    "abs": ((NUMBER,), lambda x: f"abs({x})"),
    "round": ((NUMBER, NUMBER), lambda x, n="0": f"round({x}, TRY_CAST({n} AS INTEGER))"),
    "floor": ((NUMBER,), lambda x: f"floor({x})"),
    "ceil": ((NUMBER,), lambda x: f"ceil({x})"),
    "lower": ((TEXT,), lambda x: f"lower({x})"),
    "upper": ((TEXT,), lambda x: f"upper({x})"),
    "trim": ((TEXT,), lambda x: f"trim({x})"),
    "left": ((TEXT, NUMBER), lambda x, n: f"left({x}, TRY_CAST({n} AS BIGINT))"),
    "concat": ((TEXT,), lambda *xs: f"concat({', '.join(xs)})"),
    "nullif": ((None, None), lambda a, b: f"nullif({a}, {b})"),
    "least": ((None,), lambda *xs: f"least({', '.join(xs)})"),
    "greatest": ((None,), lambda *xs: f"greatest({', '.join(xs)})"),
}
_ARITHMETIC = {"+", "-", "*", "/", "%"}
_COMPARISONS = {
    "COMPARE_EQUAL": "=",
    "COMPARE_NOTEQUAL": "<>",
    "COMPARE_LESSTHAN": "<",
    "COMPARE_GREATERTHAN": ">",
    "COMPARE_LESSTHANOREQUALTO": "<=",
    "COMPARE_GREATERTHANOREQUALTO": ">=",
    "COMPARE_DISTINCT_FROM": "IS DISTINCT FROM",
    "COMPARE_NOT_DISTINCT_FROM": "IS NOT DISTINCT FROM",
}
_CASTS = {"DOUBLE": NUMBER, "FLOAT": NUMBER, "BIGINT": NUMBER, "INTEGER": NUMBER, "VARCHAR": TEXT}
_NUMBER_LITERAL = re.compile(r"-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?")


class ExpressionError(ValueError):
    """An expression the mapping does not accept; the message says why (config adds where)."""


def is_expression(entry: str) -> bool:
    """Whether a ``columns`` entry is an expression (else a column name or dotted path)."""
    return bool(_EXPRESSION_CHARS.search(entry))


def json_path(name: str) -> str:
    """A dotted name as a JSON path of quoted keys (``a.b`` -> ``$."a"."b"``)."""
    return "$." + ".".join('"' + p.replace("\\", "\\\\").replace('"', '\\"') + '"' for p in name.split("."))


@dataclass(frozen=True)
class Expression:
    """A parsed, checked ``columns`` expression.

    ``refs``: the source names it reads, in order of first use; ``uses``: (ref index, kind) for
    every way a ref is read (text / number / timestamp), from which the loader builds the
    conversion checks."""

    text: str
    refs: tuple[str, ...]
    uses: tuple[tuple[int, str], ...]
    tree: str  # the parse tree (JSON), rendered again for each source by `sql`

    def can_give_value(self, present: Callable[[str], bool]) -> bool:
        """Whether the expression can give a value when only the refs *present* accepts are in the
        file: a column it needs (in arithmetic, a function) gives NULL throughout, an alternative
        (one argument of ``coalesce``, one branch of ``CASE``) need not."""
        return _gives_value(json.loads(self.tree), present)

    def sql(self, value: Callable[[int, str], str], literal: Callable[[str, str], str]) -> str:
        """The expression as SQL: ``value(i, kind)`` gives ref ``i`` read as ``kind``, and
        ``literal(text, kind)`` a text literal read as ``kind`` (the loader binds it as a parameter)."""
        return _Renderer(list(self.refs), value, literal).render(json.loads(self.tree), TEXT)


def parse_expression(text: str) -> Expression:
    """Parse and check an expression; raises ExpressionError saying what is wrong."""
    con = duckdb.connect()
    try:
        parsed = json.loads(one(con, "SELECT json_serialize_sql($q)", {"q": "SELECT " + text})[0])
    finally:
        con.close()
    if parsed.get("error"):
        raise ExpressionError(f"not a valid expression ({parsed.get('error_message', 'syntax error')})")
    statements = parsed.get("statements", [])
    node = statements[0]["node"] if len(statements) == 1 else {}
    if (
        node.get("type") != "SELECT_NODE"
        or len(node.get("select_list", [])) != 1
        or node.get("from_table", {}).get("type") != "EMPTY"
        or node.get("modifiers")
        or node.get("where_clause")
        or node.get("group_expressions")
        or node.get("having")
        or node.get("qualify")
        or node.get("cte_map", {}).get("map")
    ):
        raise ExpressionError("must be one expression over the source's columns (no query, list or clause)")
    tree = node["select_list"][0]
    refs: list[str] = []
    uses: list[tuple[int, str]] = []

    def record(i: int, kind: str) -> str:
        if (i, kind) not in uses:
            uses.append((i, kind))
        return "NULL"

    _Renderer(refs, record, lambda text, kind: "NULL").render(tree, TEXT)
    return Expression(text=text, refs=tuple(refs), uses=tuple(uses), tree=json.dumps(tree))


def check_types(expression: Expression, tz: str = "UTC") -> None:
    """Bind the expression over text columns (as the loader stages them); a type error (``abs`` of
    text, ``epoch_ms`` of a number) raises ExpressionError with DuckDB's reason."""
    slots = [f"s{i}" for i in range(len(expression.refs))]
    params: dict[str, str] = {}
    sql = expression.sql(lambda i, kind: read_as(slots[i], kind), functools.partial(bind_literal, params))
    columns = ", ".join(f"CAST(NULL AS VARCHAR) AS {s}" for s in slots) or "1 AS unused"
    con = duckdb.connect()
    try:
        query = f"SELECT CAST(({sql}) AS VARCHAR) FROM (SELECT {columns}) LIMIT 0"
        con.execute(query, {**params, "tz": tz} if "$tz" in query else params).fetchall()
    except duckdb.Error as e:
        reason = str(e).splitlines()[0]
        raise ExpressionError(f"type error in {expression.text!r}: {reason}") from None
    finally:
        con.close()


_OFFSET = r"'[T ][0-9]{2}:[0-9]{2}.*([zZ]|[+-][0-9]{2}:?[0-9]{2}|UTC|GMT)$'"


def read_as(text_sql: str, kind: str) -> str:
    """SQL reading a text value as ``kind``; NULL where it does not convert (never an error). A
    timestamp is ISO-8601 (without an offset: in the source's zone, $tz) or a number of seconds,
    milliseconds, microseconds or nanoseconds since 1970, told by its magnitude as ``ts`` is."""
    if kind == NUMBER:
        return f"TRY_CAST({text_sql} AS DOUBLE)"
    if kind == TIMESTAMP:
        n = f"TRY_CAST({text_sql} AS DOUBLE)"
        seconds = (
            f"CASE WHEN abs({n}) >= 1e17 THEN {n} / 1e9 WHEN abs({n}) >= 1e14 THEN {n} / 1e6 "
            f"WHEN abs({n}) >= 1e11 THEN {n} / 1e3 ELSE {n} END"
        )
        return (
            f"CASE WHEN regexp_full_match({text_sql}, '-?[0-9]+(\\.[0-9]+)?') THEN "
            f"CASE WHEN abs({seconds}) < 1e11 THEN to_timestamp({seconds}) END "
            f"WHEN regexp_matches({text_sql}, {_OFFSET}) THEN TRY_CAST({text_sql} AS TIMESTAMPTZ) "
            f"ELSE timezone($tz, TRY_CAST({text_sql} AS TIMESTAMP)) END"
        )
    return text_sql


def bind_literal(params: dict[str, str], text: str, kind: str) -> str:
    """A text literal of an expression as a new parameter of ``params`` (read as ``kind``)."""
    name = f"kvf_text{len(params)}"
    params[name] = text
    return read_as(f"${name}", kind) if kind == TIMESTAMP else f"CAST(${name} AS VARCHAR)"


class _Renderer:
    """Renders a parse tree as SQL, refusing every node it does not know."""

    def __init__(self, refs: list[str], value: Callable[[int, str], str], literal: Callable[[str, str], str]) -> None:
        self.refs = refs
        self.value = value
        self.literal = literal

    def ref(self, name: str, kind: str) -> str:
        if name not in self.refs:
            self.refs.append(name)
        return self.value(self.refs.index(name), kind)

    def render(self, node: dict[str, Any], kind: str) -> str:
        cls = node.get("class")
        if cls == "COLUMN_REF":
            return self.ref(".".join(node["column_names"]), kind)
        if cls == "CONSTANT":
            return self.constant(node["literal"], kind)
        if cls == "FUNCTION":
            return self.function(node, kind)
        if cls == "OPERATOR":
            return self.operator(node, kind)
        if cls == "COMPARISON":
            side = NUMBER if _numeric(node["left"]) or _numeric(node["right"]) else TEXT
            op = _COMPARISONS.get(node["type"])
            if op is None:
                raise ExpressionError(f"comparison {node['type']} is not supported")
            return f"({self.render(node['left'], side)} {op} {self.render(node['right'], side)})"
        if cls == "CONJUNCTION":
            op = {"CONJUNCTION_AND": " AND ", "CONJUNCTION_OR": " OR "}[node["type"]]
            return "(" + op.join(self.render(c, BOOLEAN) for c in node["children"]) + ")"
        if cls == "CASE":
            kind = NUMBER if _numeric(node) else kind
            checks = " ".join(
                f"WHEN {self.render(c['when_expr'], BOOLEAN)} THEN {self.render(c['then_expr'], kind)}"
                for c in node["case_checks"]
            )
            return f"(CASE {checks} ELSE {self.render(node['else_expr'], kind)} END)"
        if cls == "CAST":
            target = node["type_expr"].get("type_name", "").upper()
            if target not in _CASTS or node["type_expr"].get("children"):
                raise ExpressionError(f"CAST to {target or 'that type'} is not supported; use one of {sorted(_CASTS)}")
            return f"TRY_CAST({self.render(node['child'], _CASTS[target])} AS {target})"
        what = {
            "SUBQUERY": "a subquery",
            "STAR": "*",
            "PARAMETER": "a parameter",
            "LAMBDA": "a lambda or ->",
            "WINDOW": "a window function",
            "COLLATE": "COLLATE",
        }.get(str(cls), str(cls).lower())
        raise ExpressionError(f"{what} is not allowed in a column expression")

    def constant(self, literal: dict[str, str], kind: str) -> str:
        lit_kind, text = literal.get("kind"), literal.get("text", "")
        if lit_kind == "STRING":
            if kind == NUMBER:
                raise ExpressionError(f"text {text!r} where a number is needed")
            return self.literal(text, kind)
        if lit_kind == "NULL_LITERAL":
            return "NULL"
        if lit_kind == "BOOLEAN" and text in ("true", "false"):
            return text.upper()
        if _NUMBER_LITERAL.fullmatch(text):
            return f"CAST({text} AS DOUBLE)" if kind == NUMBER or not text.lstrip("-").isdigit() else text
        raise ExpressionError(f"literal {text!r} is not supported")

    def function(self, node: dict[str, Any], kind: str) -> str:
        name = node["function_name"].lower()
        args = [a["expression"] for a in node.get("arguments", [])]
        if (
            node.get("schema")
            or node.get("catalog")
            or node.get("distinct")
            or node.get("filter")
            or node.get("order_bys", {}).get("orders")
        ):
            raise ExpressionError(f"{name}(...) may not be qualified, DISTINCT, FILTERed or ordered")
        if node.get("is_operator"):
            if name in _ARITHMETIC:
                parts = [self.render(a, NUMBER) for a in args]
                return f"({name}{parts[0]})" if len(parts) == 1 else f"({f' {name} '.join(parts)})"
            if name in ("||", "~~", "!~~"):
                op = {"||": "||", "~~": "LIKE", "!~~": "NOT LIKE"}[name]
                return f"({f' {op} '.join(self.render(a, TEXT) for a in args)})"
            raise ExpressionError(f"operator {name} is not supported")
        if name not in FUNCTIONS:
            raise ExpressionError(
                f"function {name}() is not allowed; allowed: {', '.join(sorted(FUNCTIONS))}, coalesce, CASE, CAST"
            )
        kinds, expand = FUNCTIONS[name]
        if None in kinds and any(_numeric(a) for a in args):
            kind = NUMBER  # nullif / least / greatest beside a number compare numbers
        rendered = [self.render(a, (kinds[min(i, len(kinds) - 1)] or kind)) for i, a in enumerate(args)]
        try:
            return expand(*rendered)
        except TypeError:
            raise ExpressionError(f"{name}() does not take {len(args)} argument(s)") from None

    def operator(self, node: dict[str, Any], kind: str) -> str:
        children = node.get("children", [])
        op = node["type"]
        if op == "OPERATOR_COALESCE":
            kind = NUMBER if _numeric(node) else kind
            return "coalesce(" + ", ".join(self.render(c, kind) for c in children) + ")"
        if op == "OPERATOR_NOT":
            return f"(NOT {self.render(children[0], BOOLEAN)})"
        if op in ("OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL"):
            return f"({self.render(children[0], TEXT)} IS {'NOT ' if op.endswith('NOT_NULL') else ''}NULL)"
        if op in ("COMPARE_IN", "COMPARE_NOT_IN"):
            side = NUMBER if any(_numeric(c) for c in children[1:]) else TEXT
            items = ", ".join(self.render(c, side) for c in children[1:])
            return f"({self.render(children[0], side)} {'NOT ' if op == 'COMPARE_NOT_IN' else ''}IN ({items}))"
        raise ExpressionError(f"operator {op} is not supported")


# functions that skip NULL arguments (a value if any argument has one); the others give NULL with any
_ANY_ARGUMENT = frozenset({"concat", "least", "greatest"})


def _gives_value(node: dict[str, Any], present: Callable[[str], bool]) -> bool:
    """See :meth:`Expression.can_give_value`. Conditions (comparisons, AND / OR, IS NULL) count as
    giving a value: they only choose between branches."""
    cls = node.get("class")
    if cls == "COLUMN_REF":
        return present(".".join(node["column_names"]))
    if cls == "CONSTANT":
        return node["literal"].get("kind") != "NULL_LITERAL"
    if cls == "CAST":
        return _gives_value(node["child"], present)
    if cls == "CASE":
        return any(
            _gives_value(b, present) for b in [*(c["then_expr"] for c in node["case_checks"]), node["else_expr"]]
        )
    if cls == "OPERATOR" and node.get("type") == "OPERATOR_COALESCE":
        return any(_gives_value(c, present) for c in node.get("children", []))
    if cls == "FUNCTION":
        args = [a["expression"] for a in node.get("arguments", [])]
        name = node["function_name"].lower()
        if name == "nullif":
            return _gives_value(args[0], present) if args else True
        test = any if name in _ANY_ARGUMENT else all
        return test(_gives_value(a, present) for a in args)
    return True


def _numeric(node: dict[str, Any]) -> bool:
    """Whether a node is a number (a number literal, arithmetic, a numeric function or CAST, or a
    coalesce / CASE / nullif / least / greatest of one), so the columns compared with it or beside
    it are read as numbers too."""
    cls = node.get("class")
    if cls == "CONSTANT":
        return node["literal"].get("kind") not in ("STRING", "NULL_LITERAL", "BOOLEAN")
    if cls == "OPERATOR" and node.get("type") == "OPERATOR_COALESCE":
        return any(_numeric(c) for c in node.get("children", []))
    if cls == "CASE":
        return any(_numeric(c["then_expr"]) for c in node["case_checks"]) or _numeric(node["else_expr"])
    if cls == "FUNCTION":
        name = node["function_name"].lower()
        if name in ("nullif", "least", "greatest"):
            return any(_numeric(a["expression"]) for a in node.get("arguments", []))
        return name in _ARITHMETIC or name in ("epoch_ms", "epoch", "abs", "round", "floor", "ceil")
    return cls == "CAST" and _CASTS.get(node["type_expr"].get("type_name", "").upper()) == NUMBER


# formats whose stagers read any column a mapping names (the others map their own records)
EXPRESSION_FORMATS = ("jsonl", "csv", "parquet", "otlp_json")


def source_mapping(
    raw: Mapping[str, Any], columns: Mapping[str, str], fmt: str, where: str
) -> tuple[dict[str, dict[str, str]], tuple[str, ...], dict[str, Expression]]:
    """The value maps, null tokens and parsed expressions of a ``requests`` source's table, checked
    (syntax, allowed functions, types); a problem is a ConfigError naming the key."""
    values_raw = raw.get("values", {})
    if not isinstance(values_raw, Mapping) or not all(isinstance(m, Mapping) for m in values_raw.values()):
        raise ConfigError(
            "values must be a table of canonical field = { source value = canonical value }", location=where
        )
    values: dict[str, dict[str, str]] = {}
    for canonical, table in values_raw.items():
        if canonical not in CANONICAL_REQUEST_FIELDS:
            raise ConfigError(
                f"values maps unknown canonical field {canonical!r}; canonical fields are "
                f"{list(CANONICAL_REQUEST_FIELDS)}",
                location=where,
            )
        bad = [k for k, v in table.items() if not isinstance(v, (str, int, float)) or isinstance(v, bool)]
        if bad:
            raise ConfigError(f"values.{canonical}: {bad[0]!r} must map to a text or a number", location=where)
        values[canonical] = {str(k): _value_text(v) for k, v in table.items()}
    tokens = raw.get("null_tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(
            "null_tokens must be a list of texts, e.g. null_tokens = [\"\", \"null\", \"-\"]", location=where
        )
    expressions: dict[str, Expression] = {}
    for canonical, entry in columns.items():
        if not is_expression(entry):
            continue
        if fmt not in EXPRESSION_FORMATS:
            raise ConfigError(
                f"columns.{canonical}: expressions need format {', '.join(EXPRESSION_FORMATS)}; "
                f"format {fmt!r} maps its own records (name a field or path instead)",
                location=where,
            )
        try:
            expressions[canonical] = parse_expression(entry)
            check_types(expressions[canonical], str(raw.get("timezone", "UTC")))
        except ExpressionError as e:
            raise ConfigError(f"columns.{canonical}: {e}", location=where) from None
    return values, tuple(t.strip() for t in tokens), expressions


def _value_text(value: str | int | float) -> str:
    return value if isinstance(value, str) else repr(value)
