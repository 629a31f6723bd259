"""A straightforward pandas implementation of the same detection and scoping, for comparison.

What a responder would write in a notebook without kvforensics: ``pd.read_json(lines=True)`` (or
``pd.read_parquet``) per gateway file, the capacity intervals from the engine logs through our
parser, ``merge_asof`` by instance and time for the pool in force, the oversize predicate of rule
``prompt_exceeds_kv_pool`` (prefill instance, decode instance, else the model's prefill pools), a
simple latency check (2% quantile of TTFT per model and log-bin of uncached tokens as the
envelope), the same confidence tiers, recipients by ``groupby`` of account, and the possible-sources
horizon of ``sql/scope.sql`` per decode instance (a cumulative sum of written tokens and two
``searchsorted`` per affected response). It skips what the pandas version would not bother with:
validation and quarantine, the other engine-event rules, exploitation, notifications, the report.

The engine logs' per-request lines and the content are read as the same notebook would (issue 16):
each engine log as a Series of lines with ``str.extract`` of one regular expression (the one of
``sql/floor_engine_lines.sql``: ReqTimeStats and abort lines, their request id and numbers), and
each content file with ``pd.read_json(lines=True)``, ``str.findall`` of the words and, per record,
the keyed fingerprints ``kvforensics/core/fingerprint.py`` computes (of every ``winnow_window`` consecutive
8-word shingles the one of least keyed MD5, the rightmost of equal ones; its HMAC-SHA256 under the
investigation's key, first 63 bits), kept as one int64 column per file.

On a 200k-request data set it must give the same affected set, recipients and possible-source
pairs as kvforensics (``run.py`` checks that whenever both run).

    python benchmarks/pandas_baseline.py data/incident.toml [--answers out.json]
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from kvforensics.config import Incident, Source, load_incident
from kvforensics.core.fingerprint import SHINGLE_WORDS, fingerprint_key, key_for, shingle_fingerprint
from kvforensics.sources.engine_logs.columnar import EvidenceSink, parse_engine_file_columnar
from kvforensics.sources.engine_logs.parse import parse_engine_log
from kvforensics.stages.ingest import resolve_model

FIELDS = [
    "request_id",
    "ts",
    "account_id",
    "model",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "latency_ms",
    "prefill_instance",
    "decode_instance",
]
CATEGORIES = ["model", "prefill_instance", "decode_instance"]
REJECT_MARGIN = 6  # rule prompt_exceeds_kv_pool: reject_margin
FAST_FRACTION = 0.2  # rule prefill_too_fast: max_fraction
MIN_UNCACHED = 32_768  # rule prefill_too_fast: min_uncached_tokens
ENVELOPE_QUANTILE = 0.02
BINS_PER_DECADE = 5
MIN_BIN_POINTS = 10
HORIZON_FACTOR = 1.5  # scope: horizon_factor
#: One expression per engine-log line, as sql/floor_engine_lines.sql applies it.
ENGINE_LINE = (
    r"^\[(?P<ts>[^\]]+)\] (?:ReqTimeStats\(rid=(?P<rid>[^,]+), bootstrap_room=\d+, "
    r"input_len=(?P<input_len>\d+), cached_input_len=(?P<cached>\d+).*?"
    r"queue_duration=(?P<queue_ms>[\d.]+)ms, forward_duration=(?P<forward_ms>[\d.]+)ms, "
    r"entry_time=(?P<entry>[\d.]+)|Input length \((?P<prompt>\d+) tokens\) exceeds the maximum "
    r"allowed length \((?P<limit>\d+) tokens\).*self\.rid='(?P<abort_rid>[^']+)')"
)
ENGINE_NUMBERS = ["input_len", "cached", "queue_ms", "forward_ms", "entry", "prompt", "limit"]
BATCH_LINES = 500_000  # engine-log lines per str.extract
BATCH_RECORDS = 100_000  # content records per read_json chunk (the words and sets are Python objects)


# --- read ----------------------------------------------------------------------------------------


def read_file(source: Source, path: Path) -> pd.DataFrame:
    wanted = {source.column(f): f for f in FIELDS}
    if source.format == "jsonl":
        df = pd.read_json(path, lines=True, dtype=False)
    elif source.format == "parquet":
        import pyarrow.parquet as pq

        present = set(pq.ParquetFile(path).schema_arrow.names)
        df = pd.read_parquet(path, columns=[c for c in wanted if c in present])
    else:
        raise SystemExit(f"pandas baseline reads jsonl or parquet, not {source.format}")
    df = df[[c for c in wanted if c in df.columns]].rename(columns=wanted)
    for f in FIELDS:
        if f not in df.columns:
            df[f] = None
    df["ts"] = pd.to_datetime(df["ts"], utc=True, format="ISO8601")
    for c in CATEGORIES:
        df[c] = df[c].astype("string").astype("category")
    return df


def read_gateway(source: Source) -> tuple[pd.DataFrame, int]:
    """All gateway files, duplicates dropped (first record wins); and the records read."""
    frames = [read_file(source, p) for p in source.files()]
    rows = sum(len(f) for f in frames)
    out = pd.concat([f.drop(columns=CATEGORIES) for f in frames], ignore_index=True)
    for c in CATEGORIES:
        out[c] = union_categoricals([f[c] for f in frames], ignore_order=True)
    del frames
    out = out.drop_duplicates("request_id", keep="first").reset_index(drop=True)
    return out, rows


def load_capacity(
    incident: Incident, gateway_models: list[str] | None, scratch: duckdb.DuckDBPyConnection | None = None
) -> pd.DataFrame:
    """Start-up intervals per engine instance, from the engine logs through kvforensics' parser: the
    reference parser, or with ``scratch`` (an evidence database to throw away) the column-wise one,
    which inserts the per-request rows there instead of holding them (what a floor's preparation
    needs at 100M requests, where the reference parse of the engine logs outgrows the machine)."""
    rows = []
    for source in incident.sources_of("engine_log"):
        for path in source.files():
            kwargs = dict(
                fmt=source.format,
                instance=source.instance_for(path),
                tz=source.tz,
                year=source.year or incident.year,
                clock_offset_s=source.clock_offset_s,
            )
            parsed = (
                parse_engine_log(path, **kwargs)
                if scratch is None
                else parse_engine_file_columnar(path, **kwargs, con=scratch, sink=EvidenceSink(source.name, str(path)))
            )
            for s in parsed.startups:
                model, _ = resolve_model(s.model, source, dict(incident.model_aliases), gateway_models or [])
                rows.append(
                    {
                        "instance": s.instance,
                        "role": s.role,
                        "model": model,
                        "valid_from": s.ts,
                        "kv_pool_tokens": s.kv_pool_tokens,
                        "context_length": s.context_length,
                        "file": str(path),
                        "line": s.line,
                    }
                )
    cap = pd.DataFrame(
        rows, columns=["instance", "role", "model", "valid_from", "kv_pool_tokens", "context_length", "file", "line"]
    )
    cap["valid_from"] = pd.to_datetime(cap["valid_from"], utc=True)
    cap = cap.sort_values(["instance", "valid_from", "file", "line"], na_position="last").reset_index(drop=True)
    cap["valid_to"] = cap.groupby("instance")["valid_from"].shift(-1)
    for c in ("kv_pool_tokens", "context_length"):
        cap[c] = cap[c].astype("float64")
    return cap.drop(columns=["file", "line"])


def read_engine_lines(incident: Incident) -> tuple[pd.DataFrame, int]:
    """The per-request engine lines (ReqTimeStats, aborts) of every engine log; and the lines read."""
    frames = []
    lines_read = 0
    for source in incident.sources_of("engine_log"):
        for path in source.files():
            with open_text(path) as fh:
                while batch := list(itertools.islice(fh, BATCH_LINES)):
                    lines_read += len(batch)
                    x = pd.Series(batch, dtype=object).str.rstrip("\r\n").str.extract(ENGINE_LINE)
                    x = x[x["rid"].notna() | x["abort_rid"].notna()]
                    stamp = pd.to_datetime(x["ts"].str.replace(r" TP\d+$", "", regex=True), format="%Y-%m-%d %H:%M:%S")
                    frames.append(
                        pd.DataFrame(
                            {
                                "instance": source.instance_for(path),
                                "ts": stamp.dt.tz_localize(source.tz, ambiguous="NaT", nonexistent="NaT"),
                                "kind": np.where(x["rid"].notna(), "req_time_stats", "abort_input_too_long"),
                                "request_id": x["rid"].fillna(x["abort_rid"]),
                                **{c: pd.to_numeric(x[c]) for c in ENGINE_NUMBERS},
                            }
                        )
                    )
    events = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["kind", "request_id"])
    return events, lines_read


def open_text(path: Path):
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def shingle_fingerprints(words: list[str], keyed: bytes, window: int) -> tuple[set[int], int]:
    """core/fingerprint.py's keyed fingerprints of one text's lower-cased words (SHA-256 under the fingerprint
    key *keyed*, winnowing with *window* by the fingerprints), and its number of shingles."""
    if len(words) < SHINGLE_WORDS:
        shingles = [" ".join(words)] if words else []
    else:
        shingles = [" ".join(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)]
    fps = [shingle_fingerprint(s, keyed) for s in shingles]
    if window > 1 and fps:
        span = min(window, len(fps))
        kept = {min(range(i, i + span), key=lambda j: (fps[j], -j)) for i in range(len(fps) - span + 1)}
        return {fps[j] for j in kept}, len(shingles)
    return set(fps), len(shingles)


def content_fingerprints(incident: Incident) -> tuple[list[pd.DataFrame], int, int]:
    """Per content file: (record, part, fingerprint) rows, the record as its row number in the file; the
    records read and the shingles seen."""
    keyed = fingerprint_key(key_for(incident.id))
    out = []
    records = shingles = 0
    for source in incident.sources_of("content"):
        for path in source.files():
            for df in pd.read_json(path, lines=True, dtype=False, chunksize=BATCH_RECORDS):
                records += len(df)
                for code, part in enumerate(("prompt", "output")):
                    if source.column(part) not in df.columns:
                        continue
                    words = df[source.column(part)].dropna().astype(str).str.lower().str.findall(r"\w+")
                    kept = [shingle_fingerprints(w, keyed, incident.winnow_window) for w in words]
                    fps = [f for f, _ in kept]
                    shingles += sum(n for _, n in kept)
                    counts = np.fromiter(map(len, fps), dtype=np.int64, count=len(fps))
                    out.append(
                        pd.DataFrame(
                            {
                                "record": np.repeat(words.index.to_numpy(dtype=np.int64), counts),
                                "part": np.int8(code),
                                "fp": np.fromiter(
                                    itertools.chain.from_iterable(fps), dtype=np.int64, count=int(counts.sum())
                                ),
                            }
                        )
                    )
    return out, records, shingles


def read_sources(incident: Incident, lap: Callable[[str], None]) -> dict[str, Any]:
    """Engine lines and content, timed as the phases ``engine_lines`` and ``content``."""
    events, lines_read = read_engine_lines(incident)
    lap("engine_lines")
    fps, records, shingles = content_fingerprints(incident)
    lap("content")
    aborted = sorted(set(events.loc[events["kind"] == "abort_input_too_long", "request_id"]))
    return {
        "engine_lines_read": lines_read,
        "content_records": records,
        "engine_req_time_stats": int((events["kind"] == "req_time_stats").sum()),
        "engine_aborted_requests": len(aborted),
        "engine_aborted_sha256": hashlib.sha256("\n".join(aborted).encode()).hexdigest(),
        "content_fingerprints": int(sum(len(f) for f in fps)),
        "content_shingles": shingles,
    }


def lap_timer(phases: dict[str, float]) -> Callable[[str], None]:
    """``lap(name)`` records the seconds since the previous lap (or since this call) as ``phases[name]``."""
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = round(now - clock, 3)
        clock = now

    return lap


def sources_only(incident_path: Path, phases: dict[str, float]) -> dict[str, Any]:
    """The engine-lines and content phases alone (the sources stage of run.py)."""
    return read_sources(load_incident(incident_path), lap_timer(phases))


# --- detect --------------------------------------------------------------------------------------


def _limit(pool: pd.Series, context: pd.Series) -> pd.Series:
    return np.minimum(pool, context.fillna(pool))


def _in_force(left: pd.DataFrame, cap: pd.DataFrame, by: str | None) -> pd.DataFrame:
    """The capacity interval in force at each left row's ts (by instance when ``by`` is given)."""
    cap = cap[cap["valid_from"].notna()].sort_values("valid_from")
    left = left.sort_values("ts")
    if by is None:
        m = pd.merge_asof(left, cap, left_on="ts", right_on="valid_from", direction="backward", suffixes=("", "_cap"))
    else:
        left = left.assign(**{by: left[by].astype("str")})
        cap = cap.assign(instance=cap["instance"].astype("str"))
        m = pd.merge_asof(
            left,
            cap,
            left_on="ts",
            right_on="valid_from",
            left_by=by,
            right_by="instance",
            direction="backward",
            suffixes=("", "_cap"),
        )
    ok = m["valid_from"].notna() & (m["valid_to"].isna() | (m["ts"] < m["valid_to"]))
    return m[ok]


