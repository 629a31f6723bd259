"""Engine logs in their collection envelopes: kubectl, CRI, Docker json-file, Loki, CloudWatch, journald,
Fluent Bit, syslog, docker compose, docker logs --timestamps, Vector.

The fixtures in ``tests/fixtures/envelopes`` hold SGLang and vLLM fixture lines in each collector's documented
format (README.md there cites the documentation; make_fixtures.py writes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import ENGINE_ENVELOPES, Source, load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError, InputError
from kvforensics.sources.engine_logs.envelopes.parse import ENVELOPES, sniff_envelope
from kvforensics.sources.engine_logs.parse import (
    EngineFileParse,
    StartupRecord,
    open_lines,
    parse_engine_file,
    parse_engine_log,
)
from kvforensics.stages.ingest import ingest

FIXTURES = Path(__file__).parent / "fixtures" / "envelopes"
ENGINE_FIXTURES = Path(__file__).parent / "fixtures" / "engine_logs"
UTC_ZONE = ZoneInfo("UTC")
BERLIN = ZoneInfo("Europe/Berlin")


def parse(
    name: str, tz: ZoneInfo = UTC_ZONE, instance: object = None, envelope: str = "auto", folder: Path = FIXTURES
) -> EngineFileParse:
    path = folder / name
    return parse_engine_file(path, fmt="auto", instance=instance or path.stem, tz=tz, envelope=envelope)  # type: ignore[arg-type]


def plain(name: str, year: int | None = None) -> EngineFileParse:
    path = ENGINE_FIXTURES / name
    return parse_engine_file(path, fmt="auto", instance=path.stem, tz=UTC_ZONE, envelope="none", year=year)


def capacity(s: StartupRecord) -> tuple[object, ...]:
    return (s.role, s.model, s.kv_pool_tokens, s.context_length, s.page_size, s.tp_size)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def file_lines(name: str) -> list[str]:
    """The file's physical lines: split at newlines only (compose's status lines hold a CR)."""
    return (FIXTURES / name).read_bytes().decode("utf-8").removesuffix("\n").split("\n")


def labelled(name: str, instance: str) -> EngineFileParse:
    """A fixture read with an instance template over its envelope labels; every line read once."""
    source = Source(
        name="e", kind="engine_log", path="", format="auto", timezone="UTC", base_dir=FIXTURES, instance=instance
    )
    p = parse(name, instance=lambda labels: source.instance_for(FIXTURES / name, labels))
    every_line_once(p, name)
    return p


def same_events_as_the_glm53_pods(p: EngineFileParse, name: str, mark: Callable[[str], str]) -> None:
    """The two glm53 pods' events of an export are their plain logs', each pointing at a record of its own pod
    (one holding *mark(pod)*)."""
    for pod, plain_name in (
        ("glm53-prefill-0", "sglang-0.5.15-pd-prefill-tp8.log"),
        ("glm53-decode-0", "sglang-0.5.15-pd-decode-tp8.log"),
    ):
        got = p.instances[pod]
        assert [(e.kind, e.request_id, e.prompt_tokens) for e in got.events] == [
            (e.kind, e.request_id, e.prompt_tokens) for e in plain(plain_name).events
        ], pod
        for e in got.events:
            assert mark(pod) in file_lines(name)[e.line - 1]


def every_line_once(p: EngineFileParse, name: str) -> None:
    """The file's physical lines are all read, and a quarantined line is quarantined once."""
    assert p.lines_read == len(file_lines(name))
    lines = [q.line for q in p.all_quarantined()]
    assert len(lines) == len(set(lines))
    assert all(1 <= n <= p.lines_read for n in lines)


# --- recognising the envelope -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "envelope"),
    [
        ("kubectl-glm53-decode-0.log", "kubectl"),
        ("cri-glm53-prefill-0.log", "cri"),
        ("docker-qwen3-prefill-0-json.log", "docker"),
        ("loki-3-pods-newest-first.jsonl", "loki"),
        ("loki-query-range.json", "loki"),
        ("cloudwatch-filter-log-events.json", "cloudwatch"),
        ("cloudwatch-glm53-decode-0.jsonl", "cloudwatch"),
        ("journald-sglang-decode.jsonl", "journald"),
        ("fluentbit-out-file-2-pods.log", "fluentbit"),
        ("fluentbit-json-lines-qwen3.jsonl", "fluentbit"),
        ("syslog-gpu-node-7.log", "syslog"),
        ("syslog-traditional-decode.log", "syslog"),
        ("compose-vllm-2-services.log", "compose"),
        ("compose-up-timestamps-2-replicas.log", "compose"),
        ("docker-logs-timestamps-gemma.log", "docker_logs"),
        ("vector-file-2-engines.jsonl", "vector"),
        ("vector-kubernetes-logs-qwen3.jsonl", "vector"),
        ("vector-log-namespace-glm53-decode-0.jsonl", "vector"),
    ],
)
def test_each_envelope_is_recognised_from_the_first_lines(name: str, envelope: str) -> None:
    head = list(open_lines(FIXTURES / name))[:200]
    assert sniff_envelope(head) == envelope
    p = parse(name)
    assert p.envelope == envelope
    assert p.notes[0] == f"read as a {envelope} export (recognised from its first lines)"
    every_line_once(p, name)


def test_a_plain_engine_log_has_no_envelope_and_reads_as_before() -> None:
    name = "sglang-0.5.15-pd-prefill-tp8.log"
    assert sniff_envelope(list(open_lines(ENGINE_FIXTURES / name))) == "none"
    auto = parse(name, folder=ENGINE_FIXTURES)
    assert auto.envelope == "none"
    assert auto.merged() == plain(name).merged()


def test_the_config_and_the_reader_know_the_same_envelopes() -> None:
    assert ENGINE_ENVELOPES == ("auto", "none", *ENVELOPES)


