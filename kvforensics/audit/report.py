"""The result of one audit: its verdicts, the exposure windows, the answer for now and the exit code.

A deployment is exposed by either mechanism the audit checks: a start-up that serves prompts beyond its KV
pool (check 1, the stale-pages exposure windows) or one whose prefix cache is shared across tenants (a
check-6 fail: no salt, a salt the client sets, an engine or store that drops it, a forgeable block hash).
:attr:`AuditReport.exit_code` is 1 when anything is exposed in the audited period (now or before), 0
when clean (unknowns alone do not fail; they are listed) and 2 when nothing could be audited;
:attr:`AuditReport.exit_code_now` is 1 only while an exposed start-up is still in force.
:meth:`AuditReport.now` and :attr:`AuditReport.exposed_now` answer for the start-ups still in force.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kvforensics.audit.model import CHECKS, STATUSES, ExposureWindow, Verdict
from kvforensics.audit.phrases import iso
from kvforensics.audit.render import html_fragment, markdown, stdout_console, terminal

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import Console

END_SUMMARY = {"shutdown": "shut down", "next_startup": "restarted", "log_end": "replaced by a successor"}
MAX_FAILING_SHOWN = 20  # failing verdicts a notebook shows under the counts


@dataclass
class AuditReport:
    """All verdicts of one audit, with the notes a reader needs (parser warnings, assumptions)."""

    verdicts: list[Verdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)

    @property
    def exposed(self) -> bool:
        """Exposed in the audited period: a check-1 exposure or a prefix cache shared across tenants."""
        return any(v.exposed for v in self.verdicts)

    @property
    def exposed_now(self) -> bool:
        """Exposed by a start-up still in force (not shut down, restarted or retired)."""
        return any(w.in_force for w in self.exposure_windows) or any(v.in_force for v in self.shared_caches)

    @property
    def shared_caches(self) -> list[Verdict]:
        """The check-6 fails: start-ups whose prefix cache one tenant's request can read another's KV from."""
        return [v for v in self.verdicts if v.check == 6 and v.exposed]

    @property
    def exit_code(self) -> int:
        """1 exposed in the audited period (now or before), 0 clean (unknowns alone do not fail), 2
        nothing could be audited."""
        if not self.verdicts:
            return 2
        return 1 if self.exposed else 0

    @property
    def exit_code_now(self) -> int:
        """As :attr:`exit_code`, but 1 only while an exposed start-up is still in force (a deploy gate:
        a start-up that shut down, restarted or was retired no longer fails it)."""
        if not self.verdicts:
            return 2
        return 1 if self.exposed_now else 0

    @property
    def startups(self) -> int:
        return len({(v.instance, v.startup_file, v.startup_line, v.startup_from) for v in self.verdicts})

    def by_status(self, status: str) -> list[Verdict]:
        return [v for v in self.verdicts if v.status == status]

    @property
    def exposure_windows(self) -> list[ExposureWindow]:
        return [
            ExposureWindow(
                v.instance,
                v.role,
                v.model,
                v.startup_from,
                v.startup_to,
                v.detail,
                v.evidence_file,
                v.evidence_line,
                v.end_reason,
                v.end_file,
                v.end_line,
                v.successor,
                v.in_force,
            )
            for v in self.verdicts
            if v.exposed and v.check == 1
        ]

    def summary(self) -> dict[str, Any]:
        counts = {s: len(self.by_status(s)) for s in STATUSES}
        return {
            "exposed": self.exposed,
            "exit_code": self.exit_code,
            "startups": self.startups,
            "instances": len({v.instance for v in self.verdicts}),
            "exposed_startups": len(self.exposure_windows),
            "shared_cache_startups": len(self.shared_caches),
            "verdicts": counts,
        }

    # -- presenters -------------------------------------------------------------------------

    def to_records(self) -> list[dict[str, Any]]:
        return [asdict(v) for v in self.verdicts]

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd

        frame = pd.DataFrame(self.to_records(), columns=[f.name for f in fields(Verdict)])
        for col in ("startup_from", "startup_to"):
            frame[col] = pd.to_datetime(frame[col], utc=True)
        frame["evidence_line"] = frame["evidence_line"].astype("Int64")
        return frame

    def to_json(self, indent: int | None = 2) -> str:
        doc = {
            "summary": self.summary(),
            "checks": {str(k): v for k, v in CHECKS.items()},
            "verdicts": [
                {k: iso(v) if isinstance(v, datetime) else v for k, v in r.items()} for r in self.to_records()
            ],
            "exposure_windows": [
                {k: iso(v) if isinstance(v, datetime) else v for k, v in asdict(w).items()}
                for w in self.exposure_windows
            ],
            "now": {
                "exposed": self.exposed_now,
                "exposed_startups": sum(w.in_force for w in self.exposure_windows),
                "shared_cache_startups": sum(v.in_force for v in self.shared_caches),
                "answer": self.now(),
            },
            "notes": self.notes,
            "inputs": self.inputs,
        }
        return json.dumps(doc, indent=indent, ensure_ascii=False)

    def headline(self) -> str:
        s = self.summary()
        if self.exit_code == 2:
            return "Nothing audited: no engine start-up found in the inputs."
        c = s["verdicts"]
        found = []
        if s["exposed_startups"]:
            found.append(f"{s['exposed_startups']} start-up(s) serve prompts beyond their KV pool")
        if s["shared_cache_startups"]:
            found.append(f"prefix-cache isolation fails on {s['shared_cache_startups']} start-up(s) (check 6)")
        state = "EXPOSED: " + "; ".join(found) if found else "Not exposed"
        # the counts are of verdicts, one per check and start-up: said so, or "34 fail" reads as 34 failures
        checks = len({v.check for v in self.verdicts})
        return (
            f"{state}. {s['startups']} start-up(s) of {s['instances']} instance(s) x {checks} checks = "
            f"{len(self.verdicts)} verdicts: {c['pass']} pass, {c['fail']} fail, {c['unknown']} unknown (the "
            f"evidence cannot tell), {c['not_applicable']} not applicable."
        )

    def now(self) -> str:
        """Is any deployment exposed now? Only exposed start-ups still in force count: beyond their KV pool
        (check 1) or sharing their prefix cache across tenants (check 6)."""
        windows = self.exposure_windows
        live = sorted({w.instance for w in windows if w.in_force})
        shared = self.shared_caches
        shared_live = sorted({v.instance for v in shared if v.in_force})
        found = []
        if live:
            found.append(
                f"{sum(w.in_force for w in windows)} start-up(s) still in force serve prompts beyond their KV pool "
                f"({', '.join(live)})"
            )
        if shared_live:
            found.append(
                f"{sum(v.in_force for v in shared)} start-up(s) still in force share their prefix cache across "
                f"tenants (check 6: {', '.join(shared_live)})"
            )
        if found:
            return "EXPOSED NOW: " + "; ".join(found) + "."
        ends = {(w.instance, w.start): w.end_reason for w in windows}
        ends.update({(v.instance, v.startup_from): v.end_reason for v in shared})
        ended: dict[str, int] = {}
        for reason in ends.values():
            how = END_SUMMARY.get(reason or "", "ended")
            ended[how] = ended.get(how, 0) + 1
        if not ended:
            return "Not exposed now: no start-up serves prompts beyond its KV pool" + (
                "." if not any(v.check == 6 for v in self.verdicts) else self._isolation_tail()
            )
        how_ended = ", ".join(f"{n} {how}" for how, n in ended.items())
        return f"Not exposed now: every exposed start-up has ended ({how_ended})."

    def _isolation_tail(self) -> str:
        """What check 6 says when it fails nowhere: passed everywhere, or how many start-ups it could not judge."""
        unknown = sum(1 for v in self.verdicts if v.check == 6 and v.status == "unknown")
        if unknown:
            return f"; prefix-cache isolation is unknown on {unknown} start-up(s) (check 6)."
        return " or shares its prefix cache across tenants."

    def to_markdown(self) -> str:
        return markdown(self.verdicts, **self._page())

    def to_html(self) -> str:
        """Every verdict as one HTML fragment (the report's audit table)."""
        return html_fragment(self.verdicts, **self._page())

    def _repr_html_(self) -> str:
        """What a notebook shows: the headline, the answer for now, the verdicts counted per check and status, and
        only the verdicts that fail (every verdict: ``to_html()``, ``to_frame()``). The full table of a deployment
        of a few dozen start-ups is over 100,000 characters."""
        import html

        failing = [v for v in self.verdicts if v.status == "fail"]
        counts = "".join(
            f"<tr><td>{check}. {html.escape(name)}</td>"
            + "".join(
                f"<td>{sum(1 for v in self.verdicts if v.check == check and v.status == s)}</td>" for s in STATUSES
            )
            + "</tr>"
            for check, name in CHECKS.items()
            if any(v.check == check for v in self.verdicts)
        )
        head = "".join(f"<th>{s.replace('_', ' ')}</th>" for s in STATUSES)
        table = (
            f"<table><thead><tr><th>check</th>{head}</tr></thead><tbody>{counts}</tbody></table>"
            if self.verdicts
            else ""
        )
        shown = failing[:MAX_FAILING_SHOWN]
        rest = (
            f"<p><i>{len(failing) - len(shown):,} more failing verdicts; <code>to_frame()</code> holds every "
            f"verdict.</i></p>"
            if len(failing) > len(shown)
            else "<p><i><code>to_frame()</code> holds every verdict, <code>to_html()</code> shows them all.</i></p>"
        )
        fails = html_fragment(shown, headline="Failing verdicts", now=None, notes=()) if shown else ""
        page = self._page()
        now = f"<p><b>{html.escape(page['now'])}</b></p>" if page["now"] else ""
        return f"<p><b>{html.escape(page['headline'])}</b></p>{now}{table}{fails}{rest}"

    def __repr__(self) -> str:
        return f"AuditReport({self.headline()})"

    def render_terminal(self, console: Console | None = None) -> None:
        """Print the table on *console*; by default on standard output, as wide as its content when
        that is a file or a pipe (a terminal wraps it to the window)."""
        if console is None:
            console = stdout_console(self.verdicts)
        terminal(console, self.verdicts, **self._page(), exposed=self.exposed, exposed_now=self.exposed_now)

    def _page(self) -> dict[str, Any]:
        return {"headline": self.headline(), "now": self.now() if self.verdicts else None, "notes": self.notes}