def oversize(served: pd.DataFrame, cap: pd.DataFrame) -> pd.DataFrame:
    """Rule prompt_exceeds_kv_pool: request_id, strength, basis (one row per request)."""
    cols = ["request_id", "ts", "model", "prompt_tokens"]
    pools = cap[cap["kv_pool_tokens"].notna()]
    found = []
    for priority, (by, role) in enumerate((("prefill_instance", "prefill"), ("decode_instance", "decode")), 1):
        left = served.loc[served[by].notna(), cols + [by]]
        m = _in_force(left, pools[pools["role"] == role], by)
        m = m[m["prompt_tokens"] >= _limit(m["kv_pool_tokens"], m["context_length"]) - REJECT_MARGIN]
        found.append(
            pd.DataFrame({"request_id": m["request_id"], "strength": "strong", "priority": priority, "basis": by})
        )
    # no prefill instance: the prefill pools serving the model then (smallest decides; weak unless all)
    left = served.loc[served["prefill_instance"].isna(), cols]
    prefill = pools[pools["role"] == "prefill"]
    per_instance = []
    for instance, c in prefill.groupby("instance"):
        sub = left[left["model"].isin(c["model"].dropna().unique())]
        if sub.empty:
            continue
        m = _in_force(sub, c.drop(columns=["instance"]).assign(instance=instance), None)
        per_instance.append(m[m["model"] == m["model_cap"]])
    if per_instance:
        m = pd.concat(per_instance, ignore_index=True)
        m["limit"] = _limit(m["kv_pool_tokens"], m["context_length"])
        largest = m.groupby("request_id")["limit"].max().rename("largest_limit")
        smallest = m.sort_values(["request_id", "kv_pool_tokens", "instance"]).drop_duplicates("request_id")
        smallest = smallest.join(largest, on="request_id")
        smallest = smallest[smallest["prompt_tokens"] >= smallest["limit"] - REJECT_MARGIN]
        every = smallest["prompt_tokens"] >= smallest["largest_limit"] - REJECT_MARGIN
        found.append(
            pd.DataFrame(
                {
                    "request_id": smallest["request_id"],
                    "strength": np.where(every, "strong", "weak"),
                    "priority": 3,
                    "basis": "model",
                }
            )
        )
    out = pd.concat(found, ignore_index=True).sort_values(["request_id", "priority"])
    return out.drop_duplicates("request_id")[["request_id", "strength", "basis"]]


