"""OpenTelemetry OTLP/JSON trace exports as a requests source (``preset = "otlp"``): one request per
GenAI span, every other span skipped and counted, every unreadable part quarantined where it is.
The fixtures are written from the OTLP specification and the GenAI semantic conventions (see
``tests/fixtures/otlp/README.md``)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import Source, load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.sources.requests.load import load_requests_file, load_requests_files
from kvforensics.sources.requests.otlp import MISSING_REASONS, TraceExportReader, preset_columns, recognises
from kvforensics.sources.requests.presets import load_preset

FIXTURES = Path(__file__).parent / "fixtures" / "otlp"
EXPORT = FIXTURES / "collector-file-exporter.jsonl"
DOCUMENT = FIXTURES / "otlp-http-request.json"
FIELDS = (
    "request_id, ts, account_id, model, status, prompt_tokens, completion_tokens, cached_tokens, ttft_ms, "
    "latency_ms, prefill_instance, decode_instance, source_line"
)
NO_ACCOUNT = MISSING_REASONS["account_id"][1]


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


# the three GenAI model-call spans of line 1 of the export, as canonical requests (source_line last)
CHAT = (
    "chatcmpl-001",
    utc("2026-09-08T22:00:01.25"),
    "acct-17",
    "glm-5.3",
    200,
    120000,
    256,
    4096,
    412.0,
    3500.0,
    None,
    None,
)
ERRORED = (
    "b7ad6b7169203331",
    utc("2026-09-08T22:00:10"),
    "acct-9",
    "glm-5.3",
    500,
    900,
    0,
    None,
    300.0,
    900.0,
    None,
    None,
)
VLLM = ("cmpl-77", utc("2026-09-08T22:00:20"), "acct-3", "glm-5.3", 200, 64000, 12, None, 50.0, 2000.0, None, None)


def incident_source(tmp_path: Path, path: Path, extra: str = "", preset: bool = True, how: str | None = None) -> Source:
    toml = tmp_path / "incident.toml"
    if how is None:
        how = 'preset = "otlp"' if preset else 'format = "otlp_json"'
    toml.write_text(
        f"""[incident]
