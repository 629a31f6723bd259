"""Per-account notices: one Markdown file per account with only that account's facts."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import duckdb
import pandas as pd

from kvforensics.config import Incident
from kvforensics.report.templating import template_env

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_filename(account_id: str) -> str:
    """A file name for an account id: untrusted text never becomes a path."""
    cleaned = _SAFE.sub("_", account_id).strip("._")[:60] or "account"
    return f"{cleaned}-{hashlib.sha256(account_id.encode()).hexdigest()[:8]}.md"


def notice_rows(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    return con.execute("SELECT account_id, account_class, role, responses, first_ts, last_ts, request_ids "
                       "FROM notifications ORDER BY account_class, account_id, role").df()


def write_notices(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> list[Path]:
    """One Markdown notice per account with only that account's facts; internal/reporter kept apart."""
    env = template_env(False)
    template = env.get_template("notice.md.j2")
    rows = notice_rows(con)
    conclusive = not con.execute("SELECT count(*) FROM inconclusive_reasons").fetchall()[0][0]
    # every account's received responses in one query (not one per account), grouped here
    received_by_account: dict[object, list[dict]] = {}
    for rec in con.execute("""SELECT account_id, request_id, ts, model, prompt_tokens, confidence
                              FROM affected_responses ORDER BY account_id, ts, request_id""").df().to_dict("records"):
        received_by_account.setdefault(rec.pop("account_id"), []).append(rec)
    roles_by_account: dict[object, list[dict]] = {}
    for rec in rows.to_dict("records"):
        roles_by_account.setdefault(rec["account_id"], []).append(rec)
    written = []
    for account_id in sorted(roles_by_account):
        roles = roles_by_account[account_id]
        cls = str(roles[0]["account_class"])
        folder = out_dir / "notices" / ("customers" if cls == "customer" else cls)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / safe_filename(str(account_id))
        path.write_text(template.render(incident=incident, conclusive=conclusive, account_id=account_id, account_class=cls,
                                        roles=roles, received=received_by_account.get(account_id, [])),
                        encoding="utf-8")
        written.append(path)
    return written
