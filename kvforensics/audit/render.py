"""Presenters of an audit: the verdict table as Markdown, HTML and a Rich table, and its pieces.

They format what :class:`~kvforensics.audit.report.AuditReport` hands them (the verdicts, the headline,
the answer to "exposed now?" and the notes); they decide nothing. Untrusted text (model names, log
lines) is escaped for Markdown and HTML and printed as plain text, never as Rich markup.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kvforensics.audit.model import Verdict
from kvforensics.audit.phrases import loc, short_ts
from kvforensics.core.escaping import markdown_text, visible_controls

STATUS_LABEL = {"pass": "pass", "fail": "FAIL", "unknown": "unknown", "not_applicable": "n/a"}
TABLE_HEAD = ("Instance", "Role", "Model", "Start-up (UTC)", "Check", "Status", "Detail", "Evidence", "Ended")


def interval(v: Verdict) -> str:
    end = "running" if v.in_force else short_ts(v.startup_to)
    return f"{short_ts(v.startup_from)} \u2192 {end}"


def ended(v: Verdict) -> str:
    """How the start-up ended, with the line that shows it."""
    if v.in_force:
        return "in force: the log shows no end"
    at = f" ({loc(v.end_file, v.end_line)})" if v.end_file is not None else ""
    if v.end_reason == "next_startup":
        return f"next start-up{at}"
    if v.end_reason == "shutdown":
        return f"shut down{at}"
    if v.end_reason == "log_end":
        return f"retired: its log ends{at} and '{v.successor}' took over"
    return "ended (the evidence database does not say how)"


def evidence(v: Verdict) -> str:
    if v.evidence_file is None:
        return ""
    name = Path(v.evidence_file).name
    return f"{name}:{v.evidence_line}" if v.evidence_line is not None else name


def status_label(v: Verdict) -> str:
    return STATUS_LABEL[v.status] + (" (exposed)" if v.exposed else "")


def _row(v: Verdict) -> tuple[str, ...]:
    return (
        v.instance,
        v.role,
        v.model or "",
        interval(v),
        f"{v.check}. {v.check_name}",
        status_label(v),
        v.detail,
        evidence(v),
        ended(v),
    )


def markdown(verdicts: Sequence[Verdict], *, headline: str, now: str | None, notes: Sequence[str]) -> str:
    """The headline, the answer for now, one table row per verdict and the notes."""
    lines = [
        f"**{markdown_text(headline)}**",
        "",
        *([f"**{markdown_text(now)}**", ""] if now is not None else []),
        "| " + " | ".join(TABLE_HEAD) + " |",
        "|---" * len(TABLE_HEAD) + "|",
    ]
    lines += ["| " + " | ".join(markdown_text(x) for x in _row(v)) + " |" for v in verdicts]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {markdown_text(n)}" for n in notes]
    return "\n".join(lines) + "\n"


_COLOUR = {"pass": "#1a7f37", "fail": "#cf222e", "unknown": "#9a6700", "not_applicable": "#57606a"}


def html_fragment(verdicts: Sequence[Verdict], *, headline: str, now: str | None, notes: Sequence[str]) -> str:
    """The same as :func:`markdown` as one ``<div class="kvf-audit">`` (notebooks, the report)."""

    def e(text: str) -> str:
        return html.escape(visible_controls(text))

    rows = []
    for v in verdicts:
        weight = "font-weight:bold;" if v.status == "fail" else ""
        rows.append(
            "<tr>"
            + "".join(f"<td>{e(x)}</td>" for x in (v.instance, v.role, v.model or "", interval(v)))
            + f"<td>{v.check}. {e(v.check_name)}</td>"
            + f'<td style="color:{_COLOUR[v.status]};{weight}">{e(status_label(v))}</td>'
            + f"<td>{e(v.detail)}</td><td><code>{e(evidence(v))}</code></td><td>{e(ended(v))}</td></tr>"
        )
    notes_html = (
        ("<details><summary>Notes</summary><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul></details>")
        if notes
        else ""
    )
    head = "".join(f"<th>{h}</th>" for h in TABLE_HEAD)
    now_html = f"<p><strong>{e(now)}</strong></p>" if now is not None else ""
    return (
        f'<div class="kvf-audit"><p><strong>{e(headline)}</strong></p>{now_html}'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{notes_html}</div>"
    )


_STYLE = {"pass": "green", "fail": "bold red", "unknown": "yellow", "not_applicable": "dim"}


def rich_table(verdicts: Sequence[Verdict]) -> Table:
    table = Table(title="Deployment exposure audit", show_lines=False, expand=False)
    for name in TABLE_HEAD:
        table.add_column(name, overflow="fold")
    for v in verdicts:
        cells = [Text(visible_controls(x)) for x in _row(v)]
        cells[5].stylize(_STYLE[v.status])
        table.add_row(*cells)
    return table


def content_width(table: Table) -> int:
    """The width at which *table* prints every row on one line (its widest cell decides)."""
    wide = Console(width=1_000_000, file=None, color_system=None)
    return Measurement.get(wide, wide.options, table).maximum


def terminal(
    console: Console,
    verdicts: Sequence[Verdict],
    *,
    headline: str,
    now: str | None,
    notes: Sequence[str],
    exposed: bool,
    exposed_now: bool,
) -> None:
    """Print the table, the headline, the answer for now and the notes on *console*.

    On a terminal Rich fits the table to the window. Anywhere else (a file, a pipe) the lines are as
    long as their content: a row of the table is never split over lines, so ``grep`` finds it whole.
    """
    fit = not console.is_terminal
    table = rich_table(verdicts)
    if fit:  # a centred title would be padded to the table's width
        console.print(Text(str(table.title), style="bold italic"), soft_wrap=True)
        table.title = None
    console.print(table)
    console.print(Text(headline, style="bold red" if exposed else "bold"), soft_wrap=fit)
    if now is not None:
        console.print(Text(now, style="bold red" if exposed_now else "bold"), soft_wrap=fit)
    for n in notes:
        console.print(Text(f"note: {n}", style="dim"), soft_wrap=fit)


class _StdoutConsole(Console):
    """Rich ends the process with ``SystemExit(1)`` when the reader of stdout goes away (``| head``);
    exit 1 means "exposed" here, so the closed pipe is left to the caller as the BrokenPipeError it is."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def stdout_console(verdicts: Sequence[Verdict]) -> Console:
    """A console on standard output: the terminal's when it is one, else one as wide as the table."""
    probe = _StdoutConsole()
    if probe.is_terminal:
        return probe
    return _StdoutConsole(width=max(content_width(rich_table(verdicts)), 80), color_system=None)
