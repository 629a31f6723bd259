"""Winnowing's effect on the confirmed sources (issue 30): the sample and generated incidents, each
ingested once per winnowing window, scoped with 1 and 3 fingerprints in common, against every shingle
with 3 in common (the scope before winnowing).

    python benchmarks/winnowing.py [--windows 1,3,5,6,8] [--incidents sample,1:20000,2:20000,3:50000]
                                   [--workdir /tmp/kvf-winnowing] [--out benchmarks/results/<date>-winnowing.json]

An incident is ``sample`` (data/sample) or ``SEED:REQUESTS`` (``kvforensics simulate``). For every window and
count: the fingerprints kept, the affected responses, recipients, confirmed and possible source accounts, the
(affected response, source request) pairs confirmed, and the pairs and accounts lost or gained against the
baseline. For each lost pair, the longest run of words the affected output shares with the source's prompt or
output, read from the content file (numbers only; no text is written): the guarantee says it is shorter than
``window + 7`` words when one fingerprint confirms.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
BASELINE = (1, 3)  # every shingle, 3 in common: the scope before winnowing


def incident_copy(src: Path, dst: Path, window: int) -> Path:
    """The incident's folder as symbolic links, with an incident file setting ``winnow_window``."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for child in src.parent.iterdir():
        if child != src and child.name != "ground_truth.json":
            (dst / child.name).symlink_to(child.resolve())
    text = src.read_text(encoding="utf-8")
    lines = f"winnow_window = {window}\nallow_outside = true"
    text = (
        text.replace("[settings]", f"[settings]\n{lines}", 1)
        if "[settings]" in text
        else f"{text}\n[settings]\n{lines}\n"
    )
    (dst / "incident.toml").write_text(text, encoding="utf-8")
    return dst / "incident.toml"


def answers(incident_toml: Path, out: Path, counts: list[int]) -> dict[int, dict[str, Any]]:
    """Ingest and detect once, then scope once per count of fingerprints in common."""
    from kvforensics.investigation import Investigation
    from kvforensics.stages.scope import scope

    inv = Investigation.open(incident_toml, out, progress=False, pdf=False)
    try:
        inv.ingest()
        inv.detect()
        fps = inv.con.execute("SELECT count(*) FROM content_fingerprints").fetchone()[0]
        found = {}
        for m in counts:
            result = scope(inv.con, inv.incident, {"min_matching_shingles": m})

            def accounts(role: str) -> list[str]:
                return [
                    r[0]
                    for r in inv.con.execute(
                        "SELECT DISTINCT account_id FROM notifications WHERE role = $r ORDER BY 1", {"r": role}
                    ).fetchall()
                ]

            found[m] = {
                "fingerprints": fps,
                "affected": result.summary["affected_responses"],
                "recipients": result.summary["affected_accounts"],
                "confirmed": accounts("data_exposed_confirmed"),
                "possible": accounts("data_exposed_possible"),
                "pairs": [
                    list(p)
                    for p in inv.con.execute(
                        "SELECT DISTINCT affected_request_id, source_request_id FROM content_matches "
                        "WHERE confirmed AND basis = 'output_shingles' ORDER BY 1, 2"
                    ).fetchall()
                ],
            }
        return found
    finally:
        inv.close()


def words_of(data: Path) -> dict[str, tuple[list[str], ...]]:
    """Each content record's prompt and output as lower-cased words (held in memory, never written)."""
    out = {}
    for path in sorted((data / "content").glob("*.jsonl*")):
        with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8") as fh:
            for line in fh:
                r = json.loads(line)
                out[r["request_id"]] = tuple(re.findall(r"\w+", (r.get(p) or "").lower()) for p in ("prompt", "output"))
    return out


def longest_run(a: list[str], b: list[str]) -> int:
    """The longest run of consecutive words *a* and *b* share."""
    best, prev = 0, [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            if x == y:
                cur[j] = prev[j - 1] + 1
                best = max(best, cur[j])
        prev = cur
    return best


def compare(runs: dict[tuple[int, int], dict[str, Any]], words: dict[str, Any]) -> dict[str, Any]:
    base = runs[BASELINE]
    base_pairs = {tuple(p) for p in base["pairs"]}
    out = {}
    for (w, m), r in sorted(runs.items()):
        pairs = {tuple(p) for p in r["pairs"]}
        lost = sorted(base_pairs - pairs)
        lost_runs = sorted({max(longest_run(words[a][1], t) for t in words[s]) for a, s in lost})
        out[f"w{w}-m{m}"] = {
            "winnow_window": w,
            "min_matching_shingles": m,
            "guaranteed_words": m * w + 7,
            "fingerprints": r["fingerprints"],
            "fingerprints_x": round(r["fingerprints"] / base["fingerprints"], 4),
            "affected": r["affected"],
            "recipients": r["recipients"],
            "confirmed_accounts": len(r["confirmed"]),
            "possible_accounts": len(r["possible"]),
            "confirmed_pairs": len(pairs),
            "confirmed_accounts_lost": sorted(set(base["confirmed"]) - set(r["confirmed"])),
            "confirmed_accounts_gained": sorted(set(r["confirmed"]) - set(base["confirmed"])),
            "pairs_lost": len(lost),
            "pairs_gained": len(pairs - base_pairs),
            "lost_pairs_longest_shared_runs": lost_runs,
            "every_loss_below_the_guarantee": all(n < m * w + 7 for n in lost_runs),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", default="1,3,5,6,8")
    p.add_argument("--incidents", default="sample,1:20000,2:20000,3:50000,4:100000,5:200000")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-winnowing"))
    p.add_argument("--out", type=Path, default=BENCH_DIR / "results" / f"{dt.date.today().isoformat()}-winnowing.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from kvforensics.simulate import Scenario, simulate

    windows = sorted({int(w) for w in args.windows.split(",")} | {BASELINE[0]})
    doc: dict[str, Any] = {"baseline": "winnow_window 1 (every shingle), 3 fingerprints in common", "incidents": {}}
    for spec in args.incidents.split(","):
        if spec == "sample":
            data = REPO / "data" / "sample"
        else:
            seed, requests = (int(x) for x in spec.split(":"))
            data = args.workdir / "data" / f"seed{seed}-n{requests}"
            if not (data / "incident.toml").exists():
                simulate(Scenario(seed=seed, requests=requests), data)
        runs: dict[tuple[int, int], dict[str, Any]] = {}
        for w in windows:
            toml = incident_copy(data / "incident.toml", args.workdir / "runs" / spec.replace(":", "-") / f"w{w}", w)
            for m, found in answers(toml, toml.parent / "out", [1, 3]).items():
                runs[(w, m)] = found
        doc["incidents"][spec] = compare(runs, words_of(data))
        print(
            spec,
            {
                k: (v["confirmed_accounts"], v["pairs_lost"], v["every_loss_below_the_guarantee"])
                for k, v in doc["incidents"][spec].items()
            },
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