def too_fast(served: pd.DataFrame, exclude: pd.Series) -> pd.DataFrame:
    """A simple prefill_too_fast: observed < 0.2 x the 2% TTFT quantile of the model's token bin."""
    uncached = served["prompt_tokens"] - served["cached_tokens"].fillna(0)
    obs = served[served["ttft_ms"].gt(0) & uncached.gt(0) & ~served["request_id"].isin(exclude)]
    obs_bin = np.floor(np.log10(uncached[obs.index]) * BINS_PER_DECADE)
    env = (
        obs.assign(bin=obs_bin)
        .groupby(["model", "bin"], observed=True)["ttft_ms"]
        .agg(q=lambda s: s.quantile(ENVELOPE_QUANTILE), n="size")
    )
    env = env[env["n"] >= MIN_BIN_POINTS]["q"].rename("envelope_ms").reset_index()
    cand = served[uncached >= MIN_UNCACHED].copy()
    cand["bin"] = np.floor(np.log10(uncached[cand.index]) * BINS_PER_DECADE)
    cand["observed_ms"] = cand["ttft_ms"].fillna(cand["latency_ms"])
    cand = cand.merge(env, on=["model", "bin"], how="inner")
    hit = cand[cand["observed_ms"] < FAST_FRACTION * cand["envelope_ms"]]
    return pd.DataFrame({"request_id": hit["request_id"], "strength": "weak", "basis": "latency"})