def test_an_unknown_envelope_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="unknown engine log envelope 'fluentd'; use one of: auto, none, kubectl"):
        parse("kubectl-glm53-decode-0.log", envelope="fluentd")


# --- Loki: several pods interleaved, newest first ----------------------------------------------

LOKI = "loki-3-pods-newest-first.jsonl"


def test_loki_newest_first_with_three_pods_gives_three_instances_with_their_own_capacity() -> None:
    p = parse(LOKI)
    by = {s.instance: s for s in p.startups}
    assert sorted(by) == ["glm53-decode-0", "glm53-prefill-0", "qwen3-prefill-0"]
    assert capacity(by["glm53-prefill-0"]) == ("prefill", "@cf/zai-org/glm-5.3", 681280, 1048576, 64, 8)
    assert capacity(by["glm53-decode-0"])[:4] == ("decode", "@cf/zai-org/glm-5.3", 1423360, 1048576)
    assert capacity(by["qwen3-prefill-0"]) == ("prefill", "Qwen/Qwen3-32B", 362752, 32768, 64, 2)
    # times are the envelope's clock (UTC), whatever zone logcli printed them in (+02:00 here)
    assert by["glm53-prefill-0"].ts == utc(2026, 8, 26, 21, 10, 0, 1123)
    assert by["qwen3-prefill-0"].ts == utc(2026, 8, 26, 21, 15, 0, 1123)
    assert by["glm53-decode-0"].ts == utc(2026, 8, 26, 21, 20, 0, 1123)
    assert by["glm53-decode-0"].last_ts == utc(2026, 8, 31, 17, 45, 2, 2123)
    # line numbers are the file's: the start-up's line is its server_args record
    lines = file_lines(LOKI)
    for s in p.startups:
        record = json.loads(lines[s.line - 1])
        assert record["labels"]["pod"] == s.instance
        assert "server_args=ServerArgs(" in record["line"]
    assert (
        "this loki export interleaves 3 origins, told apart by pod: each is read as its own instance "
        "(glm53-decode-0, glm53-prefill-0, qwen3-prefill-0); name them otherwise with the source's instance "
        'template, e.g. instance = "{label:pod}"'
    ) in p.notes


def test_loki_events_are_in_time_order_per_instance_and_point_at_their_file_line() -> None:
    p = parse(LOKI)
    lines = file_lines(LOKI)
    for name, one in p.instances.items():
        times = [e.ts for e in one.events]
        assert times == sorted(times), name  # the export was newest first
        for e in one.events:
            record = json.loads(lines[e.line - 1])
            assert record["labels"]["pod"] == name
            assert e.detail[:40] in record["line"]
    decode = p.instances["glm53-decode-0"]
    assert [(e.kind, e.request_id) for e in decode.events] == [
        (e.kind, e.request_id) for e in plain("sglang-0.5.15-pd-decode-tp8.log").events
    ]


def test_a_malformed_loki_record_is_quarantined_with_its_line_and_reason() -> None:
    p = parse(LOKI)
    [q] = p.all_quarantined()
    assert (q.line, q.reason) == (41, "malformed JSON (Expecting ':' delimiter at column 58)")
    assert q.raw == file_lines(LOKI)[40]


def test_the_instance_template_names_instances_from_a_label() -> None:
    source = Source(
        name="e",
        kind="engine_log",
        path="",
        format="auto",
        timezone="UTC",
        base_dir=FIXTURES,
        instance="{label:namespace}-{label:pod}",
    )
    path = FIXTURES / LOKI
    p = parse(LOKI, instance=lambda labels: source.instance_for(path, labels))
    assert sorted(p.instances) == ["inference-glm53-decode-0", "inference-glm53-prefill-0", "inference-qwen3-prefill-0"]
    assert not any("interleaves" in n for n in p.notes)


def test_a_label_the_records_lack_is_a_warning_and_the_file_name_is_used() -> None:
    source = Source(
        name="e",
        kind="engine_log",
        path="",
        format="auto",
        timezone="UTC",
        base_dir=FIXTURES,
        instance="{label:node_name}",
    )
    path = FIXTURES / "kubectl-glm53-decode-0.log"
    p = parse(path.name, instance=lambda labels: source.instance_for(path, labels))
    assert list(p.instances) == ["kubectl-glm53-decode-0"]
    assert p.warnings == [
        "1 label set(s) in this kubectl export have no label 'node_name' for the instance "
        "template: their records are read as instance 'kubectl-glm53-decode-0'"
    ]


def test_loki_query_range_response_reads_like_the_logcli_export() -> None:
    doc = parse("loki-query-range.json")
    jsonl = parse(LOKI)
    summary = {s.instance: (capacity(s), s.ts, s.last_ts) for s in doc.startups}
    assert summary == {s.instance: (capacity(s), s.ts, s.last_ts) for s in jsonl.startups}
    assert sorted((e.instance, e.ts, e.kind) for e in doc.events) == sorted(
        (e.instance, e.ts, e.kind) for e in jsonl.events
    )
    lines = file_lines("loki-query-range.json")
    for e in doc.events:  # each entry's line: the array [ "<ns>", "<line>" ] starts there
        assert lines[e.line - 1].strip() == "["
        assert lines[e.line].strip().strip('",').isdigit()


def test_records_with_the_same_clock_keep_their_written_order_in_a_newest_first_export(tmp_path: Path) -> None:
    """Stamped to the second, many records share a clock: turned round, not just sorted, they keep
    the order the engine wrote them in (the 1-token stub after the abort of the same second)."""
    name = "sglang-0.5.15-pd-prefill-tp8.log"
    lines = (ENGINE_FIXTURES / name).read_text().splitlines()
    records = []
    for line in lines:
        ns = int(datetime.fromisoformat(line[1:20]).replace(tzinfo=UTC).timestamp()) * 1_000_000_000
        records.append({"labels": {"pod": "p"}, "line": line, "timestamp": str(ns)})
    path = tmp_path / "same-second.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))
    got = parse(path.name, folder=tmp_path)
    want = plain(name)
    assert len({r["timestamp"] for r in records}) < len(records)  # there are ties
    assert [capacity(s) for s in got.startups] == [capacity(s) for s in want.startups]
    assert [(len(lines) + 1 - e.line, e.kind, e.request_id, e.prompt_tokens) for e in got.events] == [
        (e.line, e.kind, e.request_id, e.prompt_tokens) for e in want.events
    ]