id = "otlp-test"
[[sources]]
name = "traces"
kind = "requests"
path = {json.dumps(str(path))}
{how}
{extra}
""",
        encoding="utf-8",
    )
    (source,) = load_incident(toml).sources
    return source


def load(source: Source, path: Path):
    con = connect()
    result = load_requests_file(con, source, path)
    rows = con.execute(f"SELECT {FIELDS} FROM requests ORDER BY ts").fetchall()
    quarantine = con.execute("SELECT line, reason, raw FROM quarantine ORDER BY line, reason").fetchall()
    return con, result, rows, quarantine


def test_collector_file_export_through_the_preset(tmp_path):
    source = incident_source(tmp_path, EXPORT)
    assert source.format == "otlp_json"
    _, r, rows, quarantine = load(source, EXPORT)
    # line 1: three GenAI spans (the HTTP span skipped); line 2: malformed; line 3: the chat span again;
    # line 4: metrics; line 5: a tool span (skipped), a span with a bad id, a span without an account
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (7, 3, 3, 1)
    assert r.reader == "python"
    assert rows == [(*CHAT, 1), (*ERRORED, 1), (*VLLM, 1)]
    assert [(line, reason) for line, reason, _ in quarantine] == [
        (2, "malformed JSON"),
        (5, NO_ACCOUNT),
        (5, "spanId 'xyz' is not 8 bytes in hex"),
    ]
    raws = {reason: raw for _, reason, raw in quarantine}
    assert (
        json.loads(raws["spanId 'xyz' is not 8 bytes in hex"])["otlp.location"]
        == "resourceSpans[0].scopeSpans[0].spans[1]"
    )
    unaccounted = json.loads(raws[NO_ACCOUNT])
    assert unaccounted["otlp.location"] == "resourceSpans[0].scopeSpans[0].spans[2]"
    assert unaccounted["otlp.span_id"] == "00f067aa0ba902b9"
    assert unaccounted["service.instance.id"] == "glm53-decode-1"  # resource attributes come along
    assert raws["malformed JSON"].startswith('{"resourceSpans":[{"resource"')
    assert {
        "1 GenAI execute_tool span(s) (agent or tool steps, not model calls) skipped",
        "1 blank line(s) skipped",
        "1 export(s) of metrics, not traces, skipped",
        "1 span(s) without gen_ai.* attributes (not model calls) skipped",
    } <= set(r.notes)


def test_the_format_alone_maps_as_the_preset_does(tmp_path):
    assert preset_columns() == load_preset("otlp")["columns"]
    _, r, rows, _ = load(incident_source(tmp_path, EXPORT, preset=False), EXPORT)
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (7, 3, 3, 1)
    assert rows == [(*CHAT, 1), (*ERRORED, 1), (*VLLM, 1)]


READ_AS_OTLP = (
    'recognised as an OpenTelemetry OTLP/JSON trace export; read as format = "otlp_json" '
    "(the otlp mapping, with the source's own columns over it)"
)


@pytest.mark.parametrize("how", ['format = "jsonl"', ""])
@pytest.mark.parametrize("fixture", [EXPORT, DOCUMENT])
def test_an_export_given_as_jsonl_or_by_its_json_name_is_read_as_otlp(tmp_path, how, fixture):
    source = incident_source(tmp_path, fixture, how=how)
    assert source.format == "jsonl"
    _, r, rows, quarantine = load(source, fixture)
    assert READ_AS_OTLP in r.notes
    assert [row[:-1] for row in rows] == [CHAT, ERRORED, VLLM]
    if fixture == EXPORT:  # exactly what the otlp_json format reads
        assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (7, 3, 3, 1)
        assert [(line, reason) for line, reason, _ in quarantine] == [
            (2, "malformed JSON"),
            (5, NO_ACCOUNT),
            (5, "spanId 'xyz' is not 8 bytes in hex"),
        ]
    else:
        assert (r.records_read, r.loaded, quarantine) == (3, 3, [])


def test_a_jsonl_sources_own_columns_map_the_spans_of_an_export(tmp_path):
    source = incident_source(
        tmp_path,
        EXPORT,
        'columns = { account_id = "enduser.id", decode_instance = "service.instance.id" }',
        how='format = "jsonl"',
    )
    _, r, rows, _ = load(source, EXPORT)
    assert READ_AS_OTLP in r.notes
    assert [(row[0], row[2], row[11]) for row in rows] == [
        ("chatcmpl-001", "acct-17", "gw-0"),
        ("b7ad6b7169203331", "someone@acct-9", "gw-0"),
    ]


def test_another_presets_columns_on_an_export_say_to_use_the_otlp_preset(tmp_path):
    """The columns of another export's preset name keys no span has: a mapping mistake (exit 2) that
    says what to write, not a file whose every record is quarantined."""
    with pytest.raises(ConfigError) as e:
        load(incident_source(tmp_path, EXPORT, how='preset = "openai"'), EXPORT)
    assert str(e.value) == (
        f"incident.toml: source 'traces': {EXPORT.name} is an OpenTelemetry OTLP/JSON trace "
        "export, which preset 'openai' does not map: use preset = \"otlp\" for these files"
    )


def test_a_users_columns_override_the_preset_field_by_field(tmp_path):
    source = incident_source(
        tmp_path,
        EXPORT,
        'columns = { account_id = "enduser.id", prefill_instance = '
        '"server.address", decode_instance = "service.instance.id" }',
    )
    _, r, rows, quarantine = load(source, EXPORT)
    # enduser.id instead of the tenant; the vLLM span has only user.id, so it now lacks an account
    assert [row[:4] for row in rows] == [CHAT[:3] + ("glm-5.3",), ERRORED[:2] + ("someone@acct-9", "glm-5.3")]
    assert [row[10:] for row in rows] == [("glm53-prefill-0.pd.svc", "gw-0", 1), (None, "gw-0", 1)]
    assert [(line, reason) for line, reason, _ in quarantine if "account_id" in reason] == [
        (1, "missing required field 'account_id' (column enduser.id)"),
        (5, "missing required field 'account_id' (column enduser.id)"),
    ]
    assert (r.loaded, r.quarantined) == (2, 4)


def test_a_whole_file_document_numbers_each_span_by_the_line_it_opens_on(tmp_path):
    _, r, rows, quarantine = load(incident_source(tmp_path, DOCUMENT), DOCUMENT)
    assert quarantine == []
    assert (r.records_read, r.loaded) == (3, 3)
    lines = DOCUMENT.read_text(encoding="utf-8").splitlines()
    for request_id, *_, line in rows:
        span_id = {
            "chatcmpl-001": "eee19b7ec3c1b174",
            "b7ad6b7169203331": "b7ad6b7169203331",
            "cmpl-77": "00f067aa0ba902b7",
        }[request_id]
        assert lines[line - 1].strip() == "{"
        assert lines[line + 1].strip() == f'"spanId": "{span_id}",'
    assert [row[:-1] for row in rows] == [CHAT, ERRORED, VLLM]
    assert "read as one JSON document; a record's line is where its span opens" in r.notes


def test_a_truncated_gzip_export_loads_every_complete_line(tmp_path):
    text = EXPORT.read_bytes()
    full = gzip.compress(text * 40, mtime=0)
    path = tmp_path / "traces.jsonl.gz"
    path.write_bytes(full[: len(full) * 3 // 4])
    con, r, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert rows == [(*CHAT, 1), (*ERRORED, 1), (*VLLM, 1)]  # every later copy is a duplicate
    assert r.records_read == r.loaded + r.quarantined + r.duplicates > 7
    assert any(n.startswith("input ends early after line") for n in r.notes)
    last = con.execute("SELECT max(line) FROM quarantine").fetchone()[0]
    assert last < 6 * 40


def test_the_same_span_exported_twice_is_one_request_across_files(tmp_path):
    one = tmp_path / "a.jsonl"
    two = tmp_path / "b.jsonl"
    first_line = EXPORT.read_text(encoding="utf-8").splitlines()[0]
    one.write_text(first_line + "\n", encoding="utf-8")
    two.write_text("\n" + first_line + "\n", encoding="utf-8")
    con = connect()
    loads = load_requests_files(con, incident_source(tmp_path, tmp_path / "*.jsonl"), [one, two])
    assert [(x.loaded, x.duplicates, x.quarantined) for x in loads] == [(3, 0, 0), (0, 3, 0)]
    assert con.execute("SELECT count(*), count(DISTINCT source_file) FROM requests").fetchone() == (3, 1)


def test_a_span_id_reused_with_other_values_is_a_conflict(tmp_path):
    line = json.loads(EXPORT.read_text(encoding="utf-8").splitlines()[0])
    attributes = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    changed = json.loads(json.dumps(line))
    for a in changed["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]:
        if a["key"] == "gen_ai.usage.output_tokens":
            a["value"] = {"intValue": "999"}
    assert attributes != changed["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(changed) + "\n", encoding="utf-8")
    _, r, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert (r.loaded, r.duplicates, r.quarantined) == (3, 2, 1)
    assert [(q[0], q[1]) for q in quarantine] == [
        (2, f"duplicate request_id with conflicting values (kept the record at {path}:1)")
    ]
    assert rows[0][6] == 256


def reader_records(tmp_path: Path, lines: list[object]) -> tuple[list[tuple[int, str | None, dict | str]], list[str]]:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    reader = TraceExportReader(path)
    out = []
    for rec in reader:
        try:
            raw: dict | str = json.loads(rec.raw)
        except ValueError:
            raw = rec.raw
        out.append((rec.line, rec.problem, raw))
    return out, reader.notes


def span(span_id: str = "00f067aa0ba902b7", **attributes: dict) -> dict:
    return {
        "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
        "spanId": span_id,
        "startTimeUnixNano": "1788904820000000000",
        "attributes": [{"key": k, "value": v} for k, v in attributes.items()],
    }


def export(*spans: object, resource: list | None = None) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": resource or []}, "scopeSpans": [{"spans": list(spans)}]}]}


def b64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode()


GENAI = {"gen_ai.operation.name": {"stringValue": "chat"}}


def test_a_value_the_typing_refuses_quarantines_its_span_with_the_value(tmp_path):
    path = tmp_path / "traces.jsonl"
    bad = span(
        **GENAI,
        **{
            "gen_ai.request.model": {"stringValue": "m"},
            "tenant.id": {"stringValue": "a"},
            "gen_ai.usage.input_tokens": {"intValue": "seven"},
        },
    )
    good = span(
        "00f067aa0ba902b8",
        **GENAI,
        **{
            "gen_ai.request.model": {"stringValue": "m"},
            "tenant.id": {"stringValue": "a"},
            "gen_ai.usage.input_tokens": {"intValue": "70"},
        },
    )
    path.write_text(json.dumps(export(bad, good)) + "\n", encoding="utf-8")
    _, r, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert [(q[0], q[1]) for q in quarantine] == [(1, "prompt_tokens is not a non-negative integer: 'seven'")]
    assert json.loads(quarantine[0][2])["otlp.location"] == "resourceSpans[0].scopeSpans[0].spans[0]"
    assert [(row[0], row[5], row[-1]) for row in rows] == [("00f067aa0ba902b8", 70, 1)]


def test_broken_structure_is_quarantined_where_it_is(tmp_path):
    records, _ = reader_records(
        tmp_path,
        [
            [1, 2],
            {"resourceSpans": {"not": "a list"}},
            {"resourceSpans": ["not an object"]},
            {"resourceSpans": [{"scopeSpans": [{"scope": "x", "spans": []}]}]},
            export("not a span"),
            export({**span(), "attributes": {"gen_ai.system": "x"}}),
            export({**span(), "attributes": [{"value": {"stringValue": "no key"}}]}),
            export(span(span_id="", **GENAI)),
            {"hello": "world"},
            "{\"resourceSpans\": [",
        ],
    )
    assert [(line, problem) for line, problem, _ in records] == [
        (1, "not a JSON object"),
        (2, "resourceSpans is not a list"),
        (3, "resourceSpans entry is not a JSON object"),
        (4, "scope is not a JSON object"),
        (5, "span is not a JSON object"),
        (6, "attributes is not a list"),
        (7, "attribute #1 is not a {key, value} pair"),
        (8, "no spanId"),
        (9, "not an OTLP/JSON trace export (no resourceSpans)"),
        (10, "malformed JSON"),
    ]
    assert records[3][2] == 'resourceSpans[0].scopeSpans[0]: {"scope": "x", "spans": "[0 items]"}'
    assert records[8][2] == 'line: {"hello": "world"}'


def test_attribute_values_follow_the_otlp_json_encoding(tmp_path):
    attributes = {
        **GENAI,
        "gen_ai.usage.input_tokens": {"intValue": "7"},
        "gen_ai.usage.output_tokens": {"intValue": 8},
        "int.text": {"intValue": "seven"},
        "double": {"doubleValue": "NaN"},
        "flag": {"boolValue": True},
        "list": {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}},
        "map": {"kvlistValue": {"values": [{"key": "k", "value": {"doubleValue": 1.5}}]}},
        "empty": {},
        "gen_ai.prompt.0.content": {"stringValue": "a prompt"},
        "gen_ai.output.messages": {"stringValue": "an answer"},
    }
    base64_span = {
        **span(**attributes),
        "spanId": b64("00f067aa0ba902b7"),
        "traceId": b64("4bf92f3577b34da6a3ce929d0e0e4736"),
        "kind": "SPAN_KIND_CLIENT",
        "status": {"code": "STATUS_CODE_ERROR"},
    }
    records, notes = reader_records(
        tmp_path,
        [
            export(
                base64_span,
                resource=[
                    {"key": "flag", "value": {"boolValue": False}},
                    {"key": "host", "value": {"stringValue": "h"}},
                ],
            )
        ],
    )
    ((line, problem, record),) = records
    assert (line, problem) == (1, None)
    assert (
        record["otlp.span_id"] == "00f067aa0ba902b7" and record["otlp.trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert (record["otlp.span_kind"], record["otlp.status_code"], record["otlp.http_status"]) == (
        "CLIENT",
        "ERROR",
        500,
    )
    assert (record["otlp.input_tokens"], record["otlp.output_tokens"]) == (7, 8)
    assert (record["int.text"], record["double"], record["flag"], record["host"]) == ("seven", "NaN", True, "h")
    assert (record["list"], record["map"], record["empty"]) == (["a", 2], {"k": 1.5}, None)
    assert record["gen_ai.prompt.0.content"] == "[10 characters of content not kept]"
    assert "an answer" not in json.dumps(record)
    assert "span ids in base64 (protobuf's default JSON mapping, not OTLP/JSON's hex) read as hex" in notes


@pytest.mark.parametrize(
    ("attributes", "events", "ttft"),
    [
        ({"gen_ai.response.time_to_first_chunk": {"doubleValue": 0.25}}, [], 250.0),
        ({"gen_ai.latency.time_to_first_token": {"doubleValue": 0.5}}, [], 500.0),
        (
            {},
            [
                {"name": "gen_ai.first_chunk", "timeUnixNano": "1788904820125000000"},
                {"name": "first_token", "timeUnixNano": "1788904820100000000"},
            ],
            100.0,
        ),
        ({}, [{"name": "gen_ai.content.completion", "timeUnixNano": "1788904820100000000"}], None),
    ],
)
def test_time_to_first_token_from_an_attribute_or_the_first_token_event(tmp_path, attributes, events, ttft):
    records, _ = reader_records(tmp_path, [export({**span(**GENAI, **attributes), "events": events})])
    assert records[0][2].get("otlp.time_to_first_token_ms") == ttft


def test_content_is_never_kept_in_quarantine(tmp_path):
    _, _, _, quarantine = load(incident_source(tmp_path, EXPORT), EXPORT)
    for _, _, raw in quarantine:
        assert "secret" not in raw
    records, _ = reader_records(tmp_path, [line for line in EXPORT.read_text(encoding="utf-8").splitlines() if line])
    assert not any("secret" in json.dumps(r) for _, _, r in records if isinstance(r, dict))


# Arbitrary JSON in roughly the shape of an export: the reader must never raise, and every span it
# is given is a record, skipped and counted, or inside a part quarantined as a whole.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["NaN", "Infinity", "00f067aa0ba902b7", "1788904820000000000", "LLM", "x\ud800"]),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_any_value = st.one_of(
    _json,
    st.dictionaries(
        st.sampled_from(
            ["stringValue", "intValue", "doubleValue", "boolValue", "bytesValue", "arrayValue", "kvlistValue"]
        ),
        _json,
        max_size=2,
    ),
    st.builds(
        lambda values: {"arrayValue": {"values": values}},
        st.lists(st.fixed_dictionaries({"stringValue": _scalars}), max_size=2),
    ),
    st.builds(
        lambda values: {"kvlistValue": {"values": values}},
        st.lists(
            st.fixed_dictionaries({"key": st.text(max_size=3), "value": st.fixed_dictionaries({"intValue": _scalars})}),
            max_size=2,
        ),
    ),
)
_attribute = st.one_of(
    _json,
    st.fixed_dictionaries(
        {
            "key": st.sampled_from(
                [
                    "gen_ai.request.model",
                    "gen_ai.system",
                    "tenant.id",
                    "gen_ai.usage.input_tokens",
                    "gen_ai.operation.name",
                    "openinference.span.kind",
                    "x",
                ]
            ),
            "value": _any_value,
        }
    ),
)
_span = st.one_of(
    _json,
    st.fixed_dictionaries(
        {
            "traceId": st.sampled_from(["4bf92f3577b34da6a3ce929d0e0e4736", "", "zz"]) | _scalars,
            "spanId": st.sampled_from(["00f067aa0ba902b7", "APBnqguaqQI="]) | _scalars,
            "startTimeUnixNano": _scalars,
            "endTimeUnixNano": _scalars,
            "kind": _scalars,
            "parentSpanId": _scalars,
            "status": _json | st.fixed_dictionaries({"code": _scalars}),
            "events": _json
            | st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["first_token", "x"]) | _json, "timeUnixNano": _scalars}
                ),
                max_size=2,
            ),
            "attributes": _json | st.lists(_attribute, max_size=4),
        }
    ),
)
_export = st.one_of(
    _json,
    st.builds(
        lambda spans, resource: {
            "resourceSpans": [{"resource": resource, "scopeSpans": [{"scope": {"name": "s"}, "spans": spans}]}]
        },
        st.lists(_span, max_size=3) | _json,
        _json | st.fixed_dictionaries({"attributes": st.lists(_attribute, max_size=2)}),
    ),
)


@settings(
    max_examples=int(os.environ.get("KVF_EXAMPLES", 60)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(exports=st.lists(_export, min_size=1, max_size=4), pretty=st.booleans())
def test_any_export_is_read_without_an_exception(tmp_path, exports, pretty):
    path = tmp_path / "t.json"
    text = json.dumps(exports[0], indent=1) if pretty else "\n".join(json.dumps(e) for e in exports)
    path.write_text(text + "\n", encoding="utf-8")
    reader = TraceExportReader(path)
    lines = len(text.splitlines())
    for record in reader:
        assert 1 <= record.line <= lines
        record.raw.encode("utf-8")
        if record.problem is None:
            assert json.loads(record.raw)["otlp.location"]
    con = connect()
    loaded = load_requests_file(con, incident_source(tmp_path, path), path)
    assert loaded.records_read == loaded.loaded + loaded.quarantined + loaded.duplicates


def _as_attribute(key: str, value: object) -> dict:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _sample_as_otlp(sample: Path, out: Path, spans_per_export: int = 64) -> None:
    """The sample's gateway log as the gateway would have traced it: one CLIENT span per request
    (re-delivered records exported again), exports of many spans per line, gzip as rotated."""
    nanos_per_ms = 1_000_000
    for path in sorted((sample / "gateway").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        exports = []
        for first in range(0, len(records), spans_per_export):
            spans = []
            for r in records[first : first + spans_per_export]:
                start = (
                    int(round(datetime.fromisoformat(r["received_at"].replace("Z", "+00:00")).timestamp() * 1000))
                    * nanos_per_ms
                )
                attributes = {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.response.id": r["rid"],
                    "tenant.id": r["account_id"],
                    "gen_ai.request.model": r["model"],
                    "http.response.status_code": r["http_status"],
                    "gen_ai.usage.input_tokens": r["prompt_tokens"],
                    "gen_ai.usage.output_tokens": r["completion_tokens"],
                    "gen_ai.usage.cache_read.input_tokens": r["cached_tokens"],
                    "server.address": r["prefill_instance"],
                    "gateway.decode_instance": r["decode_instance"],
                    "error.type": r["error"],
                }
                span_id = hashlib.sha256(r["rid"].encode()).hexdigest()
                spans.append(
                    {
                        "traceId": span_id[:32],
                        "spanId": span_id[32:48],
                        "name": f"chat {r['model']}",
                        "kind": 3,
                        "startTimeUnixNano": str(start),
                        "endTimeUnixNano": str(start + round(r["latency_ms"] * nanos_per_ms)),
                        "attributes": [_as_attribute(k, v) for k, v in attributes.items() if v is not None],
                        "events": []
                        if r["ttft_ms"] is None
                        else [
                            {
                                "name": "gen_ai.first_chunk",
                                "timeUnixNano": str(start + round(r["ttft_ms"] * nanos_per_ms)),
                            }
                        ],
                        "status": {"code": 2 if r["http_status"] >= 500 else 0},
                    }
                )
            exports.append(
                {
                    "resourceSpans": [
                        {
                            "resource": {"attributes": [_as_attribute("service.name", "gateway")]},
                            "scopeSpans": [{"scope": {"name": "gateway"}, "spans": spans}],
                        }
                    ]
                }
            )
        name = path.name.replace("requests-", "traces-")
        with gzip.open(out / name, "wt", encoding="utf-8") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in exports)


@pytest.mark.slow
def test_the_sample_traced_with_opentelemetry_gives_the_same_investigation(tmp_path, sample_incident, sample_run):
    from kvforensics.investigation import run

    sample = sample_incident.parent
    traces = tmp_path / "traces"
    traces.mkdir()
    _sample_as_otlp(sample, traces)
    text = sample_incident.read_text(encoding="utf-8")
    gateway = text[text.index("[[sources]]") : text.index("[[sources]]", text.index("[[sources]]") + 1)]
    traced = text.replace(
        gateway,
        f"""[[sources]]
