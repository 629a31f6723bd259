"""Scope with the prefix_reuse mechanism: each mechanism's findings get their own sources, the probing
thresholds are set in the incident file, the conclusiveness gate asks for what the prefix rules need, and the
notices tell a prefix-cache exposure in its own words."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import duckdb
import pytest
import yaml
from conftest import INCIDENT, mini_requests, write_mini

from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core.errors import ConfigError
from kvforensics.mechanisms import MECHANISMS_DIR, load_mechanisms, read_mechanism
from kvforensics.simulate.prefix import simulate_prefix
from kvforensics.stages import conclusive
from kvforensics.stages.probing import PROBING_PARAMETERS, probing_assessment

SHARED = " ".join(f"w{i}" for i in range(12))  # three blocks of four words


def _mixed_rows() -> list[dict]:
    """The mini incident (one stale-pages leak, r-leak) on a salted deployment, plus one prefix-cache hit:
    reader-b's p-hit reused the three blocks owner-a's p-src stored under another salt."""
    rows = mini_requests()
    for r in rows:
        r["cache_salt"] = "salt-" + r["account_id"]
    common = {
        "model": "@cf/zai-org/glm-5.3",
        "http_status": 200,
        "prompt_tokens": 5000,
        "completion_tokens": 100,
        "ttft_ms": 900.0,
        "latency_ms": 4000.0,
        "prefill_instance": "p0",
        "decode_instance": "d0",
    }
    return rows + [
        {
            **common,
            "rid": "p-src",
            "received_at": "2026-08-28T09:58:10Z",
            "account_id": "owner-a",
            "cached_tokens": 0,
            "cache_salt": "salt-owner-a",
        },
        {
            **common,
            "rid": "p-hit",
            "received_at": "2026-08-28T09:59:10Z",
            "account_id": "reader-b",
            "cached_tokens": 12,
            "cache_salt": "salt-reader-b",
        },
    ]


# the deployment: tenants salted by the gateway on an SGLang build whose radix key ignores the salt
SALT_IGNORED = 'tenants = "multi"\ncache_salt = "gateway"\nengine_version = "0.5.1"\n'


def _write_mixed(
    root: Path, rows: list[dict] | None = None, content: bool = True, isolation: str = SALT_IGNORED
) -> Path:
    incident = INCIDENT + "\n[prefix_cache]\nblock_size = 4\n" + isolation
    if content:
        incident += '\n[[sources]]\nname = "content"\nkind = "content"\npath = "content/*.jsonl"\nformat = "jsonl"\n'
    path = write_mini(root, _mixed_rows() if rows is None else rows, incident)
    if content:
        (root / "content").mkdir(exist_ok=True)
        (root / "content" / "texts.jsonl").write_text(
            json.dumps({"request_id": "p-src", "prompt": SHARED + " owner private text", "output": "ok"})
            + "\n"
            + json.dumps({"request_id": "p-hit", "prompt": SHARED + " reader question", "output": "fine"})
            + "\n"
        )
    return path


def _run(incident: Path, out: Path) -> tuple[int, dict]:
    code = main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf"])
    return code, json.loads((out / "scope.json").read_text())


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Both mechanisms flag a response: the mixed incident run once."""
    root = tmp_path_factory.mktemp("mixed")
    code, scope = _run(_write_mixed(root / "incident"), root / "out")
    assert (code, scope["conclusive"]) == (0, True), scope["inconclusive_reasons"]
    return root / "out"


def _con(out: Path) -> duckdb.DuckDBPyConnection:
    return duckdb.connect(str(out / "evidence.duckdb"), read_only=True)


# --- each mechanism's findings, their own sources ---------------------------------------------------------