# --- Fluent Bit ---------------------------------------------------------------------------------

FLUENTBIT = "fluentbit-out-file-2-pods.log"


def test_fluent_bit_file_output_with_two_pods_gives_each_pod_its_capacity_and_events() -> None:
    p = parse(FLUENTBIT)
    every_line_once(p, FLUENTBIT)
    assert sorted(p.instances) == ["glm53-decode-0", "glm53-prefill-0"]  # told apart by kubernetes.pod_name
    by = {s.instance: s for s in p.startups}
    [prefill] = plain("sglang-0.5.15-pd-prefill-tp8.log").startups
    [decode] = plain("sglang-0.5.15-pd-decode-tp8.log").startups
    # the prefill pod's server_args line came in three partial records (logtag P, P, F)
    assert (
        capacity(by["glm53-prefill-0"])
        == capacity(prefill)
        == ("prefill", "@cf/zai-org/glm-5.3", 681280, 1048576, 64, 8)
    )
    assert capacity(by["glm53-decode-0"]) == capacity(decode)
    # the clock is Fluent Bit's event time, to the nanosecond; the start-up points at its first piece
    assert (by["glm53-prefill-0"].line, by["glm53-prefill-0"].ts) == (1, utc(2026, 8, 26, 21, 10, 0, 1123))
    assert "logtag" in file_lines(FLUENTBIT)[by["glm53-decode-0"].line - 1]
    same_events_as_the_glm53_pods(p, FLUENTBIT, lambda pod: f'"pod_name":"{pod}"')
    [q] = p.all_quarantined()
    assert (q.line, q.reason) == (50, "bad fluentbit record: an out_file line cut short (no closing ']')")
    assert q.raw == file_lines(FLUENTBIT)[49]


def test_fluent_bit_json_lines_name_the_instance_from_the_pod_label() -> None:
    name = "fluentbit-json-lines-qwen3.jsonl"
    p = labelled(name, "{label:namespace_name}/{label:pod_name}")
    [s] = p.startups
    [want] = plain("sglang-0.5.4-pd-prefill.log").startups
    assert (s.instance, capacity(s)) == ("inference/qwen3-prefill-0", capacity(want))
    assert s.ts == utc(2026, 8, 26, 21, 15, 0, 1123)  # "date", a double: to the microsecond
    assert [(e.kind, e.request_id) for e in p.events] == [
        (e.kind, e.request_id) for e in plain("sglang-0.5.4-pd-prefill.log").events
    ]
    assert p.all_quarantined() == []


@pytest.mark.parametrize(
    ("line", "ns"),
    [
        ('kube.a: [1787778600.001123456, {"log":"x"}]', 1787778600001123456),  # Fluent Bit 2.1 and later
        ('kube.a: [1787778600.001123, {"log":"x"}]', 1787778600001123000),  # before: printf %f
        ('cpu.local: [1787778600, {"message":"x"}]', 1787778600000000000),
    ],
)
def test_fluent_bit_out_file_times_of_every_version(line: str, ns: int) -> None:
    from kvforensics.sources.engine_logs.envelopes.fluentbit import out_file_line

    assert out_file_line(line)[1] == ns


@pytest.mark.parametrize(
    ("date", "ns"),
    [
        (1787778600.001123, 1787778600001123000),  # json_date_format double (the default)
        (1787778600, 1787778600000000000),  # epoch
        (1787778600001, 1787778600001000000),  # epoch_ms
        ("2026-08-26T21:10:00.001123Z", 1787778600001123000),  # iso8601
        ("2026-08-26 21:10:00.001123", 1787778600001123000),  # java_sql_timestamp (UTC)
        ("2026-08-26T23:10:00.001+02:00", 1787778600001000000),
    ],
)
def test_fluent_bit_dates_in_every_json_date_format(date: object, ns: int) -> None:
    from kvforensics.sources.engine_logs.envelopes.fluentbit import date_ns

    assert date_ns(date) == ns


@pytest.mark.parametrize(
    "record",
    [
        b'{"date":"yesterday","log":"x"}',
        b'{"date":true,"log":"x"}',
        b'{"date":-5,"log":"x"}',
        b'kube.a: [1787778600.5, {"log":1}]',
        b'kube.a: [1787778600.5, "x"]',
        b'kube.a: [1787778600.5, {"log":"x"',
    ],
)
def test_a_fluent_bit_record_that_cannot_be_read_is_quarantined_with_its_reason(tmp_path: Path, record: bytes) -> None:
    path = tmp_path / "fb.log"
    good = (FIXTURES / FLUENTBIT).read_bytes().splitlines(keepends=True)[:3]
    path.write_bytes(b"".join(good) + record + b"\n")
    p = parse_engine_file(path, fmt="sglang", instance="fb", tz=UTC_ZONE, envelope="fluentbit")
    [q] = p.all_quarantined()
    assert q.line == 4 and q.reason.startswith("bad fluentbit record: "), q.reason


# --- syslog (rsyslog, syslog-ng) ---------------------------------------------------------------

SYSLOG = "syslog-gpu-node-7.log"


