"""The prefix-cache probing assessment (kvforensics/stages/probing.py, sql/prefix_probing.sql): a prober's traffic is
``likely`` with or without prefix blocks, partial evidence gives ``possible``, and the benign look-alikes
(evaluation harnesses, retries, a chat client, the provider's load test, a provider-wide system prompt) stay
``no``. Each test builds a small ``requests`` table (and ``request_blocks`` / ``prefix_sources`` where the
case needs them) in an evidence database."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import duckdb
import pandas as pd
import pytest

from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.stages.probing import (
    PROBING_PARAMETERS,
    probing_assessment,
    probing_parameters,
    probing_selected,
    probing_summary,
)
from kvforensics.stages.rulebook import load_rules

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=timezone.utc)
BLOCK = 16
SYSTEM_PROMPT = 1024  # the provider-wide system prompt every tenant's requests start with


@dataclass
class Traffic:
    """Requests (and their prefix blocks) of a few accounts, written into an evidence database."""

    requests: list[dict] = field(default_factory=list)
    blocks: list[dict] = field(default_factory=list)
    fingerprints: dict[str, int] = field(default_factory=dict)

    def send(
        self,
        account: str,
        ts: datetime,
        prompt: int,
        output: int,
        cached: int | None,
        *,
        status: int = 200,
        ttft_ms: float | None = 50.0,
        blocks: list[str] | None = None,
    ) -> str:
        rid = f"{account}-{len(self.requests)}"
        self.requests.append(
            {
                "request_id": rid,
                "ts": ts,
                "account_id": account,
                "model": "m",
                "status": status,
                "prompt_tokens": prompt,
                "completion_tokens": output if status < 300 else 0,
                "cached_tokens": cached,
                "ttft_ms": ttft_ms,
                "latency_ms": None if ttft_ms is None else ttft_ms + 20.0 * output,
                "source": "gateway",
                "source_file": "gateway.jsonl",
                "source_line": len(self.requests),
            }
        )
        if blocks is not None:
            chain = ""
            for position, name in enumerate(blocks):
                chain = f"{chain}/{name}"
                self.blocks.append(
                    {
                        "request_id": rid,
                        "position": position,
                        "num_tokens": BLOCK,
                        "block_fp": self._fingerprint(name),
                        "chain_fp": self._fingerprint(chain),
                    }
                )
        return rid

    def _fingerprint(self, name: str) -> int:
        """A stand-in for the keyed block and chain fingerprints: one number per distinct block or chain."""
        return self.fingerprints.setdefault(name, len(self.fingerprints) + 1)

    def database(self, *, with_blocks: bool = True) -> duckdb.DuckDBPyConnection:
        con = connect()
        frame = pd.DataFrame(self.requests)  # noqa: F841 (read by DuckDB)
        if self.requests:
            con.execute("INSERT INTO requests BY NAME SELECT * FROM frame")
        if with_blocks:
            blocks = pd.DataFrame(  # noqa: F841 (read by DuckDB)
                self.blocks,
                columns=[
                    "request_id",
                    "position",
                    "num_tokens",
                    "block_fp",
                    "chain_fp",
                ],
            )
            con.execute(
                "CREATE TABLE IF NOT EXISTS request_blocks (request_id VARCHAR, position BIGINT, "
                "num_tokens BIGINT, block_fp BIGINT, chain_fp BIGINT)"
            )
            con.execute("INSERT INTO request_blocks BY NAME SELECT * FROM blocks")
        return con


def flag(con: duckdb.DuckDBPyConnection, ids: list[str], rule: str = "cross_tenant_store_load") -> None:
    """The requests a prefix_reuse rule flagged: their reuse of other tenants' prefixes (what probing reads)."""
    con.executemany(
        "INSERT INTO findings (request_id, rule_id, rule_version, confidence) VALUES ($r, $rule, 'v', 'confirmed')",
        [{"r": rid, "rule": rule} for rid in ids],
    )


