"""Mapping that expresses real exports: `columns` entries that are dotted paths (also into JSON held
in a CSV/Parquet cell) or expressions over the source's columns, value maps and null tokens."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import shutil
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_presets import incident as write_incident
from test_presets import utc

from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError, InputError
from kvforensics.sources.requests import readers as request_readers
from kvforensics.sources.requests.load import load_requests_file, load_requests_files
from kvforensics.sources.requests.mapping import is_expression

FIELDS = "request_id, ts, account_id, model, status, prompt_tokens, cached_tokens, ttft_ms, latency_ms"


def load(tmp_path: Path, name: str, data: str | bytes | None, source: str):
    if data is not None:
        (tmp_path / name).write_bytes(data.encode() if isinstance(data, str) else data)
    (src,) = load_incident(write_incident(tmp_path, f'path = "{name}"\n{source}')).sources
    con = connect()
    result = load_requests_file(con, src, tmp_path / name)
    rows = con.execute(f"SELECT {FIELDS} FROM requests ORDER BY request_id").fetchall()
    refused = con.execute("SELECT line, reason FROM quarantine ORDER BY line").fetchall()
    return result, rows, refused


def config_error(tmp_path: Path, source: str, name: str = "g.jsonl", data: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, name, data, source)
    return str(e.value)


CSV = """id,startTime,completionStartTime,endTime,who,model,state,tokens
r1,2026-08-27 17:15:03.123,2026-08-27 17:15:04.535,2026-08-27 17:15:09.861,acme,glm,success,4096
r2,2026-08-27 17:16:00.000,,2026-08-27 17:16:01.5,globex,glm,failure,10
"""
CSV_COLUMNS = (
    'columns = { request_id = "id", ts = "startTime", account_id = "who", status = "state", '
    'prompt_tokens = "tokens", ttft_ms = "epoch_ms(completionStartTime) - epoch_ms(startTime)", '
    'latency_ms = "round(epoch(endTime) - epoch(startTime), 3) * 1000" }'
)


def test_an_expression_over_text_timestamps_of_a_csv(tmp_path):
    result, rows, refused = load(
        tmp_path, "g.csv", CSV, CSV_COLUMNS + "\nvalues = { status = { success = 200, failure = 500 } }"
    )
    assert refused == []
    assert rows == [
        ("r1", utc("2026-08-27 17:15:03.123"), "acme", "glm", 200, 4096, None, 1412.0, 6738.0),
        ("r2", utc("2026-08-27 17:16:00"), "globex", "glm", 500, 10, None, None, 1500.0),
    ]


def test_timestamps_without_offset_are_read_in_the_source_timezone(tmp_path):
    _, rows, _ = load(
        tmp_path,
        "g.csv",
        CSV.replace("2026-08-27 17:15:04.535", "2026-08-27T19:15:04.535+02:00"),
        CSV_COLUMNS + '\ntimezone = "UTC"\nvalues = { status = { success = 200, failure = 500 } }',
    )
    assert rows[0][7] == 1412.0


def test_a_value_an_expression_cannot_read_quarantines_its_record(tmp_path):
    bad = CSV.replace("2026-08-27 17:15:04.535", "soon")
    _, rows, refused = load(
        tmp_path, "g.csv", bad, CSV_COLUMNS + "\nvalues = { status = { success = 200, failure = 500 } }"
    )
    assert refused == [(2, "columns.ttft_ms: completionStartTime is not a timestamp: 'soon'")]
    assert [r[0] for r in rows] == ["r2"]


def test_a_required_field_an_expression_leaves_null_names_the_expression(tmp_path):
    data = CSV.replace(",acme,", ",,")
    _, rows, refused = load(
        tmp_path,
        "g.csv",
        data,
        CSV_COLUMNS.replace('account_id = "who"', "account_id = \"coalesce(who, nullif(model, 'glm'))\"")
        + "\nvalues = { status = { success = 200, failure = 500 } }",
    )
    assert refused == [
        (2, "missing required field 'account_id' (columns.account_id = coalesce(who, nullif(model, 'glm')) gave NULL)")
    ]


def test_a_value_not_in_the_map_passes_through_and_is_typed_as_before(tmp_path):
    _, rows, refused = load(tmp_path, "g.csv", CSV, CSV_COLUMNS + "\nvalues = { status = { success = 200 } }")
    assert refused == [(3, "status is not an HTTP status code: 'failure'")]
    assert [r[:5] for r in rows] == [("r1", utc("2026-08-27 17:15:03.123"), "acme", "glm", 200)]


def test_value_maps_apply_to_plain_columns_of_jsonl_and_match_the_trimmed_text(tmp_path):
    lines = [
        {
            "rid": "a",
            "ts": "2026-08-28T10:00:00Z",
            "account_id": "x",
            "model": "m",
            "status": " ok ",
            "prompt_tokens": 5,
        },
        {
            "rid": "b",
            "ts": "2026-08-28T10:00:01Z",
            "account_id": "x",
            "model": "legacy",
            "status": 201,
            "prompt_tokens": 6,
        },
    ]
    _, rows, refused = load(
        tmp_path,
        "g.jsonl",
        "\n".join(json.dumps(r) for r in lines) + "\n",
        'columns = { request_id = "rid" }\nvalues = { status = { ok = 200 }, model = { legacy = "glm-5.3" } }',
    )
    assert refused == []
    assert [r[:5] for r in rows] == [
        ("a", utc("2026-08-28 10:00:00"), "x", "m", 200),
        ("b", utc("2026-08-28 10:00:01"), "x", "glm-5.3", 201),
    ]


JSONL_EMPTY_TTFT = (
    "\n".join(
        json.dumps(r)
        for r in [
            {
                "request_id": "a",
                "ts": "2026-08-28T10:00:00Z",
                "account_id": "x",
                "model": "m",
                "status": 200,
                "prompt_tokens": 5,
                "ttft_ms": "",
            },
            {
                "request_id": "b",
                "ts": "2026-08-28T10:00:01Z",
                "account_id": "-",
                "model": "m",
                "status": 200,
                "prompt_tokens": 6,
                "ttft_ms": 12.5,
            },
            {
                "request_id": "c",
                "ts": "2026-08-28T10:00:02Z",
                "account_id": "y",
                "model": "m",
                "status": 200,
                "prompt_tokens": 7,
                "ttft_ms": " null ",
            },
        ]
    )
    + "\n"
)


def test_without_null_tokens_an_empty_field_quarantines_its_record_as_before(tmp_path):
    _, rows, refused = load(tmp_path, "g.jsonl", JSONL_EMPTY_TTFT, "")
    assert refused == [
        (1, "ttft_ms is not a non-negative number: ''"),
        (3, "ttft_ms is not a non-negative number: ' null '"),
    ]
    assert [r[0] for r in rows] == ["b"]


def test_null_tokens_make_optional_fields_null_and_required_ones_missing(tmp_path):
    _, rows, refused = load(tmp_path, "g.jsonl", JSONL_EMPTY_TTFT, 'null_tokens = ["", "null", "-"]')
    assert refused == [(2, "missing required field 'account_id'")]
    assert [(r[0], r[7]) for r in rows] == [("a", None), ("c", None)]


ODD_NAMES = (
    "\n".join(
        json.dumps(r)
        for r in [
            {
                "gen_ai.response.id": "o1",
                "time": "2026-08-28T10:00:00Z",
                "tenant": {"id": "t-1"},
                "gen_ai.request.model": "m",
                "http.response.status_code": 200,
                "gen_ai.usage.input_tokens": "300",
                "usage": {"cached": 100},
            },
            {
                "gen_ai.response.id": "o2",
                "time": "2026-08-28T10:00:01Z",
                "tenant": {"id": "t-2"},
                "gen_ai.request.model": "m",
                "http.response.status_code": 200,
                "gen_ai.usage.input_tokens": 40,
                "usage": {"cached": None},
            },
        ]
    )
    + "\n"
)
ODD_COLUMNS = (
    'columns = { ts = "time", account_id = "tenant.id", '
    "prompt_tokens = 'CAST(\"gen_ai.usage.input_tokens\" AS BIGINT) + coalesce(usage.cached, 0)' }"
)


@pytest.mark.parametrize("fast", [True, False])
def test_quoted_names_with_dots_and_nested_paths_in_jsonl(tmp_path, monkeypatch, fast):
    monkeypatch.setattr(request_readers, "FAST_STAGING", fast)
    result, rows, refused = load(tmp_path, "g.jsonl", ODD_NAMES, ODD_COLUMNS)
    assert refused == []
    assert [r[:6] for r in rows] == [
        ("o1", utc("2026-08-28 10:00:00"), "t-1", "m", 200, 400),
        ("o2", utc("2026-08-28 10:00:01"), "t-2", "m", 200, 40),
    ]
    assert result.reader == ("duckdb-lines" if fast else "python")


def test_expressions_keep_the_duckdb_json_reader_for_top_level_keys(tmp_path):
    lines = [
        {
            "rid": "a",
            "ts": "2026-08-28T10:00:00Z",
            "account_id": "x",
            "model": "m",
            "code": "OK",
            "in": 5,
            "t0": 1000.0,
            "t1": 1250.5,
        }
    ]
    result, rows, refused = load(
        tmp_path,
        "g.jsonl",
        json.dumps(lines[0]) + "\n",
        """columns = { request_id = "rid", prompt_tokens = "in", status = "CASE WHEN code = 'OK' THEN 200 ELSE 500 END", ttft_ms = "t1 - t0" }""",
    )
    assert refused == [] and rows == [("a", utc("2026-08-28 10:00:00"), "x", "m", 200, 5, None, 250.5, None)]
    assert result.reader == "duckdb-json-text"


def test_text_literals_are_bound_not_spliced(tmp_path):
    lines = [
        {
            "rid": "a'--$x",
            "ts": "2026-08-28T10:00:00Z",
            "account_id": "x",
            "model": "m",
            "status": 200,
            "prompt_tokens": 5,
        }
    ]
    _, rows, refused = load(
        tmp_path,
        "g.jsonl",
        json.dumps(lines[0]) + "\n",
        """columns = { request_id = "concat(rid, '--', '$tz', 'it''s')" }""",
    )
    assert refused == [] and rows[0][0] == "a'--$x--$tzit's"


def parquet_file(tmp_path: Path, struct: bool) -> None:
    meta = [{"user_api_key_team_id": "team-a", "usage": {"cached_tokens": 64}}, {"user_api_key_team_id": None}]
    table = pa.table(
        {
            "request_id": ["p1", "p2"],
            "startTime": pa.array([datetime(2026, 8, 27, 17, 0), datetime(2026, 8, 27, 17, 1)], pa.timestamp("ms")),
            "model": ["glm", "glm"],
            "status": ["success", "success"],
            "prompt_tokens": pa.array([128, 256], pa.int32()),
            "metadata": meta if struct else [json.dumps(m) for m in meta],
            "end_user": ["eu-1", "eu-2"],
        }
    )
    pq.write_table(table, tmp_path / "g.parquet")


@pytest.mark.parametrize("struct", [False, True], ids=["json-text-column", "struct-column"])
@pytest.mark.parametrize("fast", [True, False])
def test_paths_into_json_held_in_parquet_cells(tmp_path, monkeypatch, struct, fast):
    monkeypatch.setattr(request_readers, "FAST_STAGING", fast)
    parquet_file(tmp_path, struct)
    _, rows, refused = load(
        tmp_path,
        "g.parquet",
        None,
        """columns = { ts = "startTime", account_id = 'coalesce("metadata.user_api_key_team_id", end_user)', cached_tokens = "metadata.usage.cached_tokens" }