def test_syslog_with_two_engines_on_one_host_tells_them_apart_by_program() -> None:
    p = parse(SYSLOG, tz=BERLIN)
    every_line_once(p, SYSLOG)
    assert sorted(p.instances) == ["sglang-decode", "sglang-prefill", "systemd"]
    by = {s.instance: s for s in p.startups}
    assert sorted(by) == ["sglang-decode", "sglang-prefill"]  # systemd's line is no engine's
    [prefill] = plain("sglang-0.5.15-pd-prefill-tp8.log").startups
    [decode] = plain("sglang-0.5.15-pd-decode-tp8.log").startups
    assert capacity(by["sglang-prefill"]) == capacity(prefill)
    assert capacity(by["sglang-decode"]) == capacity(decode)
    # the header's RFC 3339 time (+02:00) is the clock: to the microsecond, in UTC
    assert by["sglang-prefill"].ts == utc(2026, 8, 26, 19, 10, 0, 1123)
    assert p.warnings == []  # the engine's Berlin stamps agree with it
    for name, plain_name in (
        ("sglang-prefill", "sglang-0.5.15-pd-prefill-tp8.log"),
        ("sglang-decode", "sglang-0.5.15-pd-decode-tp8.log"),
    ):
        assert [(e.kind, e.request_id, e.prompt_tokens) for e in p.instances[name].events] == [
            (e.kind, e.request_id, e.prompt_tokens) for e in plain(plain_name).events
        ], name
        for e in p.instances[name].events:
            assert f" {name}[" in file_lines(SYSLOG)[e.line - 1]
    [q] = p.all_quarantined()
    assert (q.line, q.reason, q.raw) == (
        31,
        "not a syslog line (<time> <host> <program>[<pid>]: <message>)",
        "continued without a header",
    )


def test_a_traditional_syslog_header_has_no_year_or_zone_so_the_engine_stamp_is_the_time() -> None:
    p = parse("syslog-traditional-decode.log", tz=BERLIN)
    [s] = p.startups
    [want] = plain("sglang-0.5.15-pd-decode-tp8.log").startups
    assert capacity(s) == capacity(want)
    assert s.ts == utc(2026, 8, 26, 19, 20, 0)  # the engine's own stamp, read in the source's zone
    assert [e.request_id for e in p.events] == [e.request_id for e in plain("sglang-0.5.15-pd-decode-tp8.log").events]


def test_syslog_labels_name_instances_by_host_and_program() -> None:
    source = Source(
        name="e",
        kind="engine_log",
        path="",
        format="auto",
        timezone="Europe/Berlin",
        base_dir=FIXTURES,
        instance="{label:host}/{label:program}",
    )
    p = parse(SYSLOG, tz=BERLIN, instance=lambda labels: source.instance_for(FIXTURES / SYSLOG, labels))
    assert sorted(s.instance for s in p.startups) == ["gpu-node-7/sglang-decode", "gpu-node-7/sglang-prefill"]


# --- CRI, Docker json-file, kubectl ------------------------------------------------------------


def test_cri_partial_lines_are_joined_and_a_cut_record_is_quarantined() -> None:
    p = parse("cri-glm53-prefill-0.log")
    [s] = p.startups
    [want] = plain("sglang-0.5.15-pd-prefill-tp8.log").startups
    # page_size, tp_size ... come from the second and third pieces of the server_args line
    assert capacity(s) == capacity(want)
    assert s.flags == {**want.flags, **{k: v for k, v in s.flags.items() if k == "engine_stamp_utc"}}
    assert (s.line, s.ts) == (1, utc(2026, 8, 26, 21, 10, 0, 1123))
    [q] = p.all_quarantined()
    assert (q.line, q.reason, q.raw) == (
        34,
        "not a CRI log line (<RFC3339Nano> stdout|stderr F|P <line>)",
        file_lines("cri-glm53-prefill-0.log")[33],
    )
    assert len(q.raw) == 18
    assert [(e.kind, e.request_id, e.prompt_tokens) for e in p.events] == [
        (e.kind, e.request_id, e.prompt_tokens) for e in plain("sglang-0.5.15-pd-prefill-tp8.log").events
    ]
    assert [e.line for e in p.events] == [66, 67, 68, 69]  # the file's lines (4 more than the engine's)


def test_docker_json_file_joins_a_line_split_over_records() -> None:
    p = parse("docker-qwen3-prefill-0-json.log")
    [s] = p.startups
    [want] = plain("sglang-0.5.4-pd-prefill.log").startups
    assert capacity(s) == capacity(want) == ("prefill", "Qwen/Qwen3-32B", 362752, 32768, 64, 2)
    assert s.ts == utc(2026, 8, 26, 21, 15, 0, 1123)
    assert [(e.line, e.kind, e.request_id) for e in p.events][:2] == [
        (20, "req_time_stats", "5c1e2a"),
        (21, "abort_input_too_long", "9ab3f0"),
    ]
    assert p.all_quarantined() == []


def test_kubectl_prefix_is_the_time_and_a_line_without_it_keeps_its_own_stamp(tmp_path: Path) -> None:
    p = parse("kubectl-glm53-decode-0.log")
    [s] = p.startups
    assert s.ts == utc(2026, 8, 26, 21, 20, 0, 1123)
    assert "engine_stamp_utc" not in s.flags  # the engine's stamp agrees to the second
    assert [e.ts for e in p.events][:1] == [utc(2026, 8, 28, 14, 3, 13, 1123)]
    text = (FIXTURES / "kubectl-glm53-decode-0.log").read_text().splitlines()
    text.insert(20, "[2026-08-28 14:03:12 TP0] Req Time Stats(rid=nopfx, input len=5, output len=1, type=decode)")
    path = tmp_path / "k.log"
    path.write_text("\n".join(text) + "\n")
    q = parse(path.name, folder=tmp_path)
    assert q.envelope == "kubectl"
    [nopfx] = [e for e in q.events if e.request_id == "nopfx"]
    assert (nopfx.line, nopfx.ts) == (21, utc(2026, 8, 28, 14, 3, 12))


# --- docker compose, docker logs --timestamps ------------------------------------------------------

COMPOSE = "compose-vllm-2-services.log"
COMPOSE_UP = "compose-up-timestamps-2-replicas.log"


