"""Lint: the rule and scope SQL stays in the subset DuckDB and Spark SQL agree on.

Outside the named helpers (``{{ helper(...) }}``, ``kvforensics/engines/portable.py``) the SQL may
call only the functions listed here, must not use engine-only syntax, and must say where NULLs sort
(DuckDB puts them last, Spark first for ascending keys). The helpers render for both engines and
refuse engines they have no expansion for.
"""

from __future__ import annotations

import re

import pytest

from kvforensics.core.db import sql
from kvforensics.engines import portable
from kvforensics.engines.portable import (
    ENGINES,
    EngineError,
    code_only,
    helper_calls,
    render,
    script_statements,
)
from kvforensics.stages.detect import load_rules
from kvforensics.stages.scope import SCOPE_SCRIPTS

#: Functions both engines implement with the same meaning and result type for our inputs.
PORTABLE_FUNCTIONS = {
    "count",
    "sum",
    "min",
    "max",
    "avg",
    "coalesce",
    "least",
    "greatest",
    "abs",
    "row_number",
    "rank",
    "dense_rank",
    "left",
    "date_trunc",
    "cast",
}
#: Words that may precede "(" without being a function call.
KEYWORDS = {
    "as",
    "in",
    "exists",
    "over",
    "from",
    "join",
    "on",
    "and",
    "or",
    "not",
    "when",
    "then",
    "else",
    "select",
    "where",
    "by",
    "with",
    "all",
    "union",
    "distinct",
    "case",
    "end",
    "between",
    "is",
    "null",
    "having",
    "asc",
    "desc",
    "first",
    "last",
    "nulls",
}
BANNED = [
    (r"::", "DuckDB cast syntax: write CAST(x AS type)"),
    (r"\bFILTER\s*\(", "aggregate FILTER is DuckDB/Postgres only: count(CASE WHEN ... THEN 1 END)"),
    (r"\bGLOB\b", "GLOB: use {{ glob_match(value, pattern) }}"),
    (r"\bINTERVAL\b", "interval literals differ: use {{ add_hours(...) }} / {{ add_milliseconds(...) }}"),
    (r"\b(ASOF|QUALIFY|EXCLUDE|PIVOT|UNPIVOT|LATERAL|NATURAL|POSITIONAL|SAMPLE)\b", "engine-only syntax"),
    # WITH RECURSIVE runs on both (Spark 4.1+) when it recurses with UNION ALL (Spark refuses UNION):
    # test_spark_parity runs the recursive prefix_store_loads fragment on Spark
    (r"\b(SEMI|ANTI)\s+JOIN\b", "engine-only join: write EXISTS / NOT IN"),
    (r"\bUSING\s*\(", "JOIN USING merges columns differently: write ON a.x = b.x"),
    (r'"', "double quotes: an identifier in DuckDB, a string in Spark (use {{ column('name') }})"),
    (r"\bTIMESTAMPTZ\b", "no TIMESTAMPTZ in Spark: use {{ as_timestamp(...) }}"),
    (r"\bVARCHAR\b", "Spark needs VARCHAR(n): CAST(x AS STRING)"),
    (r"\b(HUGEINT|UBIGINT|UINTEGER|JSON|LIST|STRUCT|MAP)\b", "engine-only type"),
    (r"->>?|\[", "JSON arrows and list indexing are DuckDB only"),
    (r"\?", "positional parameters: use $name"),
    (
        r"(?<![\w.])\d+\.\d+",
        "decimal literals are typed differently (DECIMAL arithmetic on Spark): use integers or a DOUBLE parameter",
    ),
]


def _templates() -> list[tuple[str, str]]:
    rules = [(f"rules/{r.id}.sql", r.template) for r in load_rules()]
    scripts = [(f"sql/{name}.sql", sql(name)) for name in SCOPE_SCRIPTS]
    return rules + scripts


TEMPLATES = _templates()


def _outside_helpers(template: str) -> str:
    """The code with comments and string contents removed and each helper call replaced by a name."""
    out, pos = [], 0
    for call in helper_calls(template):
        out.append(template[pos : call.start])
        out.append(" kvf_helper ")
        pos = call.end
    out.append(template[pos:])
    return code_only("".join(out))