values = { status = { success = 200 } }""",
    )
    assert refused == []
    assert rows == [
        ("p1", utc("2026-08-27 17:00"), "team-a", "glm", 200, 128, 64, None, None),
        ("p2", utc("2026-08-27 17:01"), "eu-2", "glm", 200, 256, None, None, None),
    ]


def test_paths_into_json_held_in_csv_cells_and_a_cell_that_holds_none(tmp_path):
    data = (
        'request_id,ts,model,status,prompt_tokens,metadata\n'
        'c1,2026-08-27 17:00:00,glm,200,10,"{""team"": ""t-1"", ""n"": {""cached"": 4}}"\n'
        'c2,2026-08-27 17:00:01,glm,200,10,not json\n'
    )
    _, rows, refused = load(
        tmp_path, "g.csv", data, 'columns = { account_id = "metadata.team", cached_tokens = "metadata.n.cached" }'
    )
    assert rows == [("c1", utc("2026-08-27 17:00"), "t-1", "glm", 200, 10, 4, None, None)]
    assert refused == [(3, "account_id: the cell holds no JSON: not json")]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("rid", False),
        ("metadata.user_api_key_team_id", False),
        ("headers.x-account", False),
        ('"gen_ai.usage.input_tokens"', True),
        ("a - b", True),
        ("epoch_ms(t)", True),
        ("(200)", True),
    ],
)
def test_how_an_entry_is_told_from_an_expression(entry, expected):
    assert is_expression(entry) is expected


ERR = "incident.toml: source 'gw': "


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (
            'ttft_ms = "epoch_ms(t1 - epoch_ms(t0)"',
            "columns.ttft_ms: not a valid expression (syntax error at or near \")\")",
        ),
        (
            'ttft_ms = "read_text(t0)"',
            "columns.ttft_ms: function read_text() is not allowed; allowed: abs, ceil, concat, "
            "epoch, epoch_ms, floor, greatest, least, left, lower, nullif, round, trim, upper, "
            "coalesce, CASE, CAST",
        ),
        (
            'ttft_ms = "(SELECT max(t0) FROM requests)"',
            "columns.ttft_ms: a subquery is not allowed in a column expression",
        ),
        (
            'ttft_ms = "t0 + 1, t1"',
            "columns.ttft_ms: must be one expression over the source's columns (no query, list or clause)",
        ),
        (
            'ttft_ms = "abs(lower(t0))"',
            "columns.ttft_ms: type error in 'abs(lower(t0))': Binder Error: No function matches "
            "the given name and argument types 'abs(VARCHAR)'. You might need to add explicit type casts.",
        ),
        ("ttft_ms = \"t0 + 'soon'\"", "columns.ttft_ms: text 'soon' where a number is needed"),
        (
            'ttft_ms = "epoch_ms(t0 * 2)"',
            "columns.ttft_ms: type error in 'epoch_ms(t0 * 2)': Binder Error: No function "
            "matches the given name and argument types 'epoch_us(DOUBLE)'. You might need to add "
            "explicit type casts.",
        ),
    ],
)
def test_bad_expressions_are_refused_when_the_incident_is_loaded(tmp_path, columns, message):
    with pytest.raises(ConfigError) as e:
        load_incident(write_incident(tmp_path, f'path = "g.jsonl"\ncolumns = {{ {columns} }}'))
    assert str(e.value) == ERR + message


def test_an_unknown_column_is_refused_before_any_row_is_loaded(tmp_path):
    assert config_error(
        tmp_path, 'columns = { ttft_ms = "epoch_ms(first_token) - epoch_ms(ts)" }', data=JSONL_EMPTY_TTFT
    ) == (
        ERR + "columns.ttft_ms: column 'first_token' is not in g.jsonl (it has: account_id, model, prompt_tokens, "
        "request_id, status, ts, ttft_ms)"
    )
    assert config_error(tmp_path, CSV_COLUMNS.replace("completionStartTime", "completion_start"), "g.csv", CSV) == (
        ERR + "columns.ttft_ms: column 'completion_start' is not in g.csv (it has: completionStartTime, endTime, id, "
        "model, startTime, state, tokens, who)"
    )


def test_expressions_need_a_format_whose_columns_the_mapping_names(tmp_path):
    message = config_error(tmp_path, 'format = "sglang_requests"\ncolumns = { ttft_ms = "a - b" }')
    assert message == ERR + (
        "columns.ttft_ms: expressions need format jsonl, csv, parquet, otlp_json; format 'sglang_requests' "
        "maps its own records (name a field or path instead)"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            'values = { status = "ok" }',
            "values must be a table of canonical field = { source value = canonical value }",
        ),
        (
            'values = { state = { ok = 200 } }',
            "values maps unknown canonical field 'state'; canonical fields are "
            "['request_id', 'ts', 'account_id', 'model', 'status', 'prompt_tokens', "
            "'completion_tokens', 'cached_tokens', 'ttft_ms', 'latency_ms', "
            "'prefill_instance', 'decode_instance', 'cache_salt']",
        ),
        ('values = { status = { ok = true } }', "values.status: 'ok' must map to a text or a number"),
        ('null_tokens = "-"', 'null_tokens must be a list of texts, e.g. null_tokens = ["", "null", "-"]'),
    ],
)
def test_bad_value_maps_and_null_tokens(tmp_path, extra, message):
    with pytest.raises(ConfigError) as e:
        load_incident(write_incident(tmp_path, f'path = "g.jsonl"\n{extra}'))
    assert str(e.value) == ERR + message


def test_the_cli_exits_2_naming_the_key_of_an_unknown_column(tmp_path, capsys):
    (tmp_path / "g.csv").write_text(CSV)
    path = write_incident(
        tmp_path,
        'path = "g.csv"\ncolumns = { request_id = "id", ts = "startTime", account_id = "who", '
        'status = "state", prompt_tokens = "tokens", ttft_ms = "epoch_ms(t_first) - epoch_ms(startTime)" }',
    )
    assert main(["ingest", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "incident.toml: source 'gw': columns.ttft_ms: column 't_first' is not in g.csv" in err
    assert "Traceback" not in err


ODD_TEXTS = [
    "",
    "-",
    "null",
    " 200 ",
    "ok",
    "1e400",
    "nan",
    "2026-08-27 17:15:03.123",
    "2026-08-27T17:15:03Z",
    "infinity",
    "{\"team\": \"t\"}",
    "{",
    "[1]",
]
TEXTS = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.sampled_from(ODD_TEXTS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)
PROPERTY_SOURCE = """null_tokens = ["", "-"]
values = { status = { ok = 200 }, model = { "" = "x" } }
[sources.columns]
request_id = "rid"
ts = "t0"
account_id = 'coalesce(who, "meta.team")'
status = "CASE WHEN code = 'ok' THEN '200' ELSE code END"
prompt_tokens = "CAST(n AS BIGINT) + 1"
ttft_ms = "epoch_ms(t1) - epoch_ms(t0)"
latency_ms = "abs(n) / 3"
"""


@settings(
    max_examples=int(os.environ.get("KVF_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"t0": TEXTS, "t1": TEXTS, "who": TEXTS, "meta": TEXTS, "code": TEXTS, "n": TEXTS, "model": TEXTS}
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["jsonl", "csv"]),
)
def test_mapped_sources_load_or_quarantine_every_record_and_never_raise(tmp_path_factory, records, fmt):
    tmp_path = tmp_path_factory.mktemp("p")
    rows = [{"rid": f"r{i}", **r} for i, r in enumerate(records)]
    if fmt == "jsonl":
        data = "\n".join(json.dumps(r) for r in rows) + "\n"
    else:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
        data = out.getvalue()
    result, loaded, refused = load(tmp_path, f"g.{fmt}", data, PROPERTY_SOURCE)
    assert result.records_read == len(rows)
    assert result.loaded + result.quarantined + result.duplicates == len(rows) == len(loaded) + len(refused)


def test_columns_beside_a_number_in_coalesce_or_case_are_read_as_numbers(tmp_path):
    lines = [
        {
            "rid": "a",
            "ts": "2026-08-28T10:00:00Z",
            "account_id": "x",
            "model": "m",
            "code": "201",
            "in": 5,
            "ttft": None,
            "total": "800",
        },
        {
            "rid": "b",
            "ts": "2026-08-28T10:00:01Z",
            "account_id": "x",
            "model": "m",
            "code": "OK",
            "in": 6,
            "ttft": "12.5",
            "total": "900",
        },
    ]
    _, rows, refused = load(
        tmp_path,
        "g.jsonl",
        "\n".join(json.dumps(r) for r in lines) + "\n",
        """columns = { request_id = "rid", prompt_tokens = "in", status = "CASE WHEN code = 'OK' THEN 200 ELSE code END", ttft_ms = "coalesce(ttft, total / 2)" }""",
    )
    assert refused == []
    assert [(r[0], r[4], r[7]) for r in rows] == [("a", 201, 400.0), ("b", 200, 12.5)]


def test_time_functions_read_epoch_numbers_by_magnitude(tmp_path):
    lines = [
        {
            "rid": "a",
            "created": 1741089600,
            "first": 1741089600250,
            "done": "1741089601.5",
            "account_id": "x",
            "model": "m",
            "status": 200,
            "prompt_tokens": 5,
        }
    ]
    _, rows, refused = load(
        tmp_path,
        "g.jsonl",
        json.dumps(lines[0]) + "\n",
        'columns = { request_id = "rid", ts = "created", ttft_ms = "epoch_ms(first) - epoch_ms(created)", '
        'latency_ms = "(epoch(done) - epoch(created)) * 1000" }',
    )
    assert refused == []
    assert rows == [("a", utc("2025-03-04 12:00:00"), "x", "m", 200, 5, None, 250.0, 1500.0)]


@pytest.mark.slow
def test_the_sample_exported_with_status_text_and_empty_ttfts_mapped_with_values_and_null_tokens(
    tmp_path, sample_incident
):
    """Issue 12, observations 1 and 2: the gateway log with LiteLLM's status text and "ttft_ms": "" on a
    third of its records gives the sample's exact affected set once the source maps them."""
    from kvforensics.investigation import run

    data = tmp_path / "sample"
    shutil.copytree(sample_incident.parent, data)
    for path in sorted((data / "gateway").glob("*.jsonl.gz")):
        records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]
        for i, r in enumerate(records):
            r["http_status"] = {200: "success"}.get(r["http_status"], r["http_status"])
            if i % 3 == 0 and r.get("ttft_ms") is None:
                r["ttft_ms"] = ""
        path.write_bytes(gzip.compress(("\n".join(json.dumps(r) for r in records) + "\n").encode(), mtime=0))
    toml = (data / "incident.toml").read_text()
    assert toml.count('name = "gateway"\n') == 1
    (data / "incident.toml").write_text(
        toml.replace(
            'name = "gateway"\n', 'name = "gateway"\nnull_tokens = [""]\nvalues = { status = { success = 200 } }\n'
        )
    )
    out = tmp_path / "out"
    run(data / "incident.toml", out, progress=False)
    truth = json.loads((data / "ground_truth.json").read_text())
    with (out / "affected_requests.csv").open(newline="") as fh:
        got = {r["request_id"] for r in csv.DictReader(fh)}
    assert got == {a["request_id"] for a in truth["affected"]}
    assert json.loads((out / "scope.json").read_text())["affected_responses"] == 155