def vllm_capacity(s: StartupRecord) -> tuple[object, ...]:
    return (*capacity(s), s.dp_size, s.engine_version, s.flags.get("enable_prefix_caching"))


def test_compose_logs_name_each_service_and_keep_its_start_up_times() -> None:
    """``docker compose logs`` without -t: the bar's prefix is taken off, so every engine line is read
    (before, no stamp was: capacity.valid_from NULL), each service is an instance of its own, and the
    engine config a terminal wrapped over prefix-less lines is read on as the container's."""
    p = parse_engine_file(FIXTURES / COMPOSE, fmt="auto", instance="compose", tz=UTC_ZONE, year=2026)
    every_line_once(p, COMPOSE)
    assert p.envelope == "compose"
    assert sorted(p.instances) == ["llama", "qwen3"]
    assert p.all_quarantined() == []
    by = {s.instance: s for s in p.startups}
    for instance, name in (
        ("qwen3", "vllm-0.11.0-hybrid-pd-prefill.log"),
        ("llama", "vllm-0.10.1-v1-wrapped-config.log"),
    ):
        [want] = plain(name, year=2026).startups
        assert vllm_capacity(by[instance]) == vllm_capacity(want), instance
        assert by[instance].flags == want.flags, instance
        assert by[instance].ts == want.ts, instance  # no envelope clock: the engine's own stamp
    assert by["qwen3"].ts == utc(2026, 5, 19, 8, 0, 1)
    assert by["llama"].ts == utc(2026, 5, 19, 9, 0, 0)
    assert by["llama"].flags["enable_prefix_caching"] == "true"  # on a line the terminal wrapped
    assert file_lines(COMPOSE)[by["llama"].line - 1].startswith("llama-1  | ")


def test_compose_up_timestamps_tell_replicas_apart_and_the_bar_time_is_the_clock() -> None:
    p = parse(COMPOSE_UP)
    every_line_once(p, COMPOSE_UP)
    assert sorted(p.instances) == ["gemma-1", "gemma-2"]  # two replicas of one service: by container
    by = {s.instance: s for s in p.startups}
    [want] = plain("vllm-0.33.0-banner-dp.log", year=2026).startups
    for name in by:
        assert vllm_capacity(by[name]) == vllm_capacity(want)
        assert by[name].flags.get("engine_stamp_utc") is None  # the engines' UTC stamps agree with it
    # the time after the bar (+02:00, Berlin) in UTC, the year with it (no year given)
    assert by["gemma-1"].ts == utc(2026, 4, 15, 7, 22, 41, 2123)
    assert by["gemma-2"].ts == utc(2026, 4, 15, 7, 27, 41, 2123)
    # the data-parallel engine cores' prefixes are read after the bar: the smallest pool of the two
    assert by["gemma-1"].kv_pool_tokens == 283115
    assert any("EngineCore_DP1: GPU KV cache size" in n for n in p.all_notes())
    events = [(e.kind, e.request_id) for e in plain("vllm-0.33.0-banner-dp.log", year=2026).events]
    for name in by:
        assert [(e.kind, e.request_id) for e in p.instances[name].events] == events
    assert [(q.line, q.reason) for q in p.all_quarantined()] == [
        (1, "docker compose's own status line, not a container's output"),
        (33, "docker compose's own status line, not a container's output"),
    ]
    assert "gemma-1 exited with code 137" in p.all_quarantined()[1].raw
    assert p.warnings == []


def test_a_compose_line_without_the_prefix_before_any_line_is_quarantined(tmp_path: Path) -> None:
    lines = file_lines(COMPOSE)
    path = tmp_path / "c.log"
    path.write_text("\n".join(["pasted without its prefix", *lines]) + "\n")
    p = parse(path.name, folder=tmp_path)
    assert p.envelope == "compose"
    [q] = p.all_quarantined()
    assert (q.line, q.reason) == (
        1,
        "not a docker compose log line (<container> | <line>) and no line before it to continue",
    )


def test_docker_logs_timestamps_are_the_clock() -> None:
    name = "docker-logs-timestamps-gemma.log"
    p = parse(name)
    assert p.envelope == "docker_logs"
    [s] = p.startups
    [want] = plain("vllm-0.33.0-banner-dp.log", year=2026).startups
    assert vllm_capacity(s) == vllm_capacity(want)
    assert s.ts == utc(2026, 4, 15, 7, 22, 41, 2123)  # the prefix, its year included
    assert p.all_quarantined() == []


def test_kubectl_and_docker_logs_are_told_apart_by_the_fraction_docker_always_prints_whole() -> None:
    from kvforensics.sources.engine_logs.envelopes.formats import _KUBECTL as STAMP
    from kvforensics.sources.engine_logs.envelopes.formats import _timestamps_writer

    def writer(*stamps: str) -> str:
        return _timestamps_writer([STAMP.match(f"{s} x") for s in stamps])  # type: ignore[misc]

    assert writer("2026-04-15T07:22:41.001123450Z", "2026-04-15T07:22:42.000000000Z") == "docker_logs"
    assert writer("2026-04-15T07:22:41.00112345Z", "2026-04-15T07:22:42Z") == "kubectl"
    assert writer("2026-04-15T07:22:41.001123451Z") == "kubectl"  # either: read the same way