@pytest.mark.parametrize(("name", "template"), TEMPLATES, ids=[n for n, _ in TEMPLATES])
def test_portable_sql(name, template):
    for engine in ENGINES:
        assert render(template, engine)
    code = _outside_helpers(template)
    for pattern, why in BANNED:
        m = re.search(pattern, code, re.IGNORECASE)
        assert not m, f"{name}: {m.group(0)!r}: {why}" if m else ""
    called = {f.lower() for f in re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(", code)} - KEYWORDS
    assert called <= PORTABLE_FUNCTIONS, (
        f"{name} calls {sorted(called - PORTABLE_FUNCTIONS)} outside a helper: use a portable function or add "
        f"a helper with an expansion per engine to kvforensics/engines/portable.py"
    )
    for items in _order_by_lists(code):
        for item in items:
            assert re.search(r"\bNULLS\s+(FIRST|LAST)\s*$", item, re.IGNORECASE), (
                f"{name}: ORDER BY key {item!r} needs NULLS FIRST or NULLS LAST (DuckDB and Spark differ)"
            )
    for call in helper_calls(template):
        assert call.name in portable.HELPERS, f"{name}: unknown helper {call.name}"


def _order_by_lists(code: str) -> list[list[str]]:
    """The keys of every ORDER BY, split at top-level commas."""
    out = []
    for m in re.finditer(r"\bORDER\s+BY\b", code, re.IGNORECASE):
        depth, i, start, items = 0, m.end(), m.end(), []
        while i < len(code):
            c = code[i]
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                items.append(code[start:i].strip())
                start = i + 1
            elif depth == 0 and (c == ";" or re.match(r"\s(ROWS|RANGE|LIMIT)\b", code[i:], re.IGNORECASE)):
                break
            i += 1
        items.append(code[start:i].strip())
        out.append(items)
    return out


@pytest.mark.parametrize("name", SCOPE_SCRIPTS)
def test_script_statements_are_create_table_as(name):
    statements = script_statements(name)
    assert statements and all(s.query.strip() for s in statements)


def test_lint_catches_what_it_should():
    bad = "SELECT count(*) FILTER (WHERE x) AS n, list_sum(y), a::INT FROM t ORDER BY a"
    code = _outside_helpers(bad)
    assert re.search(BANNED[0][0], code) and re.search(BANNED[1][0], code, re.IGNORECASE)
    assert {"list_sum"} <= {f.lower() for f in re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(", code)} - KEYWORDS
    assert _order_by_lists(code) == [["a"]]
    assert _order_by_lists("row_number() OVER (PARTITION BY a ORDER BY b NULLS LAST, c DESC NULLS LAST)") == [
        ["b NULLS LAST", "c DESC NULLS LAST"]
    ]


def test_helpers_refuse_engines_they_do_not_support(monkeypatch):
    with pytest.raises(EngineError, match="unknown engine 'postgres'; kvforensics runs on duckdb, spark"):
        render("SELECT {{ json_object('a', 1) }}", "postgres")
    monkeypatch.setitem(portable.HELPERS, "duckdb_only", {"duckdb": lambda x: f"list_sum({x})"})
    assert render("SELECT {{ duckdb_only(y) }}", "duckdb") == "SELECT list_sum(y)"
    with pytest.raises(EngineError, match="SQL helper 'duckdb_only' has no spark implementation"):
        render("SELECT {{ duckdb_only(y) }}", "spark")
    with pytest.raises(EngineError, match="unknown SQL helper 'nope'"):
        render("SELECT {{ nope(1) }}", "duckdb")


def test_rendering():
    template = "SELECT {{ json_object('k', {{ round_double(x, 1) }}) }} FROM t WHERE y > $min AND z = '$not_a_param'"
    assert (
        render(template, "duckdb")
        == "SELECT json_object('k', round(x, 1)) FROM t WHERE y > $min AND z = '$not_a_param'"
    )
    spark = render(template, "spark")
    assert spark.startswith("SELECT to_json(named_struct('k', (signum(") and spark.endswith(
        "map('ignoreNullFields', 'false')) FROM t WHERE y > :min AND z = '$not_a_param'"
    )
    assert (
        render("{{ string_agg_ordered(id, ' ', ts, id) }}", "duckdb")
        == "string_agg(id, ' ' ORDER BY ts ASC NULLS LAST, id ASC NULLS LAST)"
    )
    assert (
        render("{{ string_agg_ordered(id, ' ', ts, id) }}", "spark")
        == "string_agg(id, ' ') WITHIN GROUP (ORDER BY ts ASC NULLS LAST, id ASC NULLS LAST)"
    )