def test_both_mechanisms_flag_a_response_and_each_has_its_own_sources(mixed):
    con = _con(mixed)
    try:
        flagged = dict(
            con.execute(
                "SELECT request_id, list(DISTINCT mechanism) FROM findings "
                "WHERE request_id IN ('r-leak', 'p-hit') GROUP BY 1"
            ).fetchall()
        )
        assert flagged == {"r-leak": ["stale_pages"], "p-hit": ["prefix_reuse"]}
        assert {r for (r,) in con.execute("SELECT request_id FROM affected_responses").fetchall()} == {
            "r-leak",
            "p-hit",
        }
        # the turnover horizon attributes the stale-pages leak only; the prefix hit's sources are its blocks' owner
        horizon = {r for (r,) in con.execute("SELECT DISTINCT affected_request_id FROM possible_sources").fetchall()}
        assert horizon == {"r-leak"}
        assert con.execute(
            "SELECT source_request_id, source_account, basis FROM prefix_sources WHERE request_id = 'p-hit'"
        ).fetchall() == [("p-src", "owner-a", "block_fingerprints")]
        matches = con.execute(
            "SELECT DISTINCT source_account_id, basis FROM content_matches WHERE affected_request_id = 'p-hit'"
        ).fetchall()
        assert matches == [("owner-a", "block_fingerprints")]
        # a prefix-cache hit wrote its prompt's pages like any request: it may be a stale-pages source itself
        assert con.execute("SELECT count(*) FROM possible_sources WHERE source_request_id = 'p-hit'").fetchall() == [
            (1,)
        ]
        roles = dict(
            con.execute(
                "SELECT account_id, list(role ORDER BY role) FROM notifications WHERE account_id IN "
                "('owner-a', 'reader-b', 'victim-recipient') GROUP BY 1"
            ).fetchall()
        )
        assert roles == {
            "owner-a": ["data_exposed_confirmed"],
            "reader-b": ["data_exposed_possible", "received_foreign_data"],  # p-hit, a horizon source
            "victim-recipient": ["received_foreign_data"],
        }
    finally:
        con.close()


def test_the_drill_down_views_show_each_mechanisms_sources(mixed):
    from kvforensics import explore

    con = _con(mixed)
    try:
        view = explore.response_sources(con, "p-hit")
        rows = view.frame.set_index("source_request_id")
        assert (rows.loc["p-src", "source_account_id"], rows.loc["p-src", "confirmed"], rows.loc["p-src", "basis"]) == (
            "owner-a",
            True,
            "block_fingerprints",
        )
        assert view.note.startswith(
            "1 candidate source requests from 1 accounts other than the recipient reader-b; 1 accounts confirmed"
        ), view.note
        exposure = explore.account_exposure(con, "owner-a").frame
        assert exposure[["affected_request_id", "source_request_id", "confirmed", "basis"]].values.tolist() == [
            ["p-hit", "p-src", True, "block_fingerprints"],  # its blocks reused
            ["r-leak", "p-src", False, "turnover_horizon"],
        ]  # and its pages possibly read by the stale-pages leak
        stale = explore.response_sources(con, "r-leak").frame
        assert set(stale["basis"]) <= {"turnover_horizon", "output_shingles turnover_horizon", "output_shingles"}
        assert stale["within_horizon"].any()
    finally:
        con.close()


def test_a_collision_no_event_names_lists_the_resident_blocks_owners_as_possible_sources(tmp_path):
    """prefix_possible_sources rows appear in the drill-down views as possible sources (not confirmed)."""
    from kvforensics import explore

    con = duckdb.connect()
    con.execute("""CREATE TABLE possible_sources (affected_request_id VARCHAR, recipient_account_id VARCHAR,
                   source_request_id VARCHAR, source_account_id VARCHAR, kv_group VARCHAR,
                   tokens_written_since BIGINT, pool_tokens BIGINT)""")
    con.execute("""CREATE TABLE prefix_possible_sources AS SELECT 'hit' AS affected_request_id,
                   'reader' AS recipient_account_id, 'stored' AS source_request_id, 'owner' AS source_account_id,
                   NULL::VARCHAR AS kv_group, NULL::BIGINT AS tokens_written_since, NULL::BIGINT AS pool_tokens,
                   'resident_on_instance' AS basis""")
    con.execute("""CREATE TABLE content_matches (affected_request_id VARCHAR, recipient_account_id VARCHAR,
                   source_request_id VARCHAR, source_account_id VARCHAR, matching_shingles BIGINT,
                   output_shingles BIGINT, match_fraction DOUBLE, confirmed BOOLEAN, within_horizon BOOLEAN,
                   basis VARCHAR)""")
    con.execute("CREATE TABLE requests AS SELECT 'stored' AS request_id, TIMESTAMPTZ '2026-08-28 09:00:00Z' AS ts")
    con.execute("CREATE TABLE account_classes AS SELECT 'owner' AS account_id, 'customer' AS account_class")
    con.execute("""CREATE TABLE affected_responses AS SELECT 'hit' AS request_id, 'reader' AS account_id,
                   'customer' AS account_class, TIMESTAMPTZ '2026-08-28 09:01:00Z' AS ts""")
    view = explore.response_sources(con, "hit").frame
    assert view[["source_request_id", "source_account_id", "confirmed", "within_horizon", "basis"]].values.tolist() == [
        ["stored", "owner", False, False, "resident_on_instance"]
    ]
    exposure = explore.account_exposure(con, "owner").frame
    assert exposure[["affected_request_id", "confirmed", "basis"]].values.tolist() == [
        ["hit", False, "resident_on_instance"]
    ]