# --- a key the mapping names that no record of a JSONL file has: exit 2, as a CSV column the header lacks --

CHAT_LOG = (
    "\n".join(
        json.dumps(r)
        for r in [
            {
                "id": f"c{i}",
                "created": 1756318800 + i,
                "model": "glm-5.3",
                "usage": {"prompt_tokens": 10 + i},
                "timing": {"queued_ms": 3},
                "messages": [{"role": "user", "content": "[redacted]"}],
            }
            for i in range(3)
        ]
    )
    + "\n"
)
CHAT_COLUMNS = 'request_id = "id", ts = "created", prompt_tokens = "usage.prompt_tokens", status = "(200)"'


def test_a_mapped_key_no_record_has_is_an_error_though_its_name_is_a_value_in_the_file(tmp_path):
    """ "user" is in every record, as the role of a message: no record has a key user, so mapping the
    account to it is a mapping mistake (exit 2), not a file whose every record is quarantined (exit 3)."""
    with pytest.raises(InputError) as e:
        load(tmp_path, "g.jsonl", CHAT_LOG, f'columns = {{ {CHAT_COLUMNS}, account_id = "user" }}')
    assert str(e.value) == (
        f"source 'gw': {tmp_path / 'g.jsonl'}: required field 'account_id' is missing (mapped to key "
        "'user'): no record has it; the records have keys ['created', 'id', 'messages', 'model', "
        "'timing', 'usage']. Map it in the incident file: columns = { account_id = \"<key>\" }"
    )