name = "gateway"
kind = "requests"
path = {json.dumps(str(traces / "*.jsonl.gz"))}
preset = "otlp"
columns = {{ prefill_instance = "server.address", decode_instance = "gateway.decode_instance" }}

""",
    )
    for folder in ("engine", "changes", "content"):
        traced = traced.replace(f'path = "{folder}/', f'path = "{sample / folder}/')
    (tmp_path / "incident.toml").write_text(traced, encoding="utf-8")
    run(tmp_path / "incident.toml", tmp_path / "out", progress=False)
    scope = json.loads((tmp_path / "out" / "scope.json").read_text())
    expected = json.loads((sample_run / "scope.json").read_text())
    assert scope["affected_responses"] == expected["affected_responses"]
    assert scope["affected_accounts"] == expected["affected_accounts"]
    columns = (
        "request_id, ts, account_id, model, status, prompt_tokens, completion_tokens, cached_tokens, "
        "ttft_ms, latency_ms, prefill_instance, decode_instance"
    )
    tables = []
    for out in (tmp_path / "out", sample_run):
        con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
        tables.append(con.execute(f"SELECT {columns} FROM requests ORDER BY request_id").fetchall())
        con.close()
    assert len(tables[0]) == 20000
    assert tables[0] == tables[1]
    assert (tmp_path / "out" / "affected_requests.csv").read_text() == (
        sample_run / "affected_requests.csv"
    ).read_text()


def test_an_export_is_recognised_by_its_first_bytes(tmp_path):
    assert recognises(EXPORT) and recognises(DOCUMENT)
    packed = tmp_path / "traces.jsonl.gz"
    packed.write_bytes(gzip.compress(EXPORT.read_bytes()))
    assert recognises(packed)
    other = tmp_path / "gateway.jsonl"
    other.write_text('{"rid": "r1", "resourceSpans": 1}\n', encoding="utf-8")
    assert not recognises(other)


def test_openinference_llm_spans_are_model_calls_and_its_other_kinds_are_not(tmp_path):
    # https://arize-ai.github.io/openinference/spec/semantic_conventions.html
    def kind(value: str) -> dict:
        return {"openinference.span.kind": {"stringValue": value}}

    llm = span(
        "00f067aa0ba902b7",
        **kind("LLM"),
        **{
            "llm.model_name": {"stringValue": "glm-5.3"},
            "llm.token_count.prompt": {"intValue": "5000"},
            "llm.token_count.completion": {"intValue": "40"},
            "llm.token_count.prompt_details.cache_read": {"intValue": "1024"},
            "user.id": {"stringValue": "acct-5"},
            "input.value": {"stringValue": "the prompt"},
            "llm.input_messages.0.message.content": {"stringValue": "hi"},
        },
    )
    chain = span("00f067aa0ba902b8", **kind("CHAIN"), **{"gen_ai.request.model": {"stringValue": "glm-5.3"}})
    bare = span("00f067aa0ba902b9", **kind("LLM"))
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(export(llm, chain, bare)) + "\n", encoding="utf-8")
    _, r, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert rows == [
        (
            "00f067aa0ba902b7",
            utc("2026-09-08T22:00:20"),
            "acct-5",
            "glm-5.3",
            200,
            5000,
            40,
            1024,
            None,
            None,
            None,
            None,
            1,
        )
    ]
    assert [(q[0], q[1]) for q in quarantine] == [(1, NO_ACCOUNT)]
    assert "1 OpenInference CHAIN span(s) (not model calls) skipped" in r.notes
    records, _ = reader_records(tmp_path, [export(llm)])
    assert records[0][2]["input.value"] == "[12 characters of content not kept]"
    assert records[0][2]["llm.input_messages.0.message.content"] == "[4 characters of content not kept]"


def test_a_span_without_model_or_tokens_says_which_attributes_were_looked_for(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(export(span(**GENAI, **{"tenant.id": {"stringValue": "a"}}))) + "\n", encoding="utf-8")
    _, _, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert rows == []
    assert [q[1] for q in quarantine] == [
        "no model on the span (none of the attributes gen_ai.request.model, gen_ai.response.model, "
        "llm.request.model_name, llm.model_name)"
    ]
    path.write_text(
        json.dumps(
            export(span(**GENAI, **{"tenant.id": {"stringValue": "a"}, "gen_ai.request.model": {"stringValue": "m"}}))
        )
        + "\n",
        encoding="utf-8",
    )
    _, _, _, quarantine = load(incident_source(tmp_path, path), path)
    assert [q[1] for q in quarantine] == [
        "no input token count on the span (none of the attributes gen_ai.usage.input_tokens, "
        "gen_ai.usage.prompt_tokens, llm.token_count.prompt)"
    ]


def test_the_engines_span_inside_the_gateways_span_of_one_request_is_not_a_second_request(tmp_path):
    gateway = {
        **span(
            "00f067aa0ba902b7",
            **GENAI,
            **{
                "gen_ai.response.id": {"stringValue": "chatcmpl-1"},
                "gen_ai.request.model": {"stringValue": "m"},
                "tenant.id": {"stringValue": "a"},
                "gen_ai.usage.input_tokens": {"intValue": "70"},
                "http.response.status_code": {"intValue": "200"},
            },
        ),
        "endTimeUnixNano": "1788904822000000000",
    }
    engine = {
        **span(
            "00f067aa0ba902b8",
            **{
                "gen_ai.request.id": {"stringValue": "chatcmpl-1"},
                "gen_ai.response.model": {"stringValue": "m-fp8"},
                "gen_ai.usage.prompt_tokens": {"intValue": "70"},
            },
        ),
        "startTimeUnixNano": "1788904820100000000",
        "parentSpanId": "00f067aa0ba902b7",
    }
    other_trace = {**engine, "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "00f067aa0ba902b9"}
    path = tmp_path / "traces.jsonl"
    # the engine's span comes first in the file (another service's batch); a span of the same id in
    # another trace is not inside the gateway's span, so it stays a record of its own
    path.write_text(
        json.dumps(export(engine)) + "\n" + json.dumps(export(gateway, other_trace)) + "\n", encoding="utf-8"
    )
    _, r, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert [(row[0], row[2], row[3], row[-1]) for row in rows] == [("chatcmpl-1", "a", "m", 2)]
    assert (
        "1 GenAI span(s) inside another span of the same request and trace skipped (e.g. the engine's own "
        "span under the gateway's): the outermost span is the request" in r.notes
    )
    assert [(q[0], q[1]) for q in quarantine] == [(2, NO_ACCOUNT)]  # the other trace's span has no account


def test_protobuf_field_names_and_zstd_read_as_the_json_names_do(tmp_path):
    import zstandard

    def snake(value: object) -> object:
        names = {
            "resourceSpans": "resource_spans",
            "scopeSpans": "scope_spans",
            "traceId": "trace_id",
            "spanId": "span_id",
            "parentSpanId": "parent_span_id",
            "startTimeUnixNano": "start_time_unix_nano",
            "endTimeUnixNano": "end_time_unix_nano",
            "timeUnixNano": "time_unix_nano",
        }
        if isinstance(value, dict):
            return {names.get(k, k): snake(v) for k, v in value.items()}
        if isinstance(value, list):
            return [snake(v) for v in value]
        return value

    first = json.loads(EXPORT.read_text(encoding="utf-8").splitlines()[0])
    path = tmp_path / "traces.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress((json.dumps(snake(first)) + "\n").encode()))
    _, r, rows, quarantine = load(incident_source(tmp_path, path), path)
    assert quarantine == []
    assert rows == [(*CHAT, 1), (*ERRORED, 1), (*VLLM, 1)]


def test_an_engines_own_spans_name_models_the_engines_way_and_aliases_rename_them(tmp_path):
    vllm_span = span(
        **{
            "gen_ai.request.id": {"stringValue": "cmpl-9"},
            "gen_ai.response.model": {"stringValue": "zai-org/GLM-5.3-FP8"},
            "gen_ai.usage.prompt_tokens": {"intValue": "64000"},
            "user.id": {"stringValue": "acct-3"},
        }
    )
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(export(vllm_span)) + "\n", encoding="utf-8")
    con = connect()
    (loaded,) = load_requests_files(
        con, incident_source(tmp_path, path), [path], model_aliases={"zai-org/GLM-5.3-FP8": "@cf/zai-org/glm-5.3"}
    )
    assert con.execute("SELECT request_id, model FROM requests").fetchall() == [("cmpl-9", "@cf/zai-org/glm-5.3")]
    assert any("renamed to the gateway's model id through [models] aliases" in n for n in loaded.notes)


def test_a_file_without_any_model_call_says_so(tmp_path):
    http = span(**{"http.request.method": {"stringValue": "POST"}})
    records, notes = reader_records(tmp_path, [export(http, http)])
    assert records == []
    assert notes == [
        "2 span(s) without gen_ai.* attributes (not model calls) skipped",
        "no span of this file is a model call (every span was skipped, as counted above): no request was read from it",
    ]


def test_a_lone_surrogate_is_not_text_and_quarantines_its_span(tmp_path):
    bad = span(**GENAI, **{"gen_ai.request.model": {"stringValue": "m\ud800"}})
    records, _ = reader_records(tmp_path, [json.dumps(export(bad))])  # json.dumps writes it as \ud800
    assert [(line, problem) for line, problem, _ in records] == [
        (1, "a value holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")
    ]
    assert records[0][2] == {
        "otlp.location": "resourceSpans[0].scopeSpans[0].spans[0]",
        "otlp.span_id": "00f067aa0ba902b7",
    }


def test_attributes_of_unexpected_types_where_names_are_expected_do_not_break_the_reader(tmp_path):
    odd = {
        **span(**{"openinference.span.kind": {"arrayValue": {"values": [{"stringValue": "LLM"}]}}}),
        "events": [{"name": ["first_token"], "timeUnixNano": "1788904820100000000"}],
    }
    llm = {
        **span("00f067aa0ba902b8", **{"openinference.span.kind": {"stringValue": "LLM"}}),
        "events": [{"name": {"first": "token"}}],
    }
    records, notes = reader_records(tmp_path, [export(odd, llm)])
    assert [(problem, record["otlp.span_id"]) for _, problem, record in records] == [(None, "00f067aa0ba902b8")]
    assert "1 OpenInference ['LLM'] span(s) (not model calls) skipped" in notes


TIMED = {
    **GENAI,
    "gen_ai.request.model": {"stringValue": "m"},
    "gen_ai.usage.input_tokens": {"intValue": "7"},
    "app.first_token_unix_nano": {"intValue": "1788904820412000000"},
}
TTFT_FROM_ATTRIBUTES = """[sources.columns]
ttft_ms = 'epoch_ms("app.first_token_unix_nano") - epoch_ms("app.sent_at")'
"""


@pytest.mark.parametrize("how", ['preset = "otlp"', 'format = "otlp_json"', 'format = "jsonl"'])
def test_an_expression_reads_span_attributes(tmp_path, how):
    sent = span(
        "00f067aa0ba902b7",
        **TIMED,
        **{"tenant.id": {"stringValue": "a"}, "app.sent_at": {"stringValue": "2026-09-08T22:00:20Z"}},
    )
    unreadable = span(
        "00f067aa0ba902b8", **TIMED, **{"tenant.id": {"stringValue": "b"}, "app.sent_at": {"stringValue": "soon"}}
    )
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(export(sent, unreadable)) + "\n", encoding="utf-8")
    _, r, rows, quarantine = load(incident_source(tmp_path, path, TTFT_FROM_ATTRIBUTES, how=how), path)
    assert [(row[0], row[2], row[8]) for row in rows] == [("00f067aa0ba902b7", "a", 412.0)]
    assert [(line, reason) for line, reason, _ in quarantine] == [
        (1, "columns.ttft_ms: app.sent_at is not a timestamp: 'soon'")
    ]
    assert json.loads(quarantine[0][2])["otlp.span_id"] == "00f067aa0ba902b8"


@pytest.mark.parametrize("how", ['preset = "otlp"', 'format = "jsonl"'])
def test_an_expression_reading_an_attribute_no_span_has_is_an_error_before_loading(tmp_path, how):
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(export(span(**TIMED, **{"tenant.id": {"stringValue": "a"}}))) + "\n", encoding="utf-8")
    con = connect()
    with pytest.raises(
        ConfigError,
        match=r"^incident.toml: source 'traces': columns.ttft_ms: column 'app.sent_at' "
        r"is not in traces.jsonl \(it has: app.first_token_unix_nano, gen_ai",
    ):
        load_requests_file(con, incident_source(tmp_path, path, TTFT_FROM_ATTRIBUTES, how=how), path)
    assert con.execute("SELECT count(*) FROM requests").fetchone() == (0,)


def test_the_raw_text_of_a_conflict_is_its_own_span_among_the_spans_of_its_line(tmp_path):
    line = json.loads(EXPORT.read_text(encoding="utf-8").splitlines()[0])
    changed = json.loads(json.dumps(line))
    gateway_spans = changed["resourceSpans"][0]["scopeSpans"]
    for s in [gateway_spans[1]["spans"][0], changed["resourceSpans"][1]["scopeSpans"][0]["spans"][0]]:
        for a in s["attributes"]:  # the text_completion span and the vLLM span: other token counts
            if a["key"] in ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"):
                a["value"] = {"intValue": "999"}
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(changed) + "\n", encoding="utf-8")
    _, r, _, quarantine = load(incident_source(tmp_path, path), path)
    assert (r.loaded, r.duplicates, r.quarantined) == (3, 1, 2)
    kept_at = f"duplicate request_id with conflicting values (kept the record at {path}:1)"
    assert [(q[0], q[1]) for q in quarantine] == [(2, kept_at), (2, kept_at)]
    raws = sorted((json.loads(q[2])["otlp.request_id"], json.loads(q[2])["otlp.output_tokens"]) for q in quarantine)
    assert raws == [(ERRORED[0], 999), (VLLM[0], 999)]
