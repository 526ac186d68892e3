"""One console for qdeploy's messages (stderr, so stdout stays clean for machine-readable output)."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True, highlight=False)
_quiet = False
_debug = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def set_debug(debug: bool) -> None:
    """``--debug``: a variant's internal error prints its traceback where it happens (it is in results.json anyway)."""
    global _debug
    _debug = debug


def is_debug() -> bool:
    return _debug


def is_quiet() -> bool:
    return _quiet


def log(msg: str) -> None:
    if not _quiet:
        console.print(f"[dim]qdeploy[/dim] {msg}", markup=True, soft_wrap=True)


_said: "set | None" = None  # inside each_warning_once(): the warnings already printed


@contextmanager
def each_warning_once():
    """A command that opens several runs (optimize: search, then confirm) prints each identical warning once."""
    global _said
    outer = _said
    _said = set() if outer is None else outer
    try:
        yield
    finally:
        _said = outer


def warn(msg: str) -> None:
    from rich.markup import escape

    if _said is not None:
        if msg in _said:
            return
        _said.add(msg)

    # warnings are plain text (file names, "qdeploy[tensorrt]"): brackets must not be read as rich styles
    console.print(f"[yellow]warning:[/yellow] {escape(msg)}", soft_wrap=True)


@contextmanager
def progress(desc: str, total: int | None):
    """A progress bar; yields ``advance(n)``. Transient so finished bars don't clutter the log."""
    bar = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=console, transient=True, disable=_quiet or not console.is_terminal,
    )
    with bar:
        task = bar.add_task(desc, total=total)
        yield lambda n=1: bar.advance(task, n)