def _system_blocks() -> list[str]:
    return [f"system-{i}" for i in range(SYSTEM_PROMPT // BLOCK)]


def probe(
    traffic: Traffic,
    account: str,
    *,
    probes: int = 48,
    candidates: int = 8,
    pause_s: float = 0.3,
    cached: bool = True,
    start: datetime = T0,
    full_blocks_only: bool = False,
) -> list[str]:
    """Token-by-token search over another tenant's cached document (the victim's 64 blocks after the system
    prompt): per position, ``candidates`` guesses of the next token, one output token each, each sent right
    after the previous first token came back. ``full_blocks_only``: the guess stays in a partial last block,
    which request_blocks does not hold."""
    ts, ids = start, []
    victim = _system_blocks() + [f"victim-{i}" for i in range(64)]
    for i in range(probes):
        known = i // candidates  # tokens recovered so far
        prompt = len(victim) * BLOCK + known + 1
        ids.append(
            traffic.send(
                account,
                ts,
                prompt,
                1,
                len(victim) * BLOCK if cached else None,
                blocks=victim if full_blocks_only else victim + [f"{account}-guess-{i}"],
            )
        )
        ts += timedelta(seconds=pause_s)
    return ids


def harness(
    traffic: Traffic, account: str, *, questions: int = 60, output: tuple[int, int] = (80, 400), seed: int = 1
) -> None:
    """An evaluation harness: the system prompt, one few-shot template, many different questions of
    different lengths, one after the other."""
    rng = random.Random(seed)
    template = _system_blocks() + [f"{account}-template-{i}" for i in range(32)]
    ts = T0
    for q in range(questions):
        length = rng.randint(40, 300)
        question = [f"{account}-q{q}-{i}" for i in range(-(-length // BLOCK))]
        traffic.send(
            account,
            ts,
            len(template) * BLOCK + length,
            rng.randint(*output),
            len(template) * BLOCK,
            blocks=template + question,
        )
        ts += timedelta(seconds=rng.uniform(0.5, 2.0))


def retries(traffic: Traffic, account: str, *, requests: int = 12) -> None:
    """A client that repeats each identical request after 503s until it gets an answer."""
    ts = T0
    for r in range(requests):
        blocks = _system_blocks() + [f"{account}-doc{r}-{i}" for i in range(20)]
        for attempt in range(3):
            status = 503 if attempt < 2 else 200
            traffic.send(
                account,
                ts,
                len(blocks) * BLOCK,
                250,
                SYSTEM_PROMPT if attempt == 0 else len(blocks) * BLOCK,
                status=status,
                blocks=blocks,
            )
            ts += timedelta(seconds=2**attempt)
        ts += timedelta(minutes=5)


def chat(traffic: Traffic, account: str, *, turns: int = 30, seed: int = 2) -> None:
    """A chat client: every turn resends the whole conversation so far plus the new message."""
    rng = random.Random(seed)
    blocks, ts = _system_blocks(), T0
    for t in range(turns):
        cached = len(blocks) * BLOCK
        blocks = blocks + [f"{account}-turn{t}-{i}" for i in range(rng.randint(3, 20))]
        traffic.send(account, ts, len(blocks) * BLOCK, rng.randint(60, 500), cached, blocks=blocks)
        ts += timedelta(seconds=rng.uniform(20, 90))


def load_test(traffic: Traffic, account: str, *, requests: int = 200) -> None:
    """The provider's load test: the same prompt again and again, one output token, back to back."""
    blocks = _system_blocks() + [f"{account}-fixed-{i}" for i in range(100)]
    ts = T0
    for _ in range(requests):
        traffic.send(account, ts, len(blocks) * BLOCK, 1, len(blocks) * BLOCK, blocks=blocks)
        ts += timedelta(milliseconds=150)


def tiers(frame: pd.DataFrame) -> dict[str, str]:
    return dict(zip(frame["account_id"], frame["probing"], strict=True))


def row(frame: pd.DataFrame, account: str) -> pd.Series:
    return frame.set_index("account_id").loc[account]


# --- the prober ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_blocks", [True, False], ids=["prefix blocks", "prompt lengths only"])
def test_prober_among_look_alikes_is_the_only_likely_account(with_blocks):
    traffic = Traffic()
    ids = probe(traffic, "acct-prober")
    harness(traffic, "acct-eval")
    harness(traffic, "acct-mmlu", output=(1, 1), seed=3)  # multiple choice: one output token per question
    retries(traffic, "acct-retry")
    chat(traffic, "acct-chat")
    load_test(traffic, "acct-load")
    con = traffic.database(with_blocks=with_blocks)
    assert set(tiers(probing_assessment(con)).values()) == {"no"}  # the shape of traffic alone is no probing
    flag(con, ids)  # the probes were served another tenant's cached document
    frame = probing_assessment(con)
    assert {a: t for a, t in tiers(frame).items() if t != "no"} == {"acct-prober": "likely"}
    prober = row(frame, "acct-prober")
    assert prober["continuation_basis"] == ("prefix blocks" if with_blocks else "prompt lengths")
    assert prober["short_requests"] == 48 and prober["short_share"] == 1.0
    assert prober["cached_prefix_share"] == 1.0 and prober["read_back_share"] == 1.0
    if with_blocks:
        assert prober["max_continuations"] == 48
        assert "48 different last blocks after one common prefix" in prober["why"]
    else:
        assert prober["prompt_lengths"] == 6 and prober["small_step_share"] == 1.0
        assert "6 prompt lengths, 100% of consecutive ones within 4 tokens" in prober["why"]
    assert prober["why"].startswith("48 of 48 requests answered with at most 4 output tokens")


def test_guesses_inside_a_partial_block_show_in_the_prompt_lengths():
    traffic = Traffic()
    ids = probe(traffic, "acct-prober", full_blocks_only=True)
    con = traffic.database()
    flag(con, ids)
    prober = row(probing_assessment(con), "acct-prober")
    assert (prober["continuation_basis"], prober["max_continuations"]) == ("prefix blocks", 1)
    assert (prober["varied"], prober["probing"]) == (True, "likely")
    assert "6 prompt lengths, 100% of consecutive ones within 4 tokens" in prober["why"]


def test_each_signal_of_the_prober_is_measured():
    traffic = Traffic()
    probe(traffic, "acct-prober", probes=40, candidates=4)
    prober = row(probing_assessment(traffic.database()), "acct-prober")
    assert (
        prober["many_short"],
        prober["long_prefix"],
        prober["varied"],
        prober["read_back"],
        prober["foreign_prefixes"],
        prober["signals"],
    ) == (True, True, True, True, False, 4)
    assert prober["prompt_lengths"] == 10


def test_a_slow_prober_without_timing_read_back_is_possible():
    traffic = Traffic()
    ids = probe(traffic, "acct-slow", pause_s=600)  # a guess every ten minutes: no read-back pattern
    con = traffic.database()
    flag(con, ids)
    prober = row(probing_assessment(con), "acct-slow")
    assert prober["read_back"] == False and prober["probing"] == "possible"  # noqa: E712


def test_cross_tenant_hits_count_and_complete_the_picture_without_cached_tokens():
    traffic = Traffic()
    ids = probe(traffic, "acct-prober", cached=False)  # the gateway did not log cached_tokens
    probe(traffic, "acct-own", cached=False)  # hits on its own prefixes only
    con = traffic.database()
    con.execute(
        "CREATE TABLE prefix_sources (request_id VARCHAR, source_request_id VARCHAR, source_account VARCHAR, "
        "position_from INTEGER, position_to INTEGER, basis VARCHAR)"
    )
    sources = pd.DataFrame(  # noqa: F841 (read by DuckDB)
        {
            "request_id": ids[:10],
            "source_request_id": "victim-req",
            "source_account": ["acct-victim"] * 6 + ["acct-other"] * 4,
            "position_from": 0,
            "position_to": 127,
            "basis": "request_blocks",
        }
    )
    own = pd.DataFrame(  # noqa: F841 (read by DuckDB)
        {
            "request_id": [r["request_id"] for r in traffic.requests if r["account_id"] == "acct-own"][:5],
            "source_request_id": "x",
            "source_account": "acct-own",
            "position_from": 0,
            "position_to": 10,
            "basis": "request_blocks",
        }
    )
    con.execute("INSERT INTO prefix_sources SELECT * FROM sources UNION ALL SELECT * FROM own")
    frame = probing_assessment(con)
    prober, own_row = row(frame, "acct-prober"), row(frame, "acct-own")
    assert (prober["cross_tenant_hits"], prober["source_accounts"], prober["long_prefix"]) == (10, 2, False)
    assert prober["probing"] == "possible"
    assert "10 short requests reused prefixes stored by other tenants" in prober["why"]
    assert (own_row["cross_tenant_hits"], own_row["foreign_prefixes"]) == (0, False)


def test_findings_of_the_prefix_reuse_rules_are_cross_tenant_hits():
    rules = [r.id for r in load_rules() if r.mechanism == "prefix_reuse"]
    if not rules:
        pytest.skip("no prefix_reuse rule in this tree yet")
    traffic = Traffic()
    ids = probe(traffic, "acct-prober")
    con = traffic.database()
    con.executemany(
        "INSERT INTO findings (request_id, rule_id, rule_version, confidence) VALUES ($r, $rule, 'v', 'confirmed')",
        [{"r": rid, "rule": rules[0]} for rid in ids[:3]],
    )
    con.execute(
        "INSERT INTO findings (request_id, rule_id, rule_version, confidence) "
        "VALUES ($r, 'prompt_exceeds_kv_pool', 'v', 'confirmed')",
        {"r": ids[5]},
    )  # another mechanism's finding is no prefix hit
    assert row(probing_assessment(con), "acct-prober")["cross_tenant_hits"] == 3


# --- the benign look-alikes -----------------------------------------------------------------------------


def test_look_alikes_alone_are_no_probing_and_say_why():
    traffic = Traffic()
    harness(traffic, "acct-mmlu", output=(1, 1), seed=3)
    load_test(traffic, "acct-load")
    frame = probing_assessment(traffic.database())
    mmlu, load = row(frame, "acct-mmlu"), row(frame, "acct-load")
    # short answers over a shared template, read back at once: but no continuation varied over one prefix
    assert (mmlu["many_short"], mmlu["long_prefix"], mmlu["varied"], mmlu["probing"]) == (True, True, False, "no")
    assert mmlu["max_continuations"] <= 2
    # the same prompt back to back: one continuation only
    assert (load["many_short"], load["varied"], load["max_continuations"], load["probing"]) == (True, False, 1, "no")
    assert load["why"].endswith(
        "of the prompt; but no continuations varied over one common prefix; "
        "100% sent after the previous first token and within 30 s of it; "
        "but no short request reused another tenant's prefix"
    )


def test_harness_with_short_answers_is_no_probing_from_prompt_lengths_alone():
    traffic = Traffic()
    harness(traffic, "acct-mmlu", output=(1, 1), seed=3)
    mmlu = row(probing_assessment(traffic.database(with_blocks=False)), "acct-mmlu")
    assert mmlu["small_step_share"] < 0.2 and mmlu["probing"] == "no"


def test_accounts_with_long_answers_only_are_not_listed():
    traffic = Traffic()
    harness(traffic, "acct-eval")
    chat(traffic, "acct-chat")
    retries(traffic, "acct-retry")
    assert probing_assessment(traffic.database()).empty


def test_internal_load_test_keeps_its_class():
    traffic = Traffic()
    load_test(traffic, "loadtest-7")
    con = traffic.database()
    con.execute("CREATE TABLE account_classes AS SELECT 'loadtest-7' AS account_id, 'internal' AS account_class")
    load = row(probing_assessment(con), "loadtest-7")
    assert (load["account_class"], load["probing"]) == ("internal", "no")


def test_no_probe_shaped_traffic_gives_an_empty_assessment():
    assert probing_assessment(Traffic().database(with_blocks=False)).empty


# --- parameters ------------------------------------------------------------------------------------------


def test_parameters_change_the_tier():
    traffic = Traffic()
    ids = probe(traffic, "acct-prober")
    con = traffic.database()
    flag(con, ids)
    assert row(probing_assessment(con, {"probe_min_foreign_hits": 49}), "acct-prober")["probing"] == "no"
    assert row(probing_assessment(con, {"probe_min_requests": 49}), "acct-prober")["probing"] == "no"
    assert row(probing_assessment(con, {"probe_min_continuations": 49}), "acct-prober")["probing"] == "possible"
    assert row(probing_assessment(con), "acct-prober")["probing"] == "likely"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"probe_max_tokens": 4},
            "unknown probing parameter 'probe_max_tokens' (did you mean 'probe_max_output_tokens'?); "
            "known: probe_max_output_tokens, probe_min_requests",
        ),
        ({"tokens": 4}, "unknown probing parameter 'tokens'; known: probe_max_output_tokens"),
        ({"probe_min_requests": 2.5}, "probing parameter probe_min_requests must be a whole number >= 0, got 2.5"),
        ({"probe_min_short_share": -1}, "probing parameter probe_min_short_share must be a number >= 0, got -1"),
        ({"probe_min_cached_share": 2}, "probing parameter probe_min_cached_share is a share between 0 and 1, got 2"),
        ({"probe_max_gap_seconds": True}, "probing parameter probe_max_gap_seconds must be a whole number >= 0"),
        ({"probe_min_requests": "20"}, "probing parameter probe_min_requests must be a whole number >= 0, got '20'"),
    ],
)
def test_bad_parameters_are_refused(overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        probing_parameters(overrides)


def test_defaults_are_every_parameter_the_script_uses():
    from kvforensics.core.db import sql
    from kvforensics.engines.portable import used_parameters

    assert used_parameters(sql("prefix_probing")) == set(PROBING_PARAMETERS)


# --- wiring ---------------------------------------------------------------------------------------------


def _mechanisms(con: duckdb.DuckDBPyConnection, **selected: bool) -> None:
    con.execute(
        "CREATE TABLE IF NOT EXISTS mechanisms (id VARCHAR, title VARCHAR, named BOOLEAN, selected BOOLEAN, "
        "missing_inputs VARCHAR[])"
    )
    for mechanism, chosen in selected.items():
        con.execute(
            "INSERT INTO mechanisms BY NAME SELECT $m AS id, $m AS title, false AS named, $s AS selected, "
            "CAST([] AS VARCHAR[]) AS missing_inputs",
            {"m": mechanism, "s": chosen},
        )


def test_probing_runs_only_for_the_prefix_reuse_mechanism():
    con = Traffic().database(with_blocks=False)
    assert not probing_selected(con)
    _mechanisms(con, stale_pages=True, prefix_reuse=False)
    assert not probing_selected(con)
    con.execute("UPDATE mechanisms SET selected = true WHERE id = 'prefix_reuse'")
    assert probing_selected(con)


def test_summary_names_the_likely_customers_and_sets_internal_accounts_apart():
    traffic = Traffic()
    ids = probe(traffic, "acct-prober")
    ids += probe(traffic, "loadtest-probe", start=T0 + timedelta(hours=1))  # the provider's own red team
    ids += probe(traffic, "acct-slow", pause_s=600, start=T0 + timedelta(hours=2))
    harness(traffic, "acct-mmlu", output=(1, 1), seed=3)
    con = traffic.database()
    flag(con, ids)
    assert probing_summary(con) is None
    con.execute(
        "CREATE TABLE account_classes AS SELECT DISTINCT account_id, "
        "CASE WHEN account_id LIKE 'loadtest-%' THEN 'internal' ELSE 'customer' END AS account_class "
        "FROM requests"
    )
    probing_assessment(con)
    summary = probing_summary(con)
    assert summary is not None
    assert [(a["account_id"], a["account_class"], a["probing"]) for a in summary["accounts"]] == [
        ("acct-prober", "customer", "likely"),
        ("loadtest-probe", "internal", "likely"),
        ("acct-slow", "customer", "possible"),
    ]
    assert summary["likely_customers"] == ["acct-prober"]
    assert summary["accounts"][0]["why"].startswith("48 of 48 requests")


def test_a_growing_prefix_on_other_tenants_content_is_probing_and_autocomplete_is_not():
    """The documented pattern (PromptPeek; arXiv 2409.20002): candidates differing in a few tokens of one
    block, one-token answers, the known prefix growing by a block after each hit. Autocomplete grows its
    own context the same way, with short answers too, but never on another tenant's content."""
    traffic = Traffic()
    ids, ts, prefix = [], T0, 2048
    for _step in range(6):  # six blocks recovered, four candidates each
        for _c in range(4):
            ids.append(traffic.send("acct-grow", ts, prefix + BLOCK, 1, prefix))
            ts += timedelta(seconds=0.4)
        prefix += BLOCK
    ts, context = T0, 200
    for _ in range(40):  # a user typing: its own context grows, a few tokens suggested
        traffic.send("acct-autocomplete", ts, context, 3, context - 6)
        context += 7
        ts += timedelta(seconds=2)
    con = traffic.database(with_blocks=False)
    flag(con, ids[4:])  # from the second block on, the probes hit the victim's pages
    frame = probing_assessment(con, {"probe_min_requests": 20})
    grow, auto = row(frame, "acct-grow"), row(frame, "acct-autocomplete")
    assert (grow["growing"], grow["rises"], grow["probing"]) == (True, 5, "likely")
    assert "the prompt grew 5 times by more than 4 tokens" in grow["why"]
    assert (auto["growing"], auto["foreign_prefixes"], auto["probing"]) == (True, False, "no")
