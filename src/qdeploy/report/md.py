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


def render_markdown(results: Mapping) -> str:
    """The whole report as Markdown: summary, then one table per concern (see ``tables.all_tables``)."""
    out = [f"# {_cell(T.title(results))}", ""]
    out += [f"- **{name}:** {_cell(text)}" for name, text in T.summary(results)]
    for t in T.all_tables(results):
        out += ["", f"## {t.title}", ""]
        if t.caption:
            out += [_cell(t.caption), ""]
        out += table_lines(t)
    return "\n".join(out) + "\n"