def test_an_optional_field_mapped_to_a_key_no_record_has_is_left_empty_and_said(tmp_path):
    """JSON records leave absent values out, and one file of a source may have none (a day without a
    streamed request has no TTFT): the field is empty and the load says why, nothing is refused."""
    result, rows, refused = load(
        tmp_path,
        "g.jsonl",
        CHAT_LOG,
        f'columns = {{ {CHAT_COLUMNS}, account_id = "model", ttft_ms = "first_token_ms" }}',
    )
    assert (len(rows), refused, {r[7] for r in rows}) == (3, [], {None})
    assert "ttft_ms left empty: no record of g.jsonl has key 'first_token_ms' (columns.ttft_ms)" in result.notes


def test_an_expression_reading_a_path_no_record_has_is_an_error_though_its_object_is_there(tmp_path):
    source = (
        f'columns = {{ {CHAT_COLUMNS}, account_id = "model", '
        'ttft_ms = \'"timing.first_token_ms" - "timing.queued_ms"\' }'
    )
    assert config_error(tmp_path, source, data=CHAT_LOG) == (
        ERR + "columns.ttft_ms: column 'timing.first_token_ms' is not in g.jsonl (it has: created, id, messages, "
        "model, timing, usage)"
    )


def test_an_alternative_no_record_has_is_no_error_but_every_one_missing_is(tmp_path):
    source = f'columns = {{ {CHAT_COLUMNS}, account_id = \'coalesce(tenant, "meta.tenant", model)\' }}'
    _, rows, refused = load(tmp_path, "g.jsonl", CHAT_LOG, source)
    assert (len(rows), refused) == (3, [])
    assert (
        config_error(tmp_path, f'columns = {{ {CHAT_COLUMNS}, account_id = \'coalesce(tenant, "meta.tenant")\' }}')
        == ERR
        + "columns.account_id: columns 'tenant', 'meta.tenant' are not in g.jsonl (it has: created, id, "
        "messages, model, timing, usage)"
    )


