"""Markdown report: the tables of :mod:`qdeploy.report.tables` as GitHub-flavoured Markdown."""
from __future__ import annotations

from collections.abc import Mapping

from qdeploy.report import tables as T


def _cell(text: str) -> str:
    # A "|" would split the cell and a newline the row; "<" could be taken for an HTML tag.
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def table_lines(t: T.Table) -> list[str]:
    if not t.rows:
        return ["_No data._"]
    lines = ["| " + " | ".join(map(_cell, t.headers)) + " |",
             "|" + "|".join("---:" if n else "---" for n in t.numeric) + "|"]
    lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in t.rows]
    return lines


def verdict_lines(results: Mapping) -> list[str]:
    """The recommendation as a block quote: the first thing a reader sees, before any table."""
    v = T.verdict(results)
    if v is None:
        return []
    out = [f"> **{T.WARNING_MARK} {_cell(line)}**" + ("  " if i + 1 < len(v.warnings) else "")
           for i, line in enumerate(v.warnings)]
    if out:
        out.append(">")
    if v.headline:
        out += [f"> **{_cell(v.headline)}** — {_cell(v.why)}", ">"]
    out += [f"> {_cell(line)}  " for line in v.lines]
    if v.excluded:
        out += [">", "> Not recommended:", ">"]
        out += [f"> - {_cell(name)}: {_cell(why)}" for name, why in v.excluded]
    return out + [""]


def render_markdown(results: Mapping) -> str:
    """The whole report as Markdown: recommendation, summary, then one table per concern (``tables.all_tables``)."""
    out = [f"# {_cell(T.title(results))}", ""]
    out += verdict_lines(results)
    out += [f"- **{name}:** {_cell(text)}" for name, text in T.summary(results)]
    for t in T.all_tables(results):
        out += ["", f"## {t.title}", ""]
        if t.caption:
            out += [_cell(t.caption), ""]
        out += table_lines(t)
        if t.notes and t.rows:
            out += [""] + [f"- {_cell(note)}" for note in t.notes]
    return "\n".join(out) + "\n"