def test_ingest_of_compose_output_gives_each_service_its_start_up_window(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / COMPOSE).write_bytes((FIXTURES / COMPOSE).read_bytes())
    rows = [
        {
            "request_id": "r1",
            "ts": "2026-05-19T10:00:00Z",
            "account_id": "a",
            "model": "llama-3.1-8b",
            "status": 200,
            "prompt_tokens": 10,
        }
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "incident.toml"
    path.write_text("""
[incident]
id = "compose"

[[sources]]
name = "gateway"
kind = "requests"
path = "requests.jsonl"

[[sources]]
name = "compose"
kind = "engine_log"
path = "engine/*.log"
format = "vllm"
year = 2026
""")
    con = connect()
    ingest(con, load_incident(path))
    assert con.execute(
        "SELECT instance, role, kv_pool_tokens, context_length, valid_from FROM capacity ORDER BY instance"
    ).fetchall() == [
        ("llama", "unified", 426800, 32768, utc(2026, 5, 19, 9, 0, 0)),
        ("qwen3", "prefill", 190800, 180000, utc(2026, 5, 19, 8, 0, 1)),
    ]


# --- Vector ------------------------------------------------------------------------------------

VECTOR_FILE = "vector-file-2-engines.jsonl"


def test_vector_file_source_tells_two_engines_apart_by_file_and_its_timestamp_is_the_clock() -> None:
    """Vector's file source writes CloudWatch's keys too (message, timestamp): it is read as Vector's (an ISO
    time, not an epoch count), each file an instance named as {stem} would name it."""
    p = parse(VECTOR_FILE)
    every_line_once(p, VECTOR_FILE)
    assert p.envelope == "vector"
    assert sorted(p.instances) == ["glm53-decode-0", "glm53-prefill-0"]
    assert "told apart by file_stem" in p.notes[1]
    by = {s.instance: s for s in p.startups}
    [prefill] = plain("sglang-0.5.15-pd-prefill-tp8.log").startups
    [decode] = plain("sglang-0.5.15-pd-decode-tp8.log").startups
    assert capacity(by["glm53-prefill-0"]) == capacity(prefill)
    assert capacity(by["glm53-decode-0"]) == capacity(decode)
    assert by["glm53-prefill-0"].ts == utc(2026, 8, 26, 21, 10, 0, 1123)  # the event's RFC 3339 time
    same_events_as_the_glm53_pods(p, VECTOR_FILE, lambda pod: f"/{pod}.log")
    [q] = p.all_quarantined()
    assert q.line == 26 and q.reason.startswith("malformed JSON")


def test_vector_kubernetes_logs_name_the_instance_from_the_pod() -> None:
    p = labelled("vector-kubernetes-logs-qwen3.jsonl", "{label:pod_namespace}/{label:pod_name}")
    [s] = p.startups
    [want] = plain("sglang-0.5.4-pd-prefill.log").startups
    assert (s.instance, capacity(s)) == ("inference/qwen3-prefill-0", capacity(want))
    assert s.ts == utc(2026, 8, 26, 21, 15, 0, 1123)
    assert p.all_quarantined() == []


def test_vector_with_log_namespacing_writes_each_line_as_a_json_string_and_the_engine_stamps_are_the_clock() -> None:
    """Under ``schema.log_namespace = true`` Vector's JSON codec writes an event's message alone: each line is read
    back from its JSON string (escapes undone) and keeps the engine's own stamp, as the plain log would."""
    name = "vector-log-namespace-glm53-decode-0.jsonl"
    p = parse(name)
    every_line_once(p, name)
    assert p.envelope == "vector" and p.all_quarantined() == []
    want = plain("sglang-0.5.15-pd-decode-tp8.log")
    [s] = p.startups
    assert (s.instance, capacity(s), s.ts) == (
        "vector-log-namespace-glm53-decode-0",
        capacity(want.startups[0]),
        want.startups[0].ts,
    )
    got = p.instances["vector-log-namespace-glm53-decode-0"].events
    assert [(e.kind, e.ts, e.request_id, e.prompt_tokens) for e in got] == [
        (e.kind, e.ts, e.request_id, e.prompt_tokens) for e in want.events
    ]


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ('{"message":"x","source_type":"file","timestamp":1787000000000}', "'timestamp' is not an RFC 3339 text"),
        ('{"message":["x"],"source_type":"file","timestamp":"2026-08-26T21:10:00Z"}', "'message' is not a string"),
        ('{"message":"x","source_type":"file","timestamp":"yesterday"}', "bad vector record"),
    ],
)
def test_a_vector_event_that_cannot_be_read_is_quarantined_with_its_reason(
    tmp_path: Path, event: str, reason: str
) -> None:
    lines = file_lines(VECTOR_FILE)
    lines.insert(3, event)
    path = tmp_path / "vector.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    p = parse_engine_file(path, fmt="auto", instance="x", tz=UTC_ZONE, envelope="auto")
    assert p.envelope == "vector"
    got = [q for q in p.all_quarantined() if q.line == 4]
    assert len(got) == 1 and reason in got[0].reason
    assert len(p.startups) == 2


# --- CloudWatch ---------------------------------------------------------------------------------


def test_cloudwatch_filter_log_events_splits_streams_and_points_at_each_event() -> None:
    p = parse("cloudwatch-filter-log-events.json")
    by = {s.instance: s for s in p.startups}
    assert sorted(by) == ["sglang/glm53-decode-0/9b1d", "sglang/glm53-prefill-0/2f8e"]
    assert capacity(by["sglang/glm53-prefill-0/2f8e"]) == ("prefill", "@cf/zai-org/glm-5.3", 681280, 1048576, 64, 8)
    assert by["sglang/glm53-decode-0/9b1d"].ts == utc(2026, 8, 26, 21, 20, 0, 1000)  # ms: the event's clock
    lines = file_lines("cloudwatch-filter-log-events.json")
    for e in p.events:
        assert lines[e.line - 1].strip() == "{"
        assert e.instance in lines[e.line]
    assert "told apart by logStreamName" in p.notes[1]


def test_cloudwatch_events_one_per_line_name_the_file_instance() -> None:
    p = parse("cloudwatch-glm53-decode-0.jsonl")
    [s] = p.startups
    assert (s.instance, s.role, s.kv_pool_tokens) == ("cloudwatch-glm53-decode-0", "decode", 1423360)
    assert [e.line for e in p.events] == [21, 22, 23, 24, 25, 26]