def tiers(signals: pd.DataFrame) -> pd.DataFrame:
    g = signals.groupby("request_id").agg(
        strong=("strength", lambda s: int((s == "strong").sum())), rules=("strength", "size")
    )
    g["confidence"] = np.where(
        (g["strong"] >= 1) & (g["rules"] >= 2),
        "confirmed",
        np.where((g["strong"] >= 1) | (g["rules"] >= 2), "probable", "possible"),
    )
    return g.reset_index()


# --- scope ---------------------------------------------------------------------------------------


def account_class(account: str, incident: Incident) -> str:
    for cls, patterns in (
        ("reporter", incident.scope.reporter_accounts),
        ("internal", incident.scope.internal_accounts),
    ):
        if any(fnmatch.fnmatchcase(account, p) for p in sorted(patterns)):
            return cls
    return "customer"


def _us(ms: pd.Series) -> pd.Series:
    return pd.to_timedelta(np.round(ms.to_numpy(dtype="float64") * 1000).astype("int64"), unit="us")


def possible_sources(served: pd.DataFrame, affected_ids: set[str], cap: pd.DataFrame) -> pd.DataFrame:
    """The turnover horizon of sql/scope.sql: per decode instance (else per model), requests freed
    before the affected response's allocation with < horizon_factor x pool tokens written since."""
    w = served[
        [
            "request_id",
            "account_id",
            "model",
            "decode_instance",
            "ts",
            "ttft_ms",
            "latency_ms",
            "prompt_tokens",
            "completion_tokens",
        ]
    ].copy()
    w["is_affected"] = w["request_id"].isin(affected_ids)
    w["instance_known"] = w["decode_instance"].notna()
    w["kv_group"] = w["decode_instance"].astype(object).where(w["instance_known"], "(model) " + w["model"].astype(str))
    w["alloc_ts"] = w["ts"] + _us(w["ttft_ms"].fillna(0))
    w["free_ts"] = w["ts"] + _us(w["latency_ms"].fillna(w["ttft_ms"]).fillna(0))
    completion = w["completion_tokens"].fillna(0)
    w["written"] = np.where(w["is_affected"], 1 + completion, w["prompt_tokens"] + completion).astype("int64")
    common = {
        "kv_group": w["kv_group"],
        "request_id": w["request_id"],
        "account_id": w["account_id"],
        "is_affected": w["is_affected"],
    }
    events = pd.concat(
        [
            pd.DataFrame({**common, "t": w["alloc_ts"], "marker": 0, "w": w["written"]}),
            pd.DataFrame({**common, "t": w["free_ts"], "marker": 1, "w": 0}),
        ],
        ignore_index=True,
    )
    events = events.sort_values(["kv_group", "t", "marker", "request_id"], ignore_index=True)
    events["cum"] = events.groupby("kv_group", sort=False)["w"].cumsum()
    alloc = events[events["marker"] == 0].set_index("request_id")["cum"]
    frees = events[events["marker"] == 1]
    aff = w[w["is_affected"]]
    pairs = []
    for group, a_rows in aff.groupby("kv_group", sort=True):
        f = frees[frees["kv_group"] == group]
        t = f["t"].dt.tz_convert(None).to_numpy()
        cum = f["cum"].to_numpy()
        for a in a_rows.itertuples(index=False):
            valid = cap[(cap["valid_from"] <= a.alloc_ts) & (cap["valid_to"].isna() | (a.alloc_ts < cap["valid_to"]))]
            if a.instance_known:
                pool = valid.loc[valid["instance"] == group, "kv_pool_tokens"].max()
            else:
                pool = valid.loc[(valid["model"] == a.model) & (valid["role"] == "decode"), "kv_pool_tokens"].sum(
                    min_count=1
                )
            horizon = HORIZON_FACTOR * (0.0 if pd.isna(pool) else float(pool))
            cum_before = int(alloc[a.request_id]) - int(a.written)
            hi = np.searchsorted(t, np.datetime64(a.alloc_ts.tz_convert(None)), side="right") if len(t) else 0
            lo = np.searchsorted(cum, cum_before - horizon, side="right")
            s = f.iloc[lo:hi]
            s = s[~s["is_affected"] & (s["request_id"] != a.request_id)]
            pairs.append(
                pd.DataFrame(
                    {
                        "affected_request_id": a.request_id,
                        "recipient_account_id": a.account_id,
                        "source_request_id": s["request_id"].to_numpy(),
                        "source_account_id": s["account_id"].to_numpy(),
                    }
                )
            )
    if not pairs:
        return pd.DataFrame(
            columns=["affected_request_id", "recipient_account_id", "source_request_id", "source_account_id"]
        )
    return pd.concat(pairs, ignore_index=True)


