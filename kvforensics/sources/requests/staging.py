"""What a requests reader hands the typing step, and which source column each canonical field reads.

A reader (``sources/requests/readers.py``, ``sources/requests/otlp.py``) turns one file into a :class:`Staged`
relation of ``line, raw, problem, <field>_raw`` text columns. Which column of the file fills a
canonical field is chosen here: the incident file's mapping, else the canonical name, else a name
another system uses for it (``KNOWN_ALIASES``). JSON records are parsed once for every field
(:func:`json_fields_relation`), with every JSON path a parameter, never spliced into the query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS, REQUIRED_REQUEST_FIELDS
from kvforensics.core.errors import ConfigError, InputError
from kvforensics.sources.requests.mapping import json_path
from kvforensics.sources.requests.presets import load_preset

BATCH = 100_000
# Names other systems use for the canonical fields, tried (in order) when the incident file does not
# map a field and the canonical name is absent: OpenTelemetry GenAI semantic conventions, SGLang's
# --log-requests JSON (`out.meta_info`), common OpenAI-style exports.
KNOWN_ALIASES: dict[str, tuple[str, ...]] = {
    "request_id": ("gen_ai.response.id", "rid", "id", "out.meta_info.id", "meta_info.id", "requestId"),
    "ts": (
        "timestamp",
        "time",
        "start_time",
        "received_at",
        "created_at",
        "@timestamp",
        "request_received_ts",
        "meta_info.request_received_ts",
        "out.meta_info.request_received_ts",
    ),
    "account_id": ("account", "customer_id", "tenant_id", "user", "enduser.id"),
    "model": ("gen_ai.request.model", "gen_ai.response.model", "model_name", "model_id"),
    "status": ("http.response.status_code", "status_code", "http_status"),
    "prompt_tokens": (
        "gen_ai.usage.input_tokens",
        "usage.prompt_tokens",
        "out.meta_info.prompt_tokens",
        "meta_info.prompt_tokens",
        "input_tokens",
    ),
    "completion_tokens": (
        "gen_ai.usage.output_tokens",
        "usage.completion_tokens",
        "out.meta_info.completion_tokens",
        "meta_info.completion_tokens",
        "output_tokens",
    ),
    "cached_tokens": (
        "gen_ai.usage.cache_read.input_tokens",
        "gen_ai.usage.cache_read_input_tokens",
        "usage.prompt_tokens_details.cached_tokens",
        "out.meta_info.cached_tokens",
        "meta_info.cached_tokens",
    ),
    "ttft_ms": (
        "time_to_first_token_ms",
        "ttft",
        "first_token_latency",
        "meta_info.first_token_latency",
        "out.meta_info.first_token_latency",
    ),
    "latency_ms": (
        "duration_ms",
        "e2e_latency_ms",
        "elapsed_ms",
        "e2e_latency",
        "meta_info.e2e_latency",
        "out.meta_info.e2e_latency",
    ),
    "prefill_instance": ("prefill_node", "prefill_host"),
    "decode_instance": ("decode_node", "decode_host"),
    "cache_salt": ("extra_key",),  # SGLang's name for it
}
# Aliases whose values are seconds (SGLang meta_info); the canonical fields are milliseconds.
SECONDS_ALIASES = frozenset(
    f"{prefix}{name}"
    for prefix in ("", "meta_info.", "out.meta_info.")
    for name in ("e2e_latency", "first_token_latency")
)
# Where an SGLang-shaped record keeps its finish reason, from which a status is derived when the
# record has no status column (the engine's view: abort -> its status_code or 500, otherwise 200).
FINISH_REASON_KEYS = ("finish_reason", "meta_info.finish_reason", "out.meta_info.finish_reason")
FIELD_COLUMNS = [f"{f}_raw" for f in CANONICAL_REQUEST_FIELDS]


@dataclass
class Staged:
    """One file's staged records, as SQL the typing step reads from.

    ``relation`` yields ``line, raw, problem, <field>_raw ...``: the ``staging_requests`` temp table the
    Python readers filled, or a DuckDB reader query (with ``params``) that is read, parsed and typed
    in one streaming pass. ``raw_relation`` (``line, raw``), when set, gives the raw text the relation
    leaves out (Parquet builds it only for the records that are refused). ``rewrites`` map the typing
    step's reasons to the format's own words; ``lines`` is the file's physical line count when the
    reader knows it (to report blank lines); ``ticked`` says the reader already reported progress."""

    relation: str
    params: dict[str, Any] = field(default_factory=dict)
    raw_relation: str | None = None
    rewrites: Mapping[str, str] = field(default_factory=dict)
    lines: int | None = None
    ticked: bool = True
    # the relation must yield exactly ``lines`` records (one per physical line), else ``retry`` stages
    # the file another way; ``retry`` is also taken when the reader raises on the file
    exact_lines: bool = False
    # kept only when it refuses no record (it cannot tell every refusal's reason or raw text)
    clean_only: bool = False
    retry: Callable[[], Staged] | None = None
    reader: str = "python"  # which reader staged the file, for the load's record
    # staged key -> JSON path into the staged text (a path into JSON held in a CSV/Parquet cell)
    cells: Mapping[str, str] = field(default_factory=dict)


# What a blank JSONL line holds, to the DuckDB and the Python reader alike: ASCII whitespace (bytes.strip())
BLANK = b" \t\n\r\x0b\x0c"


def python_staged(rewrites: Mapping[str, str] | None = None) -> Staged:
    return Staged("staging_requests", rewrites=rewrites or {})


def _staging_schema(keys: Iterable[str] = CANONICAL_REQUEST_FIELDS) -> pa.Schema:
    return pa.schema(
        [("line", pa.int64()), ("raw", pa.string()), ("problem", pa.string())]
        + [(f"{k}_raw", pa.string()) for k in keys]
    )


class Stager:
    """Appends batches of staged records to the ``staging_requests`` temp table."""

    def __init__(self, con: duckdb.DuckDBPyConnection, keys: Iterable[str] = CANONICAL_REQUEST_FIELDS) -> None:
        self.con = con
        self.schema = _staging_schema(keys)
        con.execute(
            "CREATE OR REPLACE TEMP TABLE staging_requests (line BIGINT, raw VARCHAR, problem VARCHAR"
            + "".join(f", {c} VARCHAR" for c in self.schema.names[3:])
            + ")"
        )

    def add(self, columns: dict[str, list]) -> None:
        n = len(columns["line"])
        if n == 0:
            return
        arrays = [pa.array(columns.get(f.name, [None] * n), type=f.type) for f in self.schema]
        batch = pa.Table.from_arrays(arrays, schema=self.schema)
        self.con.register("staging_batch", batch)
        self.con.execute("INSERT INTO staging_requests SELECT * FROM staging_batch")
        self.con.unregister("staging_batch")


def expression_refs(source: Source) -> list[str]:
    """The source names the source's `columns` expressions read, once each: ref i is staged as the
    text column ``x<i>_raw`` (beside the canonical fields' ``<field>_raw``)."""
    return list(dict.fromkeys(ref for e in source.expressions.values() for ref in e.refs))


def _ref_field(source: Source, ref: str) -> str:
    """The first canonical field whose expression reads ``ref`` (to name the key in an error)."""
    return next(c for c, e in source.expressions.items() if ref in e.refs)


def _json_paths(name: str) -> list[str]:
    """JSON paths for a column name: a literal key first, then the dotted name as a nested path."""
    quoted = '$."' + name.replace('"', '\\"') + '"'
    if "." not in name:
        return [quoted]
    return [quoted, "$." + ".".join('"' + p.replace('"', '\\"') + '"' for p in name.split("."))]


def candidate_names(source: Source, canonical: str) -> list[str]:
    """The names a canonical field is looked for under: its mapping, else its own name and known aliases."""
    if canonical in source.columns:
        return [source.columns[canonical]]
    return [canonical, *KNOWN_ALIASES.get(canonical, ())]


def choose_columns(source: Source, present: set[str]) -> dict[str, str | None]:
    """Canonical field -> source column: the mapping, else the canonical name, else a known alias;
    a field given by an expression is None, and each column the expressions read follows as ``x<i>``."""
    chosen: dict[str, str | None] = {}
    for canonical in CANONICAL_REQUEST_FIELDS:
        if canonical in source.expressions:
            chosen[canonical] = None
            continue
        names = candidate_names(source, canonical)
        hit = next((n for n in names if n in present), None)
        if hit is None and canonical in source.columns:
            hit = source.columns[canonical]
        chosen[canonical] = hit
    for i, ref in enumerate(expression_refs(source)):
        chosen[f"x{i}"] = ref
    return chosen


def unknown_column(
    source: Source, path: Path, refs: str | Sequence[str], have: Iterable[str], canonical: str | None = None
) -> ConfigError:
    """The configuration error for columns an expression reads that the file does not have."""
    refs = [refs] if isinstance(refs, str) else list(refs)
    names = sorted(have)
    shown = ", ".join(names[:30]) + (f" ... ({len(names)} in all)" if len(names) > 30 else "")
    where = f"{source.incident_file}: source '{source.name}'" if source.incident_file else f"source '{source.name}'"
    what = f"column {refs[0]!r} is" if len(refs) == 1 else f"columns {', '.join(map(repr, refs))} are"
    return ConfigError(
        f"columns.{canonical or _ref_field(source, refs[0])}: {what} not in {path.name} "
        f"(it has: {shown or 'no columns'})",
        location=where,
    )


def preset_optional(source: Source, canonical: str) -> bool:
    """Whether an optional field is mapped as the source's preset maps it: an export of that kind may
    lack what the preset reads for it (vLLM's chat completions without ``prompt_tokens_details``), so
    a file without it leaves the field empty and says so, where the incident file's own mapping of a
    column the file lacks is a mistake to fix."""
    if source.preset is None or canonical in REQUIRED_REQUEST_FIELDS:
        return False
    return load_preset(source.preset).get("columns", {}).get(canonical) == source.columns.get(canonical)


def preset_gap(source: Source, canonical: str, names: Sequence[str], path: Path) -> str:
    """The note for a field :func:`preset_optional` leaves empty."""
    return (
        f"{canonical} left empty: preset '{source.preset}' reads it from {', '.join(map(repr, names))}, "
        f"which {path.name} does not have"
    )


def check_expression_columns(
    source: Source, path: Path, present: Callable[[str], bool], have: Iterable[str]
) -> list[str]:
    """Each expression against the columns (or JSON keys) a file has: one that can give no value
    without those it lacks (a column it computes with, or every alternative of a ``coalesce``) is a
    ConfigError naming them; an alternative the file lacks is no error (a preset may read two shapes
    of record). Returns the notes of :func:`preset_gap`."""
    notes = []
    for canonical, expression in source.expressions.items():
        missing = [ref for ref in expression.refs if not present(ref)]
        if not missing or (len(missing) < len(expression.refs) and expression.can_give_value(present)):
            continue
        if preset_optional(source, canonical):
            notes.append(preset_gap(source, canonical, missing, path))
            continue
        raise unknown_column(source, path, missing, have, canonical)
    return notes


def _cell_column(name: str, header: Iterable[str]) -> tuple[str, str | None] | None:
    """Where a name is in a table's header: the column itself, or the longest dotted prefix that is
    a column with the rest as a JSON path into its cells; None when neither."""
    have = set(header)
    if name in have:
        return name, None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        column = ".".join(parts[:cut])
        if column in have:
            return column, json_path(".".join(parts[cut:]))
    return None


def split_cells(
    source: Source, path: Path, chosen: Mapping[str, str | None], header: list[str]
) -> tuple[dict[str, str | None], dict[str, str]]:
    """The columns a CSV/Parquet stager reads (a path's column) and the JSON paths into their cells,
    per staged key (a column the file lacks is read as NULL: :func:`require_header` has checked it)."""
    columns: dict[str, str | None] = {}
    cells: dict[str, str] = {}
    for key, name in chosen.items():
        found = None if name is None else _cell_column(name, header)
        if found is None:
            columns[key] = name
            continue
        columns[key], cell = found
        if cell is not None:
            cells[key] = cell
    return columns, cells


def mapping_notes(source: Source, chosen: dict[str, str | None]) -> list[str]:
    notes = []
    recognised = {
        c: col
        for c, col in chosen.items()
        if col is not None and c in CANONICAL_REQUEST_FIELDS and c not in source.columns and col != c
    }
    if recognised:
        notes.append(
            "columns recognised without a mapping: "
            + ", ".join(f"{c} <- {col}" for c, col in sorted(recognised.items()))
        )
    return notes


def require_header(source: Source, path: Path, header: Iterable[str], chosen: dict[str, str | None]) -> list[str]:
    """A CSV/Parquet header against the mapping: a required field without a column, a column the
    incident file maps that the header lacks, an expression reading such columns: an error saying
    which. Returns the notes of a preset's optional fields the file lacks."""
    have = set(header)
    notes = []
    for canonical in REQUIRED_REQUEST_FIELDS:
        col = chosen.get(canonical)
        if canonical in source.expressions:
            continue
        if col is None or _cell_column(col, have) is None:
            hint = f"mapped to column '{col}'" if col else "no column of that name"
            raise InputError(
                f"required field '{canonical}' is missing ({hint}); the file has columns "
                f"{sorted(have)}. Map it in the incident file: columns = {{ {canonical} = \"<column>\" }}",
                location=f"source '{source.name}': {path}",
            )
    for canonical, col in source.columns.items():
        if canonical not in source.expressions and _cell_column(col, have) is None:
            if preset_optional(source, canonical):
                notes.append(preset_gap(source, canonical, [col], path))
                continue
            raise InputError(
                f"columns maps '{canonical}' to '{col}', which the file does not have; it has {sorted(have)}",
                location=f"source '{source.name}': {path}",
            )
    return notes + check_expression_columns(source, path, lambda name: _cell_column(name, have) is not None, have)


def in_milliseconds(source: Source, canonical: str, column: str | None, expr: str) -> str:
    """A duration the record gives in seconds under a known name (SGLang's ``e2e_latency``), in
    milliseconds as text; an explicit mapping in the incident file is taken as milliseconds."""
    if column in SECONDS_ALIASES and canonical in CANONICAL_REQUEST_FIELDS and canonical not in source.columns:
        return f"coalesce(CAST(round(TRY_CAST({expr} AS DOUBLE) * 1000, 3) AS VARCHAR), {expr})"
    return expr


def _field_expressions(source: Source, chosen: Mapping[str, str | None]) -> tuple[list[str], list[str], dict[str, str]]:
    """JSON paths, the wrong-type checks and the value of each canonical field, over the lists
    ``t`` (json_type) and ``v`` (json_extract_string) of one parse of the record."""
    paths: list[str] = []
    wrong_type: list[str] = []
    values: dict[str, str] = {}
    for canonical, col in chosen.items():
        if col is None:
            continue
        first = len(paths) + 1
        paths.extend(_json_paths(col))
        numbers = range(first, len(paths) + 1)
        types = "coalesce(" + ", ".join(f"t[{i}]" for i in numbers) + ")"
        wrong_type.append(
            f"WHEN {types} IN ('OBJECT', 'ARRAY', 'BOOLEAN') THEN {wrong_type_reason(canonical)} || lower({types})"
        )
        expr = "coalesce(" + ", ".join(f"v[{i}]" for i in numbers) + ")"
        expr = in_milliseconds(source, canonical, col, expr)
        values[canonical] = expr
    return paths, wrong_type, values


# The status an SGLang-shaped record implies when it has no status column: abort -> its status_code
# (or 500), anything else 200. $fr, $fr_type, $fr_code are JSON paths (parameters).
_STATUS_FROM_FINISH_REASON = """CASE
    WHEN json_type(raw, $fr) = 'OBJECT' THEN
        CASE WHEN lower(json_extract_string(raw, $fr_type)) = 'abort'
             THEN coalesce(json_extract_string(raw, $fr_code), '500') ELSE '200' END
    WHEN json_type(raw, $fr) = 'VARCHAR' THEN
        CASE WHEN lower(json_extract_string(raw, $fr)) LIKE '%abort%' THEN '500' ELSE '200' END
END"""


def wrong_type_reason(key: str) -> str:
    """SQL text of the reason a staged value is refused for its JSON type (the type follows)."""
    what = key if key in CANONICAL_REQUEST_FIELDS else "a column an expression reads"
    return f"'{what} must be a string or a number, not a JSON '"


def json_fields_relation(
    source: Source, chosen: Mapping[str, str | None], lines_sql: str, finish_reason: str | None
) -> tuple[str, dict[str, Any]]:
    """The staged relation over a relation of ``line, raw, problem``: each record parsed once for all
    fields (json_type / json_extract_string over the list of paths); blank lines dropped. Returns the
    query and its parameters (the JSON paths: never spliced into the text)."""
    paths, wrong_type, values = _field_expressions(source, chosen)
    params: dict[str, Any] = {"paths": paths or ["$.__none__"], "blank": BLANK.decode("ascii")}
    if finish_reason is not None and "status" not in values:
        base = json_path(finish_reason)
        values["status"] = _STATUS_FROM_FINISH_REASON
        params.update(fr=base, fr_type=base + '."type"', fr_code=base + '."status_code"')
    fields = ", ".join(
        f"CASE WHEN problem IS NULL THEN {values[c]} END AS {c}_raw"
        if c in values
        else f"CAST(NULL AS VARCHAR) AS {c}_raw"
        for c in chosen
    )
    type_check = f"CASE {' '.join(wrong_type)} END" if wrong_type else "CAST(NULL AS VARCHAR)"
    query = f"""
        WITH lines AS ({lines_sql}),
        checked AS (
            SELECT line, raw,
                   coalesce(problem, CASE WHEN NOT json_valid(raw) THEN 'malformed JSON'
                                          WHEN json_type(raw) <> 'OBJECT' THEN 'not a JSON object' END) AS first_problem
            FROM lines WHERE raw IS NOT NULL AND trim(raw, $blank) <> ''
        ), parsed AS (
            SELECT line, raw, first_problem,
                   CASE WHEN first_problem IS NULL THEN json_type(raw, $paths) END AS t,
                   CASE WHEN first_problem IS NULL THEN json_extract_string(raw, $paths) END AS v
            FROM checked
        ), judged AS (
            SELECT line, raw, t, v, coalesce(first_problem, {type_check}) AS problem FROM parsed
        )
        SELECT line, raw, problem, {fields} FROM judged"""
    return query, params