def test_a_truncated_json_document_quarantines_the_lines_it_could_not_read(tmp_path: Path) -> None:
    lines = file_lines("cloudwatch-filter-log-events.json")
    path = tmp_path / "cut.json"
    path.write_text("\n".join(lines[:200]) + "\n")
    p = parse(path.name, folder=tmp_path)
    quarantined = p.all_quarantined()
    assert [q.line for q in quarantined] == list(range(1, 201))
    assert quarantined[0].reason.startswith("malformed JSON document (")
    assert p.lines_read == 200


# --- journald --------------------------------------------------------------------------------------

JOURNALD = "journald-sglang-decode.jsonl"


def test_journald_byte_array_messages_and_a_left_out_message() -> None:
    p = parse(JOURNALD, tz=BERLIN)
    [s] = p.startups
    assert (s.instance, s.role, s.kv_pool_tokens) == ("journald-sglang-decode", "decode", 1423360)
    assert s.ts == utc(2026, 8, 26, 19, 20, 0, 1123)  # 21:20 in Berlin (CEST)
    assert [(q.line, q.reason) for q in p.all_quarantined()] == [
        (22, "not UTF-8"),
        (23, "MESSAGE is null: journalctl leaves out fields over 4096 bytes (export with journalctl --all -o json)"),
    ]
    assert "caf\\xe9" in p.all_quarantined()[0].raw
    # the coloured "fired up" line (a byte array holding ANSI escapes) is read, not quarantined
    assert not any("fired up" in n for n in p.all_notes())
    assert p.warnings == []


def test_a_wrong_timezone_is_reported_against_the_envelope_clock_which_stays_the_time() -> None:
    right = parse(JOURNALD, tz=BERLIN)
    wrong = parse(JOURNALD, tz=UTC_ZONE)  # the engine stamps are Berlin time
    assert [s.ts for s in wrong.startups] == [s.ts for s in right.startups]
    assert [e.ts for e in wrong.events] == [e.ts for e in right.events]
    note = (
        "engine timestamps differ from the journald __REALTIME_TIMESTAMP (UTC) by -2.00 h (median over 7 "
        "start-up and event line(s), first at line 1): the journald __REALTIME_TIMESTAMP is used as the time "
        "of each line; check the source's timezone or clock offset"
    )
    assert wrong.warnings == [note]
    assert note in wrong.all_notes()
    [s] = wrong.startups
    assert s.flags["engine_stamp_utc"] == "2026-08-26T21:20:00+00:00"  # the engine's stamp, kept


# --- the parse of a whole file, ingest and audit -----------------------------------------------------


def test_parse_engine_log_merges_the_instances_of_a_file() -> None:
    merged = parse_engine_log(FIXTURES / LOKI, fmt="sglang", instance="x", tz=UTC_ZONE, envelope="auto")
    assert sorted(s.instance for s in merged.startups) == ["glm53-decode-0", "glm53-prefill-0", "qwen3-prefill-0"]
    assert merged.lines_read == len(file_lines(LOKI))
    assert [q.line for q in merged.quarantined] == [41]


def _incident(tmp_path: Path, engine_source: str) -> Path:
    (tmp_path / "engine").mkdir()
    for name in (LOKI, JOURNALD):
        (tmp_path / "engine" / name).write_bytes((FIXTURES / name).read_bytes())
    rows = [
        {
            "request_id": f"r{i}",
            "ts": f"2026-08-27T10:0{i}:00Z",
            "account_id": "a",
            "model": m,
            "status": 200,
            "prompt_tokens": 10,
        }
        for i, m in enumerate(["@cf/zai-org/glm-5.3", "Qwen/Qwen3-32B"])
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "incident.toml"
    path.write_text(f"""
[incident]
id = "envelopes"

[[sources]]
name = "gateway"
kind = "requests"
path = "requests.jsonl"

{engine_source}
""")
    return path


def test_ingest_loads_each_instance_of_an_export_and_counts_the_files_lines(tmp_path: Path) -> None:
    incident = load_incident(
        _incident(
            tmp_path,
            """
[[sources]]
name = "loki"
kind = "engine_log"
path = "engine/loki-*.jsonl"
instance = "{label:pod}"

[[sources]]
name = "journal"
kind = "engine_log"
path = "engine/journald-*.jsonl"
envelope = "journald"
instance = "{label:_HOSTNAME}"
""",
        )
    )
    con = connect()
    result = ingest(con, incident)
    rows = con.execute(
        "SELECT instance, role, model, kv_pool_tokens, context_length, valid_from FROM capacity ORDER BY instance"
    ).fetchall()
    assert [r[:5] for r in rows] == [
        ("glm53-decode-0", "decode", "@cf/zai-org/glm-5.3", 1423360, 1048576),
        ("glm53-prefill-0", "prefill", "@cf/zai-org/glm-5.3", 681280, 1048576),
        ("gpu-node-7", "decode", "@cf/zai-org/glm-5.3", 1423360, 1048576),
        ("qwen3-prefill-0", "prefill", "Qwen/Qwen3-32B", 362752, 32768),
    ]
    assert rows[1][5] == utc(2026, 8, 26, 21, 10, 0, 1123)
    assert con.execute(
        "SELECT source, records_read, loaded, quarantined FROM load_report WHERE kind = 'engine_log' ORDER BY source"
    ).fetchall() == [("journal", 28, 26, 2), ("loki", 116, 115, 1)]
    assert con.execute("SELECT source, line FROM quarantine ORDER BY source, line").fetchall() == [
        ("journal", 22),
        ("journal", 23),
        ("loki", 41),
    ]
    # the journal's engine stamps are Berlin time but the source says UTC: a warning, not a silent shift
    assert any(
        w.startswith(f"journal: {JOURNALD}: engine timestamps differ from the journald") for w in result.warnings
    )
    assert con.execute("SELECT count(DISTINCT instance) FROM engine_events WHERE source = 'loki'").fetchall() == [(3,)]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ('envelope = "fluentd"', "envelope 'fluentd' is not one of ['auto', 'none', 'kubectl'"),
        ('instance = "{label}"', "may only use {stem}, {name}, {parent} and {label:NAME}"),
        ('envelope = "none"\ninstance = "{label:pod}"', "names an envelope label but envelope = \"none\""),
    ],
)
def test_envelope_settings_are_checked_when_the_incident_is_loaded(tmp_path: Path, keys: str, message: str) -> None:
    path = _incident(tmp_path, f'[[sources]]\nname = "e"\nkind = "engine_log"\npath = "engine/*"\n{keys}\n')
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_incident(path)