# --- notices in the mechanism's words ----------------------------------------------------------------------


def _notice(out: Path, account: str) -> str:
    (path,) = [p for p in (out / "notices").rglob("*.md") if p.name.startswith(account + "-")]
    return path.read_text()


def test_the_owner_of_reused_blocks_is_told_what_was_reused_and_how_we_know(mixed):
    text = _notice(mixed, "owner-a")
    prefix = {m.id: m for m in load_mechanisms()}["prefix_reuse"].notice
    assert f"## {prefix.exposed.title}" in text
    assert "stale KV" not in text and "KV-cache pages" not in text
    # the prompt it sent, when, the reused blocks' tokens, how many other accounts' requests, the basis
    row = next(line for line in text.splitlines() if line.startswith("| p-src |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["p-src", "2026-08-28T09:58:10Z", "12", "1", "1", prefix.basis("block_fingerprints")]
    assert "reader-b" not in text and "p-hit" not in text  # only the account's own facts
    assert SHARED not in text and "owner private text" not in text  # never prompt text


def test_the_recipient_of_a_prefix_hit_is_told_its_response_was_computed_on_another_tenants_blocks(mixed):
    text = _notice(mixed, "reader-b")
    prefix = {m.id: m for m in load_mechanisms()}["prefix_reuse"].notice
    assert f"## {prefix.received.title}" in text and "computed on another customer's cached blocks" in text
    row = next(line for line in text.splitlines() if line.startswith("| p-hit |"))
    assert [c.strip() for c in row.strip("|").split("|")][4] == "12"  # tokens from other accounts' blocks
    assert "owner-a" not in text and "p-src" not in text


def test_stale_pages_notices_keep_their_own_words(mixed):
    stale = {m.id: m for m in load_mechanisms()}["stale_pages"].notice
    text = _notice(mixed, "victim-recipient")
    assert f"## {stale.received.title}" in text and "prefix cache" not in text
    assert "| r-leak |" in text
    con = _con(mixed)
    try:
        (account,) = con.execute(
            "SELECT min(account_id) FROM notifications WHERE role = 'data_exposed_possible'"
        ).fetchone()
    finally:
        con.close()
    possible = _notice(mixed, account)
    assert stale.possible is not None and f"## {stale.possible.title}" in possible and "prefix cache" not in possible


def test_a_mechanism_brings_its_own_notice_and_it_is_checked(tmp_path):
    stale = MECHANISMS_DIR / "stale_pages"
    folder = tmp_path / "tapped_bus"
    folder.mkdir()
    meta = yaml.safe_load((stale / "mechanism.yml").read_text())
    notice = {
        **meta["notice"],
        "received": {"title": "Bus tapped", "text": "A <b>tap</b> read it."},
        "bases": {"bus_trace": "a trace of the bus"},
    }
    (folder / "mechanism.yml").write_text(yaml.safe_dump({**meta, "id": "tapped_bus", "notice": notice}))
    assert read_mechanism(folder).notice.basis("bus_trace") == "a trace of the bus"
    # both shipped mechanisms word their possible sources (stale pages' horizon, a collision's resident blocks)
    assert all(m.notice.possible is not None for m in load_mechanisms())
    for broken, message in [
        ({k: v for k, v in notice.items() if k != "received"}, "notice must be a mapping of received and exposed"),
        ({**notice, "received": {"title": "x"}}, "notice.received must be a mapping of title and text"),
        ({**notice, "received": {"title": "", "text": "y"}}, "'title' must be a non-empty text"),
        ({**notice, "bases": {"Bus Trace": "x"}}, "notice.bases must map each basis"),
        ({**notice, "bases": {}}, "notice.bases must map each basis"),
    ]:
        (folder / "mechanism.yml").write_text(yaml.safe_dump({**meta, "id": "tapped_bus", "notice": broken}))
        with pytest.raises(ConfigError, match=message):
            read_mechanism(folder)


# --- the conclusiveness gate: what the prefix_reuse rules need -----------------------------------------------


def _field_reasons(out: Path, tmp_path: Path, *updates: str) -> list[conclusive.Reason]:
    """rule_field_missing on a copy of *out*'s evidence after the *updates*."""
    db = tmp_path / "evidence.duckdb"
    shutil.copyfile(out / "evidence.duckdb", db)
    con = duckdb.connect(str(db))
    try:
        for stmt in updates:
            con.execute(stmt)
        return conclusive.evaluate(con, only=("rule_field_missing",))
    finally:
        con.close()


def _needs(reasons: list[conclusive.Reason]) -> list[tuple[str, list[str]]]:
    return [(r.evidence["rule"], r.evidence["fields"]) for r in reasons]


def test_complete_prefix_evidence_needs_nothing(mixed, tmp_path):
    assert _field_reasons(mixed, tmp_path) == []


def test_cached_tokens_missing_for_most_requests(mixed, tmp_path):
    few = _field_reasons(mixed, tmp_path, "UPDATE requests SET cached_tokens = NULL WHERE request_id < 'r2'")
    assert few == []  # a few requests without it: the rules still judge the period
    (reason,) = _field_reasons(mixed, tmp_path, "UPDATE requests SET cached_tokens = NULL WHERE request_id < 'r6'")
    assert (reason.evidence["rule"], reason.evidence["fields"]) == ("prefix_reuse", ["cached_tokens"])
    assert reason.message.startswith("model '@cf/zai-org/glm-5.3': cached_tokens empty for ")
    assert "cross_tenant_prefix_hit, prefix_salt_mismatch and block_hash_collision cannot tell" in reason.message


def test_a_salt_the_hits_lack_while_other_requests_carry_one(mixed, tmp_path):
    reasons = _field_reasons(mixed, tmp_path, "UPDATE requests SET cache_salt = NULL WHERE cached_tokens > 0")
    assert _needs(reasons) == [("prefix_salt_mismatch", ["cache_salt", "kv_events.salt"])]
    assert "empty for 1 of its 1 prefix-cache hits (cached_tokens > 0)" in reasons[0].message
    # nobody logs a salt (an unsalted deployment): nothing is missing
    assert _field_reasons(mixed, tmp_path, "UPDATE requests SET cache_salt = NULL") == []


def test_hits_without_blocks_or_kv_events_can_only_be_weak(mixed, tmp_path):
    reasons = _field_reasons(mixed, tmp_path, "DELETE FROM request_blocks")
    assert _needs(reasons) == [("prefix_reuse", ["request_blocks", "kv_events"])]
    assert "add the content source with prompt_token_ids" in reasons[0].message


def test_probing_needs_the_timing(mixed, tmp_path):
    reasons = _field_reasons(mixed, tmp_path, "UPDATE requests SET ttft_ms = NULL, latency_ms = NULL")
    assert ("prefix_probing", ["ttft_ms", "latency_ms"]) in _needs(reasons)
    assert ("prefill_too_fast", ["ttft_ms", "latency_ms"]) in _needs(reasons)  # the stale-pages need, as before


def test_without_prefix_reuse_its_needs_are_not_asked(mixed, tmp_path):
    reasons = _field_reasons(
        mixed,
        tmp_path,
        "UPDATE mechanisms SET selected = false WHERE id = 'prefix_reuse'",
        "UPDATE requests SET cached_tokens = NULL WHERE request_id < 'r6'",
        "DELETE FROM request_blocks",
    )
    assert reasons == []


# --- the probing thresholds in the incident file --------------------------------------------------------------


def _incident(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "incident.toml"
    path.write_text('[incident]\nid = "x"\n\n[[sources]]\nname = "g"\nkind = "requests"\npath = "r.jsonl"\n' + extra)
    return path


def test_probing_thresholds_are_read_and_checked(tmp_path):
    incident = load_incident(
        _incident(tmp_path, "[prefix_cache.probing]\nprobe_min_requests = 50\nprobe_min_short_share = 1\n")
    )
    assert incident.probing_parameters == {"probe_min_requests": 50, "probe_min_short_share": 1}
    assert not incident.prefix_word_blocks  # the probing table alone asks for no word blocks
    assert load_incident(_incident(tmp_path, "[prefix_cache]\nblock_size = 16\n")).prefix_word_blocks
    assert load_incident(_incident(tmp_path, "")).probing_parameters == {}
    for extra, message in [
        (
            "[prefix_cache.probing]\nprobe_min_request = 5\n",
            "incident.toml: [prefix_cache.probing]: unknown probing parameter 'probe_min_request' (did you mean "
            "'probe_min_requests'?); known: " + ", ".join(PROBING_PARAMETERS),
        ),
        (
            "[prefix_cache.probing]\nprobe_min_requests = 2.5\n",
            "incident.toml: [prefix_cache.probing]: probing parameter probe_min_requests must be a whole number >= 0",
        ),
        (
            "[prefix_cache.probing]\nprobe_min_cached_share = 1.5\n",
            "incident.toml: [prefix_cache.probing]: probing parameter probe_min_cached_share is a share between 0 and 1",
        ),
        ("[prefix_cache]\nprobing = 3\n", "incident.toml: [prefix_cache]: 'probing' must be a table"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_incident(_incident(tmp_path, extra))
        assert str(e.value).startswith(message)


def test_a_bad_probing_threshold_is_one_line_and_exit_2(tmp_path, capsys):
    path = _incident(tmp_path, "[prefix_cache.probing]\nprobe_max_gap_seconds = -1\n")
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "probe_max_gap_seconds must be a whole number >= 0, got -1" in err[0]


@pytest.fixture(scope="module")
def probe_incident(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("probe")
    simulate_prefix("prefix-probe", base / "incident", requests=3000)
    return base


def test_thresholds_from_the_incident_file_decide_the_tier_and_are_recorded(probe_incident):
    incident = probe_incident / "incident" / "incident.toml"
    truth = json.loads((probe_incident / "incident" / "ground_truth.json").read_text())
    with incident.open("a") as fh:
        fh.write("\n[prefix_cache.probing]\nprobe_min_requests = 100000\n")
    out = probe_incident / "out"
    code, scope = _run(incident, out)
    assert code == 0
    probing = scope["exploitation"]["prefix_probing"]
    assert probing["parameters"] == {**PROBING_PARAMETERS, "probe_min_requests": 100000}
    assert (
        json.loads((out / "manifest.json").read_text())["scope_parameters"]["prefix_probing"] == probing["parameters"]
    )
    assert not set(truth["probers"]) & set(scope["exploitation"]["accounts_looking_deliberate"])
    # the same evidence with the default thresholds finds the prober
    con = duckdb.connect(str(out / "evidence.duckdb"))
    try:
        frame = probing_assessment(con)
    finally:
        con.close()
    assert set(truth["probers"]) <= set(frame.loc[frame["probing"] == "likely", "account_id"])


def test_a_prefix_incident_without_cached_tokens_for_most_requests_is_inconclusive(tmp_path):
    simulate_prefix("prefix-l3-unsalted", tmp_path / "incident", requests=3000)
    gateway = tmp_path / "incident" / "gateway" / "requests.jsonl.gz"
    with gzip.open(gateway, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    for i, row in enumerate(rows):
        if i % 5:  # four requests in five lost the field (a gateway version that did not log usage details)
            del row["cached_tokens"]
    with gzip.open(gateway, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    code, scope = _run(tmp_path / "incident" / "incident.toml", tmp_path / "out")
    assert code == 3 and not scope["conclusive"]
    reasons = [r for r in scope["inconclusive_reasons"] if r["code"] == "rule_field_missing"]
    assert [(r["evidence"]["rule"], r["evidence"]["fields"]) for r in reasons] == [("prefix_reuse", ["cached_tokens"])]
    assert "cached_tokens empty for " in reasons[0]["message"]


@pytest.mark.parametrize(
    ("isolation", "outcome"),
    [
        ("", "undetermined"),  # no isolation facts stated
        ('tenants = "multi"\ncache_salt = "gateway"\nengine_version = "0.5.22"\n', "isolated"),  # salt honoured
        (SALT_IGNORED, "flagged"),
    ],
)
def test_a_cross_salt_hit_counts_only_through_a_path_the_startups_open(tmp_path, isolation, outcome):
    """The same hit on another salt's blocks: with no isolation facts the run is inconclusive
    (prefix_path_undetermined); on a build that keys its radix tree on the salt it is no finding; on one
    that ignores the salt it is flagged."""
    code, scope = _run(_write_mixed(tmp_path / "incident", isolation=isolation), tmp_path / "out")
    con = _con(tmp_path / "out")
    try:
        flagged = con.execute("SELECT count(*) FROM findings WHERE request_id = 'p-hit'").fetchone()[0]
    finally:
        con.close()
    reasons = [r["code"] for r in scope["inconclusive_reasons"]]
    assert (flagged > 0, "prefix_path_undetermined" in reasons) == {
        "undetermined": (True, True),
        "isolated": (False, False),
        "flagged": (True, False),
    }[outcome]
    assert code == (3 if outcome == "undetermined" else 0)
