"""Portable SQL: one source text per rule and scope script, rendered for each engine.

The rule and scope SQL is written in the subset DuckDB and Spark SQL agree on (standard joins,
window functions, CASE, COALESCE, CAST to STRING/BIGINT/DOUBLE, explicit ``NULLS FIRST|LAST`` on
every ordering key, because the engines' defaults differ). The few constructs they do not share,
or share with a different meaning, are named helpers written as ``{{ name(arg, ...) }}``; each
helper expands to the engine's own SQL and refuses an engine it has no expansion for::

    {{ json_object('basis', basis, 'instance', instance) }}
    {{ round_double(expected_ms, 1) }}

``{{ fragment('name') }}`` is the one helper that is not an engine difference: it inserts the CTEs
of ``kvforensics/sql/<name>.sql`` that several queries share.

Arguments are SQL text, split at top-level commas. Parameters are written ``$name`` (DuckDB's
named parameters) and become ``:name`` (Spark's named parameter markers) when rendered for Spark;
values are always bound, never formatted into the text.

A script statement is ``CREATE OR REPLACE [TEMP] TABLE <name> AS <query>``: DuckDB runs it as is,
the Spark backend runs the query and registers the result as a cached view (and writes the
non-TEMP ones back to the evidence database).

No transpiler is involved: each helper's expansion is written by hand per engine, and
``tests/test_spark_parity.py`` checks the expansions give the same values on both engines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import duckdb

from kvforensics.core.db import MemoryGovernor, sql, statements
from kvforensics.core.errors import KvForensicsError

ENGINES = ("duckdb", "spark")


class EngineError(KvForensicsError):
    """An engine cannot run what it was asked to, or the SQL uses something no engine supports."""


# --- helpers ---------------------------------------------------------------------------------------

Expansion = Callable[..., str]


def _json_object_duckdb(*args: str) -> str:
    return f"json_object({', '.join(args)})"


def _json_object_spark(*args: str) -> str:
    if len(args) % 2:
        raise EngineError("json_object takes key, value pairs")
    # to_json drops null fields unless told otherwise; DuckDB's json_object keeps them.
    return f"to_json(named_struct({', '.join(args)}), map('ignoreNullFields', 'false'))"


def _round_double_spark(x: str, digits: str) -> str:
    """DuckDB rounds a DOUBLE's exact binary value (ties away from zero); Spark's ``round`` rounds
    the shortest decimal that prints it, so 0.01875 (binary 0.018749999...) gives 0.0188 on Spark
    and 0.0187 on DuckDB. This rounds ``|x| * 10^digits`` to an integer with the product's exact
    error term (Dekker's two-product: ``10^digits`` has few bits, so ``ah*m`` and ``al*m`` are exact)
    and decides the only ambiguous case, a product that lands exactly on .5, by the error's sign."""
    if not re.fullmatch(r"\d", digits.strip()):
        raise EngineError(f"round_double needs a literal number of digits 0-9, got {digits!r}")
    m = f"{10 ** int(digits.strip())}D"
    # v = |x|, p = fl(v * m), ah/al = Veltkamp split of v, e = exact v * m - p
    split = "named_struct('p', kvf_v * {m}, 'ah', (134217729D * kvf_v) - ((134217729D * kvf_v) - kvf_v))"
    exact = (
        "CASE WHEN kvf_s.p - floor(kvf_s.p) = 0.5D "
        "THEN CASE WHEN (kvf_s.ah * {m} - kvf_s.p) + (kvf_v - kvf_s.ah) * {m} >= 0D "
        "THEN ceil(kvf_s.p) ELSE floor(kvf_s.p) END "
        "ELSE round(kvf_s.p, 0) END"
    ).format(m=m)
    return (
        f"(signum(CAST(({x}) AS DOUBLE)) * element_at(transform(array(abs(CAST(({x}) AS DOUBLE))), "
        f"kvf_v -> element_at(transform(array({split.format(m=m)}), "
        f"kvf_s -> CAST({exact} AS DOUBLE) / {m}), 1)), 1))"
    )


def _glob_match_spark(value: str, pattern: str) -> str:
    """DuckDB GLOB: ``*`` any text, ``?`` one character, ``[...]`` a class, ``[!...]`` a negated class,
    ``\\`` escapes the next character; case-sensitive, whole string. As a Java regex."""
    p = f"({pattern})"
    p = f"regexp_replace({p}, '\\\\\\\\([A-Za-z0-9])', '$1')"  # \a -> a (literal)
    p = f"regexp_replace({p}, '([.+^$(){{}}|])', '\\\\\\\\$1')"  # regex metacharacters literal
    p = f"regexp_replace({p}, '(?<!\\\\\\\\)\\\\*', '.*')"  # * -> .*
    p = f"regexp_replace({p}, '(?<!\\\\\\\\)\\\\?', '.')"  # ? -> .
    p = f"regexp_replace({p}, '\\\\[!', '[^')"  # [! -> [^
    return f"regexp_like({value}, concat('(?s)^', {p}, '$'))"


def _string_agg_ordered(engine: str) -> Expansion:
    def expand(value: str, separator: str, *keys: str) -> str:
        if not keys:
            raise EngineError("string_agg_ordered needs at least one ordering key")
        order = ", ".join(f"{k} ASC NULLS LAST" for k in keys)
        if engine == "duckdb":
            return f"string_agg({value}, {separator} ORDER BY {order})"
        return f"string_agg({value}, {separator}) WITHIN GROUP (ORDER BY {order})"

    return expand


def _fragment(engine: str) -> Expansion:
    def expand(name: str) -> str:
        m = re.fullmatch(r"'([a-z_][a-z0-9_]*)'", name.strip())
        if not m:
            raise EngineError(f"fragment() takes a quoted file name like 'prefix_senders', got {name!r}")
        try:
            text = sql(m.group(1))
        except FileNotFoundError:
            raise EngineError(f"fragment {m.group(1)!r}: there is no kvforensics/sql/{m.group(1)}.sql") from None
        # without its comments, so that nothing after the call is commented out
        return expand_helpers("".join(t for k, t in _segments(text) if k != "comment").strip(), engine)

    return expand


HELPERS: dict[str, dict[str, Expansion]] = {
    # JSON text of key/value pairs, nulls kept; keys in the given order.
    "json_object": {"duckdb": _json_object_duckdb, "spark": _json_object_spark},
    # The text of one top-level field of a JSON object (NULL when missing or null).
    "json_text": {
        "duckdb": lambda j, key: f"json_extract_string({j}, '$.' || {key})",
        "spark": lambda j, key: f"get_json_object({j}, concat('$.', {key}))",
    },
    # A DOUBLE rounded to n decimals as DuckDB's round does (exact binary value, ties away from zero).
    "round_double": {"duckdb": lambda x, n: f"round({x}, {n})", "spark": _round_double_spark},
    # value GLOB pattern (DuckDB semantics).
    "glob_match": {"duckdb": lambda v, p: f"({v} GLOB {p})", "spark": _glob_match_spark},
    # An instant given as a parameter (a timezone-aware datetime or NULL).
    "as_timestamp": {
        "duckdb": lambda x: f"CAST({x} AS TIMESTAMPTZ)",
        "spark": lambda x: f"CAST({x} AS TIMESTAMP)",
    },
    # ts + a DOUBLE number of milliseconds, at microsecond resolution (rounded half to even, as
    # DuckDB's CAST(DOUBLE AS BIGINT) does; Spark's CAST truncates, hence bround).
    "add_milliseconds": {
        "duckdb": lambda ts, ms: f"({ts} + to_microseconds(CAST(({ms}) * 1000 AS BIGINT)))",
        "spark": lambda ts, ms: f"timestamp_micros(unix_micros({ts}) + CAST(bround(({ms}) * 1000, 0) AS BIGINT))",
    },
    # Microseconds since the epoch of an instant (BIGINT): differences of instants, portably.
    "epoch_us": {
        "duckdb": lambda ts: f"epoch_us({ts})",
        "spark": lambda ts: f"unix_micros({ts})",
    },
    # ts + a whole number of hours.
    "add_hours": {
        "duckdb": lambda ts, n: f"({ts} + to_hours(CAST(({n}) AS BIGINT)))",
        "spark": lambda ts, n: f"timestamp_micros(unix_micros({ts}) + CAST(({n}) AS BIGINT) * 3600000000)",
    },
    # One row per whole hour from lo to hi inclusive (a set-returning expression in a SELECT list).
    "hour_series": {
        "duckdb": lambda lo, hi: f"unnest(generate_series({lo}, {hi}, INTERVAL 1 HOUR))",
        "spark": lambda lo, hi: f"explode(sequence({lo}, {hi}, INTERVAL 1 HOUR))",
    },
    # The exact, interpolated median (never an approximate percentile).
    "median": {
        "duckdb": lambda x: f"median({x})",
        "spark": lambda x: f"percentile(CAST({x} AS DOUBLE), 0.5D)",
    },
    # string_agg(value, sep) ordered by the keys, ascending, nulls last.
    "string_agg_ordered": {"duckdb": _string_agg_ordered("duckdb"), "spark": _string_agg_ordered("spark")},
    # The CTEs of kvforensics/sql/<name>.sql, shared by several queries (its first comment says which CTEs
    # of the including query it reads and which it defines), rendered for the engine.
    "fragment": {"duckdb": _fragment("duckdb"), "spark": _fragment("spark")},
    # A column name that is a reserved word in one of the engines (e.g. end).
    "column": {
        "duckdb": lambda name: f'"{_identifier(name)}"',
        "spark": lambda name: f"`{_identifier(name)}`",
    },
}


def _identifier(quoted: str) -> str:
    m = re.fullmatch(r"'([A-Za-z_][A-Za-z0-9_]*)'", quoted.strip())
    if not m:
        raise EngineError(f"column() takes a quoted plain name like 'end', got {quoted!r}")
    return m.group(1)


# --- rendering -------------------------------------------------------------------------------------

_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def _segments(text: str) -> list[tuple[str, str]]:
    """Split SQL into ('code' | 'string' | 'comment', text) segments."""
    out: list[tuple[str, str]] = []
    i, start, n = 0, 0, len(text)
    while i < n:
        if text.startswith("--", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(("code", text[start:i]))
            out.append(("comment", text[i:j]))
            i = start = j
        elif text[i] == "'":
            j = i + 1
            while j < n:
                if text[j] == "'" and text[j + 1 : j + 2] == "'":
                    j += 2
                elif text[j] == "'":
                    break
                else:
                    j += 1
            out.append(("code", text[start:i]))
            out.append(("string", text[i : j + 1]))
            i = start = j + 1
        else:
            i += 1
    out.append(("code", text[start:]))
    return [(k, t) for k, t in out if t]


def code_only(text: str) -> str:
    """The SQL with comments removed and string literals blanked to ``''`` (for linting)."""
    return "".join("''" if k == "string" else t for k, t in _segments(text) if k != "comment")


@dataclass(frozen=True)
class HelperCall:
    name: str
    args: tuple[str, ...]
    start: int
    end: int


def helper_calls(text: str) -> list[HelperCall]:
    """Every top-level ``{{ name(args) }}`` in the text, in order (raises on a malformed one)."""
    calls = []
    pos = 0
    while (i := text.find("{{", pos)) >= 0:
        m = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(").match(text, i)
        if not m:
            raise EngineError(f"malformed helper at {text[i : i + 40]!r}: write {{{{ name(arg, ...) }}}}")
        args, j = _split_args(text, m.end())
        close = re.compile(r"\s*\}\}").match(text, j)
        if not close:
            raise EngineError(f"helper {m.group(1)} is not closed with }}}}: {text[i : j + 20]!r}")
        calls.append(HelperCall(m.group(1), tuple(args), i, close.end()))
        pos = close.end()
    return calls


def _split_args(text: str, i: int) -> tuple[list[str], int]:
    """Arguments from just after '(' to the matching ')': (args, index after ')')."""
    depth, quote, args, cur = 0, False, [], i
    braces = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "'" and text[i + 1 : i + 2] == "'":
                i += 1
            elif c == "'":
                quote = False
        elif c == "'":
            quote = True
        elif text.startswith("{{", i):
            braces += 1
            i += 1
        elif text.startswith("}}", i) and braces:
            braces -= 1
            i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                args.append(text[cur:i].strip())
                if args == [""]:
                    return [], i + 1
                if not all(args):
                    raise EngineError(f"empty argument in helper call near {text[max(0, i - 60) : i + 1]!r}")
                return args, i + 1
            depth -= 1
        elif c == "," and depth == 0 and not braces:
            args.append(text[cur:i].strip())
            cur = i + 1
        i += 1
    raise EngineError(f"unbalanced parentheses in helper call near {text[max(0, i - 60) : i]!r}")


def expand_helpers(text: str, engine: str) -> str:
    """Replace every ``{{ helper(...) }}`` with the engine's SQL (helpers may nest)."""
    if engine not in ENGINES:
        raise EngineError(f"unknown engine {engine!r}; kvforensics runs on {', '.join(ENGINES)}")
    out, pos = [], 0
    for call in helper_calls(text):
        impls = HELPERS.get(call.name)
        if impls is None:
            raise EngineError(f"unknown SQL helper {call.name!r}; helpers are {sorted(HELPERS)}")
        impl = impls.get(engine)
        if impl is None:
            raise EngineError(
                f"SQL helper {call.name!r} has no {engine} implementation (it supports {', '.join(sorted(impls))})"
            )
        args = [expand_helpers(a, engine) for a in call.args]
        try:
            sql = impl(*args)
        except TypeError as e:
            raise EngineError(f"SQL helper {call.name}: {e}") from None
        out.append(text[pos : call.start])
        out.append(sql)
        pos = call.end
    out.append(text[pos:])
    return "".join(out)


def _spark_parameters(text: str) -> str:
    return "".join(_PARAM.sub(r":\1", t) if k == "code" else t for k, t in _segments(text))


def render(template: str, engine: str) -> str:
    """The template as SQL for ``engine`` (``duckdb`` keeps ``$name`` parameters, ``spark`` gets ``:name``)."""
    sql = expand_helpers(template, engine)
    return _spark_parameters(sql) if engine == "spark" else sql


def used_parameters(template: str) -> set[str]:
    """The ``$name`` parameters the template's code uses, those of the fragments it includes too."""
    text = expand_helpers(template, "duckdb") if "fragment" in template else template
    return {m for k, t in _segments(text) if k == "code" for m in _PARAM.findall(t)}


# --- scripts ---------------------------------------------------------------------------------------

_CREATE = re.compile(
    r"CREATE\s+OR\s+REPLACE\s+(TEMP\s+)?TABLE\s+([A-Za-z_][A-Za-z0-9_]*)\s+AS\s+(.*)\Z", re.IGNORECASE | re.DOTALL
)


@dataclass(frozen=True)
class TableStatement:
    """``CREATE OR REPLACE [TEMP] TABLE name AS query`` of a portable script."""

    name: str
    temporary: bool
    query: str  # the template of the query
    text: str  # the whole statement's template
    view: bool = False  # marked '-- portable: view': DuckDB keeps it as a view over its inputs (no copy)


def script_statements(name: str) -> list[TableStatement]:
    """The statements of ``kvforensics/sql/<name>.sql``, each a CREATE OR REPLACE TABLE ... AS query."""
    out = []
    for stmt in statements(sql(name)):
        code = "\n".join(line for line in stmt.splitlines() if not line.strip().startswith("--")).strip()
        m = _CREATE.match(code)
        if not m:
            raise EngineError(
                f"sql/{name}.sql: a portable script statement is "
                f"'CREATE OR REPLACE [TEMP] TABLE name AS query', got {code[:60]!r}"
            )
        view = any(line.strip() == "-- portable: view" for line in stmt.splitlines())
        if view and used_parameters(code):
            raise EngineError(f"sql/{name}.sql, table {m.group(2)}: a view cannot take parameters")
        out.append(TableStatement(m.group(2), bool(m.group(1)), m.group(3), code, view))
    return out


def create_duckdb_view(con: duckdb.DuckDBPyConnection, stmt: TableStatement) -> None:
    """A view statement on DuckDB: replaces a table of that name left by an earlier version."""
    kind = con.execute(
        "SELECT table_type FROM information_schema.tables WHERE table_schema = 'main' AND table_name = $n",
        {"n": stmt.name},
    ).fetchall()
    if kind and kind[0][0] != "VIEW":
        con.execute(f'DROP TABLE "{stmt.name}"').fetchall()
    temp = "TEMP " if stmt.temporary else ""
    con.execute(f'CREATE OR REPLACE {temp}VIEW "{stmt.name}" AS {render(stmt.query, "duckdb")}').fetchall()


def run_duckdb_script(con: duckdb.DuckDBPyConnection, name: str, params: dict | None = None) -> None:
    """Run a portable ``sql/<name>.sql`` on DuckDB, giving each statement the parameters it uses, under a
    :class:`kvforensics.core.db.MemoryGovernor`."""
    params = params or {}
    with MemoryGovernor(con) as governor:
        for stmt in script_statements(name):
            if stmt.view:
                create_duckdb_view(con, stmt)
                continue
            used = used_parameters(stmt.text)
            missing = used - set(params)
            if missing:
                raise KeyError(f"sql/{name}.sql needs parameter(s) {sorted(missing)}")
            args = {k: v for k, v in params.items() if k in used} or None
            governor.run(lambda stmt=stmt, args=args: con.execute(render(stmt.text, "duckdb"), args).fetchall())