def test_envelope_is_refused_on_a_requests_source(tmp_path: Path) -> None:
    path = _incident(tmp_path, "")
    path.write_text(path.read_text().replace('path = "requests.jsonl"', 'path = "requests.jsonl"\nenvelope = "loki"'))
    with pytest.raises(ConfigError, match='envelope applies to kind "engine_log" only'):
        load_incident(path)


def test_audit_sees_every_instance_of_an_export() -> None:
    from kvforensics.audit import audit_paths

    report = audit_paths([FIXTURES / LOKI], instance_template="{label:pod}")
    assert {v.instance for v in report.verdicts} == {"glm53-decode-0", "glm53-prefill-0", "qwen3-prefill-0"}


# --- never a crash, every line accounted for -------------------------------------------------------

FIXTURE_LINES = {
    name: file_lines(name)
    for name in (
        "kubectl-glm53-decode-0.log",
        "cri-glm53-prefill-0.log",
        "docker-qwen3-prefill-0-json.log",
        LOKI,
        "loki-query-range.json",
        "cloudwatch-filter-log-events.json",
        "cloudwatch-glm53-decode-0.jsonl",
        JOURNALD,
        FLUENTBIT,
        "fluentbit-json-lines-qwen3.jsonl",
        SYSLOG,
        "syslog-traditional-decode.log",
        COMPOSE,
        COMPOSE_UP,
        "docker-logs-timestamps-gemma.log",
    )
}


@st.composite
def mangled_export(draw: st.DrawFn) -> tuple[str, bytes]:
    """An export with lines dropped, repeated, reordered, cut or replaced by noise."""
    name = draw(st.sampled_from(sorted(FIXTURE_LINES)))
    lines: list[bytes] = [line.encode() for line in FIXTURE_LINES[name]]
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(lines) - 1))
        edit = draw(st.sampled_from(["cut", "drop", "repeat", "noise", "swap"]))
        if edit == "cut":
            lines[at] = lines[at][: draw(st.integers(0, len(lines[at])))]
        elif edit == "drop" and len(lines) > 1:
            del lines[at]
        elif edit == "repeat":
            lines.insert(at, lines[at])
        elif edit == "noise":
            lines[at] = draw(
                st.one_of(
                    st.binary(max_size=60),
                    st.text(max_size=60).map(str.encode),
                    st.sampled_from(
                        [
                            b'{"log":1,"time":"x"}',
                            b'{"line":"a","timestamp":"-1"}',
                            b'{"__REALTIME_TIMESTAMP":"9"*40}',
                            b'{"timestamp":1e400,"message":"m"}',
                            b'{"data":{"result":[{"values":[[1]]}]}}',
                            b"[1,2",
                            b"{}",
                            b'{"__REALTIME_TIMESTAMP":"1","MESSAGE":[300]}',
                            b"2026-13-45T99:00:00Z stdout F x",
                            b'{"date":1e400,"log":"x"}',
                            b'k: [99999999999999999999.1, {"log":"x","logtag":"P"}]',
                            b"[" * 50_000,
                        ]
                    ),
                )
            )
        else:
            other = draw(st.integers(0, len(lines) - 1))
            lines[at], lines[other] = lines[other], lines[at]
    return name, b"\n".join(lines) + b"\n"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(export=mangled_export(), envelope=st.sampled_from(["auto", *ENVELOPES]))
def test_any_export_is_read_without_a_crash_and_every_line_is_counted_once(
    tmp_path: Path, export: tuple[str, bytes], envelope: str
) -> None:
    name, data = export
    path = tmp_path / name
    path.write_bytes(data)
    try:
        p = parse_engine_file(
            path, fmt="sglang", instance=lambda labels: f"i-{len(labels or {})}", tz=UTC_ZONE, envelope=envelope
        )
    except InputError as e:  # a clear error is allowed only for an envelope setting the file does not fit
        assert envelope != "auto" and "check the source's envelope setting" in str(e)
        return
    assert p.lines_read == data.count(b"\n")
    lines = [q.line for q in p.all_quarantined()]
    assert len(lines) == len(set(lines))
    assert all(1 <= n <= p.lines_read for n in lines)
    for s in p.startups:
        assert 1 <= s.line <= p.lines_read
    for e in p.events:
        assert 1 <= e.line <= p.lines_read


def test_an_envelope_setting_that_fits_no_record_is_a_clear_error() -> None:
    with pytest.raises(
        InputError,
        match=r"no record of this file could be read as a cri export \(its first lines "
        r"look like loki\): check the source's envelope setting",
    ):
        parse(LOKI, envelope="cri")


def test_lines_without_an_engine_stamp_take_the_envelope_clock_and_no_note_says_otherwise(tmp_path: Path) -> None:
    lines = (ENGINE_FIXTURES / "sglang-0.2-gpu-prefix.log").read_text().splitlines()
    assert any("carry no timestamp" in n for n in plain("sglang-0.2-gpu-prefix.log").all_notes())
    path = tmp_path / "gpu.log"
    path.write_text("".join(f"2026-08-26T21:10:{i:02d}.5Z {line}\n" for i, line in enumerate(lines)))
    p = parse(path.name, folder=tmp_path)
    assert p.startups and all(s.ts is not None for s in p.startups)
    assert all(e.ts is not None for e in p.events)
    assert not any("timestamp" in n for n in p.all_notes())