def test_a_key_first_logged_after_the_sampled_records_is_no_error(tmp_path):
    lines = CHAT_LOG.splitlines() * 700  # 2,100 records; the last one names its tenant
    lines.append(json.dumps({**json.loads(lines[0]), "id": "late", "tenant": "acct-9"}))
    _, rows, refused = load(
        tmp_path, "g.jsonl", "\n".join(lines) + "\n", f'columns = {{ {CHAT_COLUMNS}, account_id = "tenant" }}'
    )
    assert [r[:3] for r in rows if r[0] == "late"] == [("late", utc("2025-08-27 18:20:00"), "acct-9")]
    assert {reason for _, reason in refused} == {"missing required field 'account_id' (column tenant)"}


# --- [models] aliases follow the reader that read the file ----------------------------------------------------


def test_model_aliases_apply_to_an_engines_request_log_given_as_jsonl(tmp_path):
    """SGLang's --log-requests JSON under a jsonl source is recognised and read as SGLang's log: its
    model names are the engine's, so [models] aliases rename them as for format = "sglang_requests"."""
    fixture = Path(__file__).parent / "fixtures" / "sglang_requests" / "sglang-0.5.23-json.log"
    (tmp_path / "engine-requests.jsonl").write_bytes(fixture.read_bytes())
    (tmp_path / "incident.toml").write_text("""[incident]
id = "t"

[models]
aliases = { "gemma-3-27b" = "@cf/google/gemma-3-27b-it" }

[[sources]]
name = "gw"
kind = "requests"
path = "engine-requests.jsonl"
timezone = "Europe/Berlin"
model = "gemma-3-27b"
""")
    incident = load_incident(tmp_path / "incident.toml")
    (src,) = incident.sources
    assert src.format == "jsonl"
    con = connect()
    (result,) = load_requests_files(con, src, src.files(), model_aliases=incident.model_aliases)
    assert "recognised as SGLang --log-requests JSON; read as format = \"sglang_requests\"" in result.notes
    assert con.execute("SELECT DISTINCT model FROM requests").fetchall() == [("@cf/google/gemma-3-27b-it",)]
