"""Rich progress for long work: records per second while loading, a line per stage."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvforensics.core.escaping import visible_controls

console = Console(stderr=True)


@contextmanager
def record_progress(label: str, enabled: bool = True) -> Iterator[tuple[Callable[[int], None], Callable[[str], None]]]:
    """Yields ``(tick, describe)``: tick(n) adds n records, describe(text) names the current file."""
    if not enabled:
        yield (lambda n: None), (lambda text: None)
        return
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=None),
        TextColumn("{task.completed:,} records"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
        transient=not sys.stderr.isatty(),
        disable=not sys.stderr.isatty(),
    )
    with progress:
        task = progress.add_task(label, total=None, rate="")

        def tick(n: int) -> None:
            progress.advance(task, n)
            t = progress.tasks[task]
            if t.elapsed:
                progress.update(task, rate=f"{t.completed / t.elapsed:,.0f} rec/s")

        def describe(text: str) -> None:
            progress.update(task, description=f"{label}: {text}")

        yield tick, describe


def stage(message: str, enabled: bool = True) -> None:
    if enabled:
        console.print(f"[bold cyan]>[/] {visible_controls(message)}")  # no terminal sequence from the inputs