# --- the whole thing -----------------------------------------------------------------------------


def investigate(incident_path: Path, phases: dict[str, float] | None = None) -> dict[str, Any]:
    """Read, detect, scope; returns the answers compared with kvforensics' and the phase timings."""
    phases = {} if phases is None else phases
    lap = lap_timer(phases)
    incident = load_incident(incident_path)
    (source,) = incident.sources_of("requests")
    requests, rows_read = read_gateway(source)
    lap("read")
    cap = load_capacity(incident, [str(m) for m in requests["model"].cat.categories])
    lap("capacity")
    other_sources = read_sources(incident, lap)
    served = requests[requests["status"].between(200, 299)]
    found = oversize(served, cap)
    fast = too_fast(served, found["request_id"])
    t = tiers(pd.concat([found, fast], ignore_index=True))
    lap("detect")
    analysed = requests
    if incident.scope.start is not None:
        analysed = analysed[analysed["ts"] >= pd.Timestamp(incident.scope.start)]
    if incident.scope.end is not None:
        analysed = analysed[analysed["ts"] < pd.Timestamp(incident.scope.end)]
    affected = t[t["confidence"].isin(["confirmed", "probable"])].merge(
        analysed[["request_id", "account_id"]], on="request_id"
    )
    recipients = affected.groupby("account_id").size()
    classes = {a: account_class(a, incident) for a in recipients.index}
    by_class = affected["account_id"].map(classes).value_counts().sort_index()
    sources = possible_sources(served, set(affected["request_id"]), cap)
    lap("scope")
    digest = hashlib.sha256()
    for a, s in sorted(zip(sources["affected_request_id"], sources["source_request_id"], strict=True)):
        digest.update(f"{a}|{s}\n".encode())
    return {
        "rows_read": rows_read,
        "requests": len(requests),
        "affected": sorted(affected["request_id"]),
        "affected_responses": len(affected),
        "recipients": {str(k): int(v) for k, v in recipients.sort_index().items()},
        "by_class": {str(k): int(v) for k, v in by_class.items()},
        "possible_source_pairs": len(sources),
        "possible_source_pairs_sha256": digest.hexdigest(),
        "possible_source_accounts": int(sources["source_account_id"].nunique()),
        **other_sources,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("incident", type=Path)
    p.add_argument("--answers", type=Path, help="write the answers as JSON here")
    args = p.parse_args(argv)
    phases: dict[str, float] = {}
    answers = investigate(args.incident, phases)
    if args.answers:
        args.answers.write_text(json.dumps(answers, indent=1) + "\n", encoding="utf-8")
    print(
        json.dumps(
            {"phases": phases, **{k: v for k, v in answers.items() if k not in ("affected", "recipients")}}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
